"""The Blackwell kernel (tl.dot_scaled) against the reference.

On a machine without CUDA these run under Triton's interpreter (conftest sets
TRITON_INTERPRET=1), whose tl.dot_scaled multiplies the dequantized MX values
in fp32, as the block-scaled tensor cores do; with CUDA they run the compiled
kernel (native on sm_100, Triton's exact emulation elsewhere).

Tolerances. The kernel quantizes exactly as the reference does, so with fp32
inputs the only differences are the order of fp32 accumulations (QK^T, the
online-softmax rescaling, P·V), exp2 against exp, and 1/l: a few ulp of fp32
(errors seen: under 1e-6), hence FP32_TOL. With bf16/fp16 inputs P is rounded
to V's dtype relative to the running row max instead of the final one
(docs/semantics.md), which moves single probabilities by up to one ulp of that
dtype, and the output is rounded to it: HALF_TOL, two output ulps at 1. FP8
P·V rounds P to e4m3 the same way, up to one e4m3 ulp (2^-3 relative) per
probability, which averages out over keys (seen: max 2.6e-2, mean 8e-4):
FP8_PV_TOL and FP8_PV_MEAN_TOL; with one key block holding every key the
running max is the final max and FP8 P·V matches within FP32_TOL, except
where exp2 and exp, a last bit apart, put P * 256 on two sides of an e4m3
rounding boundary (one row in about a hundred runs: then one probability
moves by one e4m3 ulp). Each
tolerance is checked against the change that putting tiles in the other
precision class makes (`_assert_discriminates`).

Inputs are random multiples of 2^-5 on CPU: K's per-channel sums are then
exact in any order, so the kernel's key mean (a Triton reduction) equals the
reference's torch.mean bit for bit and smoothing moves no MX rounding. On
CUDA the two means can differ in the last bit, so there the reference gets K
smoothed with the kernel's mean (`_reference`).
"""

import pytest
import torch

import dma_compile
from dma_compile import AttentionPolicy
from dma_compile.formats import quantize_mx
from dma_compile.kernels import Unsupported
from dma_compile.kernels.attention_sm100 import attention_sm100
from dma_compile.kernels.quantize import kv_statistics
from dma_compile.kernels.quantize_mx import quantize_payloads
from dma_compile.reference import counted_keys, dma_attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_TOL = 1e-5
HALF_TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
FP8_PV_TOL = 5e-2
FP8_PV_MEAN_TOL = 2e-3


def _randn(*shape, dtype=torch.float32, scale=1.0):
    x = torch.randn(*shape, device=DEVICE) * scale
    if DEVICE == "cpu":
        x = torch.round(x * 32) / 32
    return x.to(dtype)


def _qkv(b, hq, hk, lq, lk, d, dtype=torch.float32, dv=None):
    q = _randn(b, hq, lq, d, dtype=dtype)
    # An offset per channel, so that K smoothing matters.
    k = _randn(b, hk, lk, d, dtype=dtype) + _randn(1, 1, 1, d, dtype=dtype, scale=2.0)
    v = _randn(b, hk, lk, dv or d, dtype=dtype)
    return q, k, v


def _reference(q, k, v, mask, causal, scale, policy):
    """The reference; on CUDA fed K smoothed (in fp32) with the mean the kernel uses."""
    if DEVICE == "cpu" or not policy.smooth_k:
        return dma_attention_reference(q, k, v, mask, causal, scale, policy)
    # The "none" class would round the smoothed K to K's dtype: exact only for fp32.
    assert "none" not in policy.formats or k.dtype == torch.float32
    counted = counted_keys(mask, causal, k.shape[0], k.shape[1], q.shape[2], k.shape[2], k.device)
    mean = kv_statistics(k, v, key_mean=True, value_scale=False, key_keep=counted).key_mean
    smoothed = k.float() - mean[:, :, None]
    return dma_attention_reference(q, smoothed, v, mask, causal, scale, policy.replace(smooth_k=False))


def _max_error(out, ref):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    return (out.float() - ref.float()).abs().max().item()


def _assert_discriminates(q, k, v, mask, causal, policy, ref, tol, factor=10):
    """The tolerance is far below what tiles in the wrong class would change."""
    swapped = policy.replace(hi=policy.lo, lo=policy.hi)
    other = dma_attention_reference(q, k, v, mask, causal, None, swapped)
    assert _max_error(other, ref) > factor * tol


FORMAT_CASES = [
    # hi, lo, policy changes, (b, hq, hk, lq, lk, d), causal
    ("mxfp8_e4m3", "mxfp4_e2m1", {}, (1, 4, 2, 77, 77, 64), True),
    ("mxfp8_e4m3", "mxfp4_e2m1", {}, (2, 2, 1, 45, 110, 128), False),
    ("mxfp8_e5m2", "mxfp8_e4m3", {"diag_tiles": 2}, (1, 3, 3, 100, 70, 64), False),
    ("none", "mxfp4_e2m1", {"sink_tiles": 0}, (1, 4, 1, 90, 90, 64), True),
    ("none", "mxfp8_e5m2", {"scale_rule": "floor", "sink_tiles": 2}, (1, 2, 2, 64, 96, 128), False),
    ("mxfp4_e2m1", "none", {"smooth_k": False}, (1, 2, 1, 50, 80, 64), True),
    # Rotated Q and K (dma_compile.rotation), after smoothing: every format and both classes.
    ("mxfp8_e4m3", "mxfp4_e2m1", {"rotate": "signed_hadamard"}, (1, 4, 2, 77, 77, 64), True),
    ("none", "mxfp4_e2m1", {"rotate": "hadamard"}, (2, 2, 1, 45, 110, 128), False),
    ("mxfp8_e5m2", "mxfp8_e4m3", {"rotate": "hadamard", "diag_tiles": 2}, (1, 3, 3, 100, 70, 64), False),
    ("mxfp4_e2m1", "none", {"rotate": "signed_hadamard", "smooth_k": False}, (1, 2, 1, 50, 80, 32), True),
]


@pytest.mark.parametrize("hi,lo,changes,shape,causal", FORMAT_CASES)
def test_formats_match_reference_fp32(seed, hi, lo, changes, shape, causal):
    """Every QK^T format in both classes: tails, GQA, Lq != Lk, D 64 and 128."""
    b, hq, hk, lq, lk, d = shape
    q, k, v = _qkv(b, hq, hk, lq, lk, d)
    policy = AttentionPolicy(tile=32, hi=hi, lo=lo, **changes)
    out = attention_sm100(q, k, v, None, causal, None, policy)
    ref = _reference(q, k, v, None, causal, None, policy)
    assert _max_error(out, ref) < FP32_TOL, f"seed {seed}"
    _assert_discriminates(q, k, v, None, causal, policy, ref, FP32_TOL)


@pytest.mark.parametrize("changes,mode", [({}, "exact"), ({"rotate": "signed_hadamard"}, "exact"),
                                          ({"rotate": "hadamard"}, "folded")])
def test_balanced_matches_reference(seed, changes, mode):
    """AttentionPolicy.balance_qk on Q and K whose channels differ by powers
    of two (as real models' do), with GQA, a causal padding mask and tails:
    the kernel equals the reference, and the unbalanced reference differs."""
    q, k, v = _qkv(2, 4, 2, 70, 70, 64)
    q = q * torch.exp2(torch.randint(-6, 7, (64,), device=DEVICE).float())
    k = k * torch.exp2(torch.randint(-6, 7, (64,), device=DEVICE).float())
    mask = torch.ones(70, 70, dtype=torch.bool, device=DEVICE).tril().expand(2, 1, 70, 70).clone()
    mask[1, :, :, :9] = False
    policy = AttentionPolicy(tile=32, mx_mode=mode, balance_qk=True, **changes)
    # Channel products up to 2^12 times the other tests' make raw scores in
    # the thousands, whose fp32 rounding (the accumulation order differs)
    # moves a peaked softmax's output by 1e-4 at 1 / sqrt(D). A softmax scale
    # 16 times smaller keeps the scaled scores, and their rounding, at the
    # other tests' size; balancing acts on the MX rounding before any scale.
    scale = 2.0 ** -7
    out = attention_sm100(q, k, v, mask, False, scale, policy)
    ref = _reference(q, k, v, mask, False, scale, policy)
    tol = 10 * FP32_TOL
    assert _max_error(out, ref) < tol, f"seed {seed}"
    unbalanced = _reference(q, k, v, mask, False, scale, policy.replace(balance_qk=False))
    assert _max_error(unbalanced, ref) > 10 * tol


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4_e2m1", "none"])
def test_one_class_matches_reference(seed, fmt):
    """hi == lo: one loop over all keys; "none" everywhere is exact attention.
    Head dim 32: MXFP4 pads the MMA's reduction to 64 with zero elements."""
    q, k, v = _qkv(1, 2, 1, 40, 70, 32)
    policy = AttentionPolicy(tile=32, hi=fmt, lo=fmt, smooth_k=fmt != "none")
    out = attention_sm100(q, k, v, None, False, 0.3, policy)
    ref = _reference(q, k, v, None, False, 0.3, policy)
    assert _max_error(out, ref) < FP32_TOL, f"seed {seed}"
    if fmt == "none":
        sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=True)
        assert _max_error(out, sdpa) < FP32_TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_match_reference(seed, dtype):
    q, k, v = _qkv(1, 4, 2, 70, 90, 64, dtype=dtype)
    policy = AttentionPolicy(tile=32)
    out = attention_sm100(q, k, v, None, True, None, policy)
    ref = _reference(q, k, v, None, True, None, policy)
    assert _max_error(out, ref) < HALF_TOL[dtype], f"seed {seed}"
    _assert_discriminates(q, k, v, None, True, policy, ref, HALF_TOL[dtype])


def _bool_mask(b, h, lq, lk):
    """Random keep pattern with a fully attended band of keys and one query row with no key at all."""
    mask = torch.rand(b, h, lq, lk, device=DEVICE) > 0.4
    mask[..., 32:64] = True
    mask[..., 5, :] = False
    return mask


MASK_CASES = [
    # mask kind, mask heads, block_m, block_n
    ("bool", 1, None, None),
    ("bool", 4, 32, 16),
    ("additive", 4, None, 32),
]


@pytest.mark.parametrize("kind,mask_heads,block_m,block_n", MASK_CASES)
def test_masks_match_reference(seed, kind, mask_heads, block_m, block_n):
    """Explicit masks (broadcast over heads or not), blocks smaller than the tile, bottom-right band."""
    b, hq, hk, lq, lk = 2, 4, 2, 70, 100
    q, k, v = _qkv(b, hq, hk, lq, lk, 64)
    mask = _bool_mask(b, mask_heads, lq, lk)
    if kind == "additive":
        bias = torch.where(mask, 0.0, float("-inf")).to(DEVICE)
        bias[..., 64:] += _randn(b, mask_heads, lq, lk - 64, scale=0.5)
        mask = bias
    policy = AttentionPolicy(tile=64)
    out = attention_sm100(q, k, v, mask, False, None, policy, block_m=block_m, block_n=block_n)
    ref = _reference(q, k, v, mask, False, None, policy)
    assert _max_error(out, ref) < FP32_TOL, f"seed {seed}"
    assert (out[:, :, 5] == 0).all()
    _assert_discriminates(q, k, v, mask, False, policy, ref, FP32_TOL)


@pytest.mark.parametrize("policy", [AttentionPolicy.preset("hopper_input_pv"),
                                    AttentionPolicy(mx_mode="folded", diag_tiles=2),
                                    AttentionPolicy(mx_mode="folded", rotate="signed_hadamard")])
def test_folded_matches_reference(seed, policy):
    """Folded MX (per-token e4m3 with one power of two per row and column) on fp8 tl.dot."""
    policy = policy.replace(tile=32)
    q, k, v = _qkv(1, 4, 2, 66, 96, 64)
    out = attention_sm100(q, k, v, None, True, None, policy)
    ref = _reference(q, k, v, None, True, None, policy)
    assert _max_error(out, ref) < FP32_TOL, f"seed {seed}"
    _assert_discriminates(q, k, v, None, True, policy, ref, FP32_TOL)


def test_fp8_pv_single_key_block_is_exact(seed):
    """With every key in one block the running max is the final max: e4m3(P * 256)
    is the reference's, but for the rare probability that exp2 and exp round to
    two sides of an e4m3 rounding boundary (one e4m3 ulp, 2^-3 relative, of one P)."""
    q, k, v = _qkv(1, 2, 2, 50, 100, 64)
    policy = AttentionPolicy(tile=128, pv="fp8")
    out = attention_sm100(q, k, v, None, False, None, policy)
    ref = _reference(q, k, v, None, False, None, policy)
    row_error = (out.float() - ref.float()).abs().amax(-1)
    assert int((row_error >= FP32_TOL).sum()) <= 2, f"seed {seed}: {row_error.max().item():.3g}"
    assert row_error.max().item() < 2.0**-3 * v.abs().max().item(), f"seed {seed}"
    assert _max_error(dma_attention_reference(q, k, v, None, False, None, policy.replace(pv="input")), ref) > 1e-3


def test_fp8_pv_matches_reference(seed):
    """FP8 P·V over many key blocks, head_dim of V != of Q and K."""
    q, k, v = _qkv(1, 4, 2, 70, 90, 64, dv=32)
    policy = AttentionPolicy(tile=32, pv="fp8", hi="none", lo="mxfp4_e2m1")
    out = attention_sm100(q, k, v, None, True, None, policy)
    ref = _reference(q, k, v, None, True, None, policy)
    assert _max_error(out, ref) < FP8_PV_TOL, f"seed {seed}"
    assert (out - ref).abs().mean().item() < FP8_PV_MEAN_TOL, f"seed {seed}"
    _assert_discriminates(q, k, v, None, True, policy, ref, FP8_PV_TOL, factor=4)


def test_expanded_kv_heads(seed):
    """K and V expanded over heads with stride 0 (no copy) are read as one KV head."""
    q, k, v = _qkv(1, 4, 1, 40, 50, 64)
    k, v = k.expand(1, 4, 50, 64), v.expand(1, 4, 50, 64)
    policy = AttentionPolicy(tile=32)
    out = attention_sm100(q, k, v, None, False, None, policy)
    ref = _reference(q, k, v, None, False, None, policy)
    assert _max_error(out, ref) < FP32_TOL, f"seed {seed}"


def test_reachable_through_the_op(seed):
    """dma_attention(impl="sm100") runs this kernel: results equal a direct call bit for bit."""
    q, k, v = _qkv(1, 2, 1, 40, 40, 64, dtype=torch.bfloat16)
    policy = AttentionPolicy(tile=32)
    via_op = dma_compile.dma_attention(q, k, v, is_causal=True, policy=policy, impl="sm100")
    direct = attention_sm100(q, k, v, None, True, None, policy)
    assert torch.equal(via_op, direct)
    ref = _reference(q, k, v, None, True, None, policy)
    assert _max_error(via_op, ref) < HALF_TOL[torch.bfloat16]


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4_e2m1"])
def test_payloads_are_formats_quantize_mx(seed, fmt):
    """The payload pass writes formats.quantize_mx's bytes, NaN/Inf blocks and subnormal scales included."""
    x = _randn(2, 3, 37, 64, scale=4.0) * torch.exp2(torch.randint(-30, 30, (2, 3, 37, 1), device=DEVICE))
    x[0, 0, 3, 5] = float("nan")
    x[1, 2, 7, 40] = float("-inf")
    x[0, 1, 2] = 0.0
    x[0, 1, 4, :32] = 1e-39
    x = x.to(torch.bfloat16)
    mean = torch.randn(2, 3, 64, device=DEVICE)
    mean[0, 1] = 0.0  # keeps the subnormal block of x[0, 1, 4] subnormal
    smoothed = x.float() - mean[:, :, None]
    for rule in ("rceil", "floor"):
        got = quantize_payloads(x, (fmt,), rule, mean=mean, write_none=True)
        want = quantize_mx(smoothed, fmt, rule)
        assert torch.equal(got[fmt].scales, want.scales)
        assert torch.equal(got[fmt].payload, want.payload.view(torch.uint8))
        torch.testing.assert_close(got["none"], smoothed.to(torch.bfloat16), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2", "mxfp4_e2m1"])
@pytest.mark.parametrize("kind", ["hadamard", "signed_hadamard"])
@pytest.mark.parametrize("smoothed", [True, False], ids=["smoothed", "plain"])
def test_rotated_payloads_are_formats_quantize_mx(seed, fmt, kind, smoothed):
    """With rotation the pass quantizes rotation.rotate of the (smoothed)
    values (bit for bit, NaN/Inf tokens and tokens near float32's largest
    value included); "none" stays unrotated. Plain bf16 tokens get their
    signs as they widen (`hadamard.with_sign_bits`), and every rotated block
    its 1 / sqrt(D) with its power of two."""
    from dma_compile.rotation import rotate

    x = _randn(2, 3, 37, 128, scale=4.0) * torch.exp2(torch.randint(-30, 30, (2, 3, 37, 1), device=DEVICE))
    x[0, 1, 9] = 2.0**120 * torch.sign(_randn(128))  # block scales near float32's top
    x[0, 0, 3, 5] = float("nan")
    x[1, 2, 7, 40] = float("-inf")
    x = x.to(torch.bfloat16)
    mean = torch.randn(2, 3, 128, device=DEVICE) if smoothed else None
    before = x.float() - mean[:, :, None] if smoothed else x.float()
    got = quantize_payloads(x, (fmt,), "rceil", mean=mean, write_none=smoothed, rotate=kind)
    want = quantize_mx(rotate(before, kind), fmt)
    assert torch.equal(got[fmt].scales, want.scales), f"seed {seed}"
    assert torch.equal(got[fmt].payload, want.payload.view(torch.uint8)), f"seed {seed}"
    assert not torch.equal(want.scales, quantize_mx(before, fmt).scales)
    if smoothed:
        torch.testing.assert_close(got["none"], before.to(torch.bfloat16), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kind", ["none", "hadamard"])
def test_balanced_payloads_are_formats_quantize_mx(seed, kind):
    """With balancing factors the payload pass quantizes rotate(smoothed x *
    factors) bit for bit, per (batch, head); "none" stays unscaled."""
    from dma_compile.rotation import rotate

    x = _randn(2, 3, 45, 64, scale=4.0).to(torch.bfloat16)
    mean = torch.randn(2, 3, 64, device=DEVICE)
    factors = torch.exp2(torch.randint(-5, 6, (2, 3, 64), device=DEVICE).float())
    smoothed = x.float() - mean[:, :, None]
    got = quantize_payloads(x, ("mxfp4_e2m1",), "rceil", mean=mean, write_none=True, rotate=kind, balance=factors)
    want = quantize_mx(rotate(smoothed * factors[:, :, None], kind), "mxfp4_e2m1")
    assert torch.equal(got["mxfp4_e2m1"].scales, want.scales), f"seed {seed}"
    assert torch.equal(got["mxfp4_e2m1"].payload, want.payload.view(torch.uint8)), f"seed {seed}"
    assert not torch.equal(want.scales, quantize_mx(rotate(smoothed, kind), "mxfp4_e2m1").scales)
    torch.testing.assert_close(got["none"], smoothed.to(torch.bfloat16), rtol=0, atol=0)


def test_unsupported_and_bad_blocks():
    q, k, v = _qkv(1, 2, 2, 20, 20, 64)
    with pytest.raises(Unsupported, match="head_dim"):
        attention_sm100(q[..., :48], k[..., :48], v, None, False, None, AttentionPolicy(hi="none", lo="none"))
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        attention_sm100(q, k, v, None, False, None, AttentionPolicy(tile=32), block_n=64)
