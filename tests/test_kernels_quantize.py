"""The Triton quantization pass against dma_compile.formats and the reference.

Every comparison here is bit-exact: the pass must round exactly like
`formats` (nearest even, saturating, rceil/floor scales, E8M0 clamp, NaN/Inf
blocks). Inputs mix binades within blocks and include tails of tiny and huge
values, all-zero blocks, NaN and Inf. The "cpu" cases run the kernels under
Triton's interpreter (set by conftest when there is no GPU), "cuda" on a GPU.
`formats` always runs on the CPU: on an H200 its rceil comparison (float64
ldexp) disagreed with the exact answer at amax = max_normal * 2^k ties while
the CPU evaluation is exact.
"""

import os

import pytest
import torch

from dma_compile import formats
from dma_compile.reference import fp8_value_scale, key_mean

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (no GPU)")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


def _q():
    from dma_compile.kernels import quantize

    return quantize


def on_cpu(operands):
    """{format: (values, exponents, scales)} of the pass's output, moved to the CPU."""
    return {f: tuple(None if t is None else t.cpu() for t in (op.values, op.exponents, op.scales))
            for f, op in operands.items()}


def tailed(shape, dtype, device):
    """Random values spread over many binades, with tiny/huge/zero/NaN/Inf blocks."""
    x = torch.randn(shape) * torch.exp2(torch.randint(-10, 11, shape).float())
    blocks = x.view(-1, x.shape[-1] // 32, 32)
    n = blocks.shape[0]
    tiny, huge = (2.0**-118, 2.0**100) if dtype == torch.bfloat16 else (2.0**-20, 2.0**6)
    blocks[0::7, 0] *= tiny
    blocks[3::11, -1] *= huge
    blocks[5::13, 0] = 0.0
    blocks[1::17, 0, 0] *= 2.0**-40 if dtype == torch.bfloat16 else 2.0**-14
    if n > 40:
        blocks[2, 0, 3] = float("nan")
        blocks[9, -1, 5] = float("inf")
        blocks[20, 0, 7] = float("-inf")
    return x.to(dtype).to(device)


def same(a, b):
    """Bitwise-equal values, NaN equal to NaN."""
    a, b = a.float(), b.float()
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale_rule", ["rceil", "floor"])
@pytest.mark.parametrize("mode", ["folded", "exact"])
@pytest.mark.parametrize("fmts", [("mxfp8_e4m3", "mxfp4_e2m1"), ("mxfp8_e5m2",)])
def test_tokens_match_formats(device, dtype, scale_rule, mode, fmts, seed):
    shape = (2, 3, 37, 64) if device == "cpu" else (2, 8, 1000, 128)
    x = tailed(shape, dtype, device)
    # Whole tokens of tiny values: their folded exponents lie below float32's
    # normal range, where the powers of two for the kernels are clamped.
    x[0, 0, :2] = (torch.randn(2, shape[-1]) * (2.0**-127 if dtype == torch.bfloat16 else 2.0**-20)).to(dtype)
    got = on_cpu(_q().quantize_tokens(x, fmts, mode, scale_rule, pow2_scales=True))
    x = x.cpu()
    for fmt in fmts:
        mx = formats.quantize_mx(x.float(), fmt, scale_rule)
        if mode == "folded":
            elements, exponents = formats.fold_mx(mx)
            values, got_exponents, got_scales = got[fmt]
            assert values.dtype == torch.float8_e4m3fn
            assert same(values, elements), f"seed {seed} {fmt} payload"
            assert torch.equal(got_exponents, exponents), f"seed {seed} {fmt} exponents"
            assert torch.equal(got_scales, torch.exp2(exponents.clamp(-126, 127).float())), f"seed {seed} {fmt} scales"
        else:
            values, _, scales = got[fmt]
            assert scales is None
            assert values.dtype == torch.bfloat16
            assert same(values, mx.dequantize().to(torch.bfloat16)), f"seed {seed} {fmt}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_smoothed_keys(device, dtype, seed):
    shape = (2, 2, 45, 64) if device == "cpu" else (2, 4, 3000, 128)
    k = (torch.randn(shape) * 2 + torch.randn(shape[-1]) * 3).to(dtype).to(device)
    stats = _q().kv_statistics(k, k, key_mean=True, value_scale=False)
    # Summed in float64 in another order than the reference's, rounded to the same float32.
    assert torch.equal(stats.key_mean.cpu(), key_mean(k.cpu()).squeeze(-2)), f"seed {seed}"
    got = _q().quantize_tokens(k, ("mxfp8_e4m3",), "folded", "rceil", mean=stats.key_mean, write_none=True)
    got = on_cpu(got)
    k = k.cpu()
    smoothed = k.float() - stats.key_mean.cpu().unsqueeze(-2)
    assert torch.equal(got["none"][0], smoothed.to(dtype)), f"seed {seed}"
    elements, exponents = formats.fold_mx(formats.quantize_mx(smoothed, "mxfp8_e4m3"))
    assert same(got["mxfp8_e4m3"][0], elements), f"seed {seed}"
    assert torch.equal(got["mxfp8_e4m3"][1], exponents), f"seed {seed}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_values_fp8(device, dtype, seed):
    shape = (2, 3, 77, 32) if device == "cpu" else (2, 4, 2000, 128)
    v = (torch.randn(shape) * torch.exp2(torch.randint(-6, 7, (shape[-1],)).float())).to(dtype)
    v[0, 1, :, 5] = 0.0
    v[1, 2, 7, 3] = float("nan")
    v[1, 0, :, 4] *= 2.0**-20
    v = v.to(device)
    stats = _q().kv_statistics(v, v, key_mean=False, value_scale=True)
    vt = _q().quantize_values_fp8(v, stats.value_exponents).cpu()
    v = v.cpu()
    scale = fp8_value_scale(v)
    assert same(stats.value_scales.cpu(), scale.squeeze(-2)), f"seed {seed}"
    assert vt.shape == (*shape[:2], shape[3], -(-shape[2] // 16) * 16)
    expected = formats.round_to_element(v.float() / scale, formats.E4M3)
    assert same(vt[..., : shape[2]].transpose(-1, -2), expected), f"seed {seed}"


def element_grid(fmt):
    """Every finite value of an MX element format, both signs."""
    if fmt == "mxfp4_e2m1":
        magnitudes = torch.tensor(formats.E2M1_VALUES)
        return torch.cat([magnitudes, -magnitudes])
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn if fmt == "mxfp8_e4m3" else torch.float8_e5m2).float()
    return values[torch.isfinite(values)]


@pytest.mark.parametrize("fmt", formats.FORMATS)
def test_folded_rerounding_in_float16_is_exact(fmt):
    """The identity `quantize.folded_mx` relies on on a GPU, where it
    re-rounds each element to its token's exponent in float16: for every
    element value and every shift a token can give it, e4m3(elem * 2^shift)
    computed from float16 (e5m2 elements scaled by 2^-8 first, float16's
    powers of two zero below 2^-24) equals the float32 computation, sign of
    zero included. Without the e5m2 pre-scale it does not."""
    elements = element_grid(fmt)[:, None]
    emax = formats.ELEMENT[fmt].emax
    shift = torch.arange(-300, emax - 8 + 1)[None, :]
    want = formats.round_to_element(torch.ldexp(elements, shift.float()), formats.E4M3)

    def from_float16(pre):
        power = torch.where(shift + pre >= -24, torch.exp2((shift + pre).float()), 0.0).half()
        return formats.round_to_element(((elements * 2.0**-pre).half() * power).float(), formats.E4M3)

    pre = 8 if fmt == "mxfp8_e5m2" else 0
    got = from_float16(pre)
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
    if fmt == "mxfp8_e5m2":
        assert not torch.equal(from_float16(0), want)


def test_wgmma_key_order_is_a_permutation_within_each_32_keys():
    order = _q().wgmma_key_order(96)
    assert sorted(order.tolist()) == list(range(96))
    assert torch.equal(order // 32, torch.arange(96) // 32)
    # An accumulator thread q (columns 8j + 2q + e) holds its operand's columns 16h + 4q + 2j + e.
    for q in range(4):
        assert set(order[[16 * h + 4 * q + i for h in range(2) for i in range(4)]].tolist()) == \
            {8 * j + 2 * q + e for j in range(4) for e in range(2)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [False, True])
def test_values_fp8_in_wgmma_key_order(device, fused, seed):
    """V^T for the Gluon kernel: column c holds key wgmma_key_order[c], the
    columns of keys past Lk (some inside Lk's last 32) are zeros, and keys
    that do not count stay zeros wherever they land."""
    b, h, length, d = (1, 2, 70, 32) if device == "cpu" else (2, 4, 1000, 128)
    v = torch.randn(b, h, length, d).to(torch.bfloat16)
    keep = torch.rand(b, 1, length) > 0.2
    v[0, 0, 3, 5] = float("nan")
    v = v.to(device)
    stats = _q().kv_statistics(v, v, key_mean=False, value_scale=True)
    args = (v, stats.value_exponents, keep.to(device), length - 5)
    plain = _q().quantize_values_fp8(*args).cpu().view(torch.uint8)
    if fused:
        # Beside K's token programs, as the pass's fewest-launch path runs it.
        plan = _q().plan_tokens(v, ("mxfp8_e4m3",), "folded", "rceil", pow2_scales=True)
        ordered = _q().quantize_keys_and_values(plan, *args, wgmma_order=True)
    else:
        ordered = _q().quantize_values_fp8(*args, wgmma_order=True)
    ordered = ordered.cpu().view(torch.uint8)
    padded = -(-length // 32) * 32
    assert ordered.shape == (b, h, d, padded)
    key = _q().wgmma_key_order(padded)
    inside = key < length
    assert torch.equal(ordered[..., inside], plain[..., key[inside]]), f"seed {seed}"
    assert not ordered[..., ~inside].any()
    assert (~inside).any() and (key[: length] >= length).any(), "the case must put keys past Lk inside it"


@pytest.mark.parametrize("device", DEVICES)
def test_statistics_over_several_chunks(device, seed):
    """K's mean and V's scales from one pass over both, split into chunks of keys
    (on the CPU too: at most 64 keys per step), with NaN and Inf in K and V:
    they do not move the statistics (docs/semantics.md)."""
    shape = (1, 2, 333, 32) if device == "cpu" else (2, 3, 20000, 128)
    k = (torch.randn(shape) * 3 + torch.randn(shape[-1]) * 5).to(torch.bfloat16)
    v = (torch.randn(shape) * torch.exp2(torch.randint(-8, 9, (shape[-1],)).float())).to(torch.bfloat16)
    k[0, 1, 5, 3], k[0, 0, -2, 7] = float("nan"), float("inf")
    v[0, 1, -1, 2], v[0, 0, 3, 1] = float("nan"), float("-inf")
    stats = _q().kv_statistics(k.to(device), v.to(device), key_mean=True, value_scale=True)
    assert torch.equal(stats.key_mean.cpu(), key_mean(k.cpu()).squeeze(-2)), f"seed {seed}"
    assert same(stats.value_scales.cpu(), fp8_value_scale(v).squeeze(-2)), f"seed {seed}"
    others = torch.cat([k[0, 1, :5, 3], k[0, 1, 6:, 3]]).double()
    assert stats.key_mean[0, 1, 3].item() == others.mean().float().item(), f"seed {seed}"
    assert torch.isfinite(stats.key_mean).all() and torch.isfinite(stats.value_scales).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunking", [dict(step_elements=512, programs=3), dict(step_elements=4096, programs=64)])
@pytest.mark.parametrize("num_warps", [4, 8])
def test_statistics_do_not_depend_on_the_launch(device, chunking, num_warps, seed):
    """Other steps, chunk counts and warps (the launch sweeps' knobs) give
    the default launch's K mean and V scales bit for bit, NaN and Inf
    included: the chunks' partial results combine in any grouping."""
    shape = (1, 2, 333, 64) if device == "cpu" else (2, 3, 20000, 128)
    k = (torch.randn(shape) * 3 + torch.randn(shape[-1]) * 5).to(torch.bfloat16)
    v = (torch.randn(shape) * torch.exp2(torch.randint(-8, 9, (shape[-1],)).float())).to(torch.bfloat16)
    k[0, 1, 5, 3], v[0, 0, 3, 1] = float("nan"), float("-inf")
    k, v = k.to(device), v.to(device)
    default = _q().kv_statistics(k, v, key_mean=True, value_scale=True)
    other = _q().kv_statistics(k, v, key_mean=True, value_scale=True, chunking=chunking, num_warps=num_warps)
    assert torch.equal(other.key_mean, default.key_mean), f"seed {seed}"
    assert torch.equal(other.value_exponents, default.value_exponents), f"seed {seed}"
    assert torch.equal(other.key_mean.cpu(), key_mean(k.cpu()).squeeze(-2)), f"seed {seed}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rotate", ["none", "signed_hadamard"])
@pytest.mark.parametrize("block_t", [16, 128])
def test_token_pass_does_not_depend_on_tokens_per_program(device, rotate, block_t, seed):
    """A launch with other tokens per program (the launch sweep's knob; the
    rotating butterfly changes form at 64) writes the plan's launch's bits."""
    shape = (2, 3, 77, 64) if device == "cpu" else (2, 8, 3000, 128)
    x = tailed(shape, torch.bfloat16, device)
    mean = (torch.randn(shape[0], shape[1], shape[-1]) * 3).to(device)
    plan = _q().plan_tokens(x, ("mxfp8_e4m3", "mxfp4_e2m1"), "folded", "rceil", mean=mean, pow2_scales=True,
                            rotate=rotate)
    _q().launch_tokens(plan)
    expected = on_cpu(plan.operands)
    for op in plan.operands.values():
        for t in (op.values, op.exponents, op.scales):
            t.zero_()
    _q().launch_tokens(plan, block_t=block_t)
    got = on_cpu(plan.operands)
    for fmt, tensors in expected.items():
        for want, have in zip(tensors, got[fmt]):
            assert want is None or torch.equal(have.view(torch.uint8), want.view(torch.uint8)), f"seed {seed} {fmt}"


@pytest.mark.parametrize("device", DEVICES)
def test_statistics_count_only_kept_keys(device, seed):
    """Keys that key_keep marks 0 or that lie past key_limit move neither K's
    mean nor V's scales, whatever they hold, and FP8 V stores them as zeros."""
    b, h, length, d = (2, 2, 150, 32) if device == "cpu" else (2, 4, 5000, 128)
    k = (torch.randn(b, h, length, d) + torch.randn(d) * 3).to(torch.bfloat16)
    v = torch.randn(b, h, length, d).to(torch.bfloat16)
    keep = torch.rand(b, 1, length) > 0.3  # broadcast over the heads, as a key-padding mask's
    limit = length - 17
    counted = keep.expand(b, h, length) & (torch.arange(length) < limit)
    stats = _q().kv_statistics(k.to(device), v.to(device), True, True, key_keep=keep.to(device), key_limit=limit)
    assert torch.equal(stats.key_mean.cpu(), key_mean(k, counted).squeeze(-2)), f"seed {seed}"
    assert same(stats.value_scales.cpu(), fp8_value_scale(v, counted).squeeze(-2)), f"seed {seed}"
    assert not torch.equal(stats.key_mean.cpu(), key_mean(k).squeeze(-2))

    garbage = torch.randn(b, h, length, d) * 1000
    garbage[..., ::3, 1] = float("nan")
    k2 = torch.where(counted[..., None], k, garbage.to(k.dtype)).to(device)
    v2 = torch.where(counted[..., None], v, garbage.to(v.dtype)).to(device)
    stats2 = _q().kv_statistics(k2, v2, True, True, key_keep=keep.to(device), key_limit=limit)
    assert torch.equal(stats2.key_mean, stats.key_mean) and torch.equal(stats2.value_scales, stats.value_scales)
    vt = _q().quantize_values_fp8(v.to(device), stats.value_exponents, keep.to(device), limit).cpu()
    vt2 = _q().quantize_values_fp8(v2, stats2.value_exponents, keep.to(device), limit).cpu()
    assert torch.equal(vt.view(torch.uint8)[..., :length], vt2.view(torch.uint8)[..., :length]), f"seed {seed}"
    stored = vt[..., :length].transpose(-1, -2).float()
    assert torch.equal(stored[~counted], torch.zeros_like(stored[~counted]))
    expected = formats.round_to_element(v.float() / fp8_value_scale(v, counted), formats.E4M3)
    assert torch.equal(stored[counted], expected[counted]), f"seed {seed}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value_scale", [False, True])
def test_statistics_launch_also_quantizes_queries(device, value_scale, seed):
    """Q quantized by the statistics launch's extra programs equals Q quantized
    by its own launch, and the statistics are unchanged by sharing it."""
    kshape, qshape = ((1, 2, 150, 64), (1, 4, 41, 64)) if device == "cpu" else ((2, 4, 5000, 128), (2, 8, 3001, 128))
    k = (torch.randn(kshape) * 3 + torch.randn(kshape[-1]) * 5).to(torch.bfloat16).to(device)
    v = torch.randn(kshape).to(torch.bfloat16).to(device)
    q = tailed(qshape, torch.bfloat16, device)
    fmts = ("mxfp8_e4m3", "mxfp4_e2m1")
    plan = _q().plan_tokens(q, fmts, "folded", "rceil", pow2_scales=True)
    shared = _q().kv_statistics(k, v, key_mean=True, value_scale=value_scale, alongside=plan)
    alone = _q().kv_statistics(k, v, key_mean=True, value_scale=value_scale)
    assert torch.equal(shared.key_mean, alone.key_mean), f"seed {seed}"
    if value_scale:
        assert same(shared.value_scales, alone.value_scales), f"seed {seed}"
    expected = on_cpu(_q().quantize_tokens(q, fmts, "folded", "rceil", pow2_scales=True))
    got = on_cpu(plan.operands)
    for fmt in fmts:
        for name, a, b in zip(("values", "exponents", "scales"), got[fmt], expected[fmt]):
            assert same(a, b), f"seed {seed} {fmt} {name}"


def test_only_unsmoothed_plans_share_the_statistics_launch():
    k = torch.randn(1, 1, 8, 32).to(torch.bfloat16)
    mean = torch.zeros(1, 1, 32)
    plan = _q().plan_tokens(k, ("mxfp8_e4m3",), mean=mean)
    with pytest.raises(ValueError, match="alongside"):
        _q().kv_statistics(k, k, key_mean=True, value_scale=False, alongside=plan)


def _assert_quantized_as_formats(got, values, fmts, mode, seed):
    """The pass's operands `got` are formats' quantization of `values` (float32), bit for bit."""
    for fmt in fmts:
        mx = formats.quantize_mx(values, fmt)
        if mode == "folded":
            elements, exponents = formats.fold_mx(mx)
            assert same(got[fmt][0], elements), f"seed {seed} {fmt} payload"
            assert torch.equal(got[fmt][1], exponents), f"seed {seed} {fmt} exponents"
        else:
            assert same(got[fmt][0], mx.dequantize().to(torch.bfloat16)), f"seed {seed} {fmt}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["hadamard", "signed_hadamard"])
@pytest.mark.parametrize("mode", ["folded", "exact"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("fmts, smoothed", [
    (("mxfp8_e4m3", "mxfp4_e2m1"), True),
    (("mxfp8_e4m3", "mxfp8_e5m2"), True),
    (("mxfp8_e4m3", "mxfp4_e2m1"), False),  # the signs flipped as bf16 widens (`hadamard.sign_bits`)
], ids=["e2m1", "fp8", "e2m1-unsmoothed"])
def test_rotated_tokens_match_formats(device, kind, mode, d, fmts, smoothed, seed):
    """With rotation the pass quantizes rotation.rotate of the (smoothed)
    tokens, bit for bit (NaN/Inf blocks make their whole token NaN, as in
    the reference); the "none" output stays smoothed and unrotated. 77
    tokens: a full and a partial block of the rotating pass's 64 tokens. The
    pass applies the rotation's 1 / sqrt(D) with each block's power of two
    (`quantize.folded_mx`): the same bits, huge and tiny blocks included."""
    from dma_compile.rotation import rotate

    shape = (2, 3, 77, d) if device == "cpu" else (2, 8, 3000, d)
    x = tailed(shape, torch.bfloat16, device)
    mean = (torch.randn(shape[0], shape[1], d) * 3).to(device) if smoothed else None
    got = on_cpu(_q().quantize_tokens(x, fmts, mode, "rceil", mean=mean, write_none=smoothed, pow2_scales=True,
                                      rotate=kind))
    before = x.cpu().float() - mean.cpu().unsqueeze(-2) if smoothed else x.cpu().float()
    if smoothed:
        assert same(got["none"][0], before.to(torch.bfloat16)), f"seed {seed}"
    _assert_quantized_as_formats(got, rotate(before, kind), fmts, mode, seed)
    unrotated = formats.fold_mx(formats.quantize_mx(before, fmts[1]))[0]
    if mode == "folded":
        assert not same(got[fmts[1]][0], unrotated)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("mode", ["folded", "exact"])
@pytest.mark.parametrize("d", [32, 64, 128])
def test_rotated_tokens_near_float32_max_match_formats(mode, d, seed):
    """Tokens whose unnormalized butterfly comes close to float32's largest
    value, or passes it (a NaN/Inf block), give the largest block scales:
    there 2^-s / sqrt(D), the factor the pass applies in one multiply, must
    still be a normal float32 for e2m1 (the tightest format), bit for bit."""
    import math

    from dma_compile.rotation import rotate, unrotate

    # Rotated, a token is a spike at one channel plus noise: the butterfly
    # before normalizing reaches sqrt(D) times the spike, just below 2^128
    # for a spike of `top`, past it (Inf) in the rows with 2^0.5 * top.
    top = 2.0 ** (128 - math.log2(d) / 2 - 0.2)
    spikes = torch.zeros(1, 2, 70, d)
    rows = torch.arange(70)
    spikes[:, :, rows, rows % d] = top * torch.where(rows % 3 == 0, 2.0**0.5, 2.0 ** -(rows % 5).float())
    x = (unrotate(spikes, "signed_hadamard") + torch.randn(1, 2, 70, d)).to(torch.bfloat16)
    fmts = ("mxfp8_e4m3", "mxfp4_e2m1")
    got = on_cpu(_q().quantize_tokens(x, fmts, mode, "rceil", pow2_scales=True, rotate="signed_hadamard"))
    rotated = rotate(x.float(), "signed_hadamard")
    assert rotated[rotated.isfinite()].abs().amax() > top / 2 and not rotated.isfinite().all()
    _assert_quantized_as_formats(got, rotated, fmts, mode, seed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["none", "signed_hadamard"])
@pytest.mark.parametrize("mode", ["folded", "exact"])
def test_balanced_tokens_match_formats(device, kind, mode, seed):
    """With balancing factors (powers of two per batch, head and channel) the
    pass quantizes rotate(smoothed x * factors), bit for bit; the "none"
    output stays unscaled. Per-head factors differ, so a pass that indexed
    them wrongly would not match."""
    from dma_compile.rotation import rotate

    shape = (2, 3, 77, 64) if device == "cpu" else (2, 8, 3000, 128)
    x = tailed(shape, torch.bfloat16, device)
    mean = (torch.randn(shape[0], shape[1], shape[3]) * 3).to(device)
    factors = torch.exp2(torch.randint(-5, 6, (shape[0], shape[1], shape[3])).float()).to(device)
    fmts = ("mxfp8_e4m3", "mxfp4_e2m1")
    got = on_cpu(_q().quantize_tokens(x, fmts, mode, "rceil", mean=mean, write_none=True, pow2_scales=True,
                                      rotate=kind, balance=factors))
    smoothed = x.cpu().float() - mean.cpu().unsqueeze(-2)
    assert same(got["none"][0], smoothed.to(torch.bfloat16)), f"seed {seed}"
    _assert_quantized_as_formats(got, rotate(smoothed * factors.cpu().unsqueeze(-2), kind), fmts, mode, seed)


@pytest.mark.parametrize("device", DEVICES)
def test_statistics_launch_quantizes_rotated_queries(device, seed):
    """Q's rotated plan carried out by the statistics launch equals its own launch."""
    kshape, qshape = ((1, 2, 150, 64), (1, 4, 41, 64)) if device == "cpu" else ((2, 4, 5000, 128), (2, 8, 3001, 128))
    k = (torch.randn(kshape) * 3 + torch.randn(kshape[-1]) * 5).to(torch.bfloat16).to(device)
    q = tailed(qshape, torch.bfloat16, device)
    fmts = ("mxfp8_e4m3", "mxfp4_e2m1")
    plan = _q().plan_tokens(q, fmts, "folded", "rceil", pow2_scales=True, rotate="signed_hadamard")
    _q().kv_statistics(k, k, key_mean=True, value_scale=False, alongside=plan)
    expected = on_cpu(_q().quantize_tokens(q, fmts, "folded", "rceil", pow2_scales=True, rotate="signed_hadamard"))
    plain = on_cpu(_q().quantize_tokens(q, fmts, "folded", "rceil", pow2_scales=True))
    got = on_cpu(plan.operands)
    for fmt in fmts:
        for name, a, b in zip(("values", "exponents", "scales"), got[fmt], expected[fmt]):
            assert same(a, b), f"seed {seed} {fmt} {name}"
        assert not same(got[fmt][0], plain[fmt][0])


def test_rotation_needs_a_power_of_two_head_dim():
    with pytest.raises(ValueError, match="power of two"):
        _q().quantize_tokens(torch.randn(1, 1, 8, 96), ("mxfp8_e4m3",), rotate="hadamard")
