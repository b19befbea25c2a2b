"""The Hopper (sm_90) Triton kernel against the reference.

The "cpu" cases run the kernel under Triton's interpreter on tiny shapes
(conftest sets TRITON_INTERPRET=1 without a GPU; this is what CI runs), the
"gpu" cases the compiled kernel on larger shapes. Both reach the kernel
through `dma_attention(..., impl="sm90")`.

Tolerances. The kernel computes the reference's math (same quantized Q and K,
same P and V roundings); it differs only in
  (a) fp32 accumulation order: negligible, 1e-5 of slack;
  (b) rounding P to V's dtype (pv="input") against the running row max of
      online softmax instead of the final one: each P element carries a
      relative rounding error of at most half an ulp on either side, so the
      outputs differ by at most 2 * 2^-9 (bf16) or 2 * 2^-12 (fp16) times
      sum(P |V|) / l <= max |V|;
  (c) the final rounding to the output dtype: one ulp, 2^-7 |out| for bf16
      (8 significant bits), 2^-10 for fp16.
With pv="fp8", P is rounded to e4m3 (half an ulp is 2^-4 of the value):
the bound from (b) becomes 2^-3 max |V|, which we check, and since those
roundings are independent the relative RMS error is much smaller; we bound it
by 2^-5 (measured 2^-7 to 2^-6).
"""

import os
from dataclasses import dataclass, field

import pytest
import torch

from dma_compile import AttentionPolicy, dma_attention
from dma_compile.kernels import Unsupported
from dma_compile.reference import dma_attention_reference

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (no GPU)")

HOPPER = AttentionPolicy.preset("hopper_input_pv")
PAPER_FOLDED = AttentionPolicy(mx_mode="folded")
PAPER_EXACT = AttentionPolicy()
ALL_MXFP8 = AttentionPolicy.preset("all_mxfp8").replace(mx_mode="folded")
ALL_MXFP4 = AttentionPolicy.preset("all_mxfp4").replace(mx_mode="folded")
EXACT = AttentionPolicy.preset("exact")


@dataclass
class Case:
    name: str
    policy: AttentionPolicy
    lq: int
    lk: int
    causal: bool = False
    mask: str | None = None
    d: int = 64
    dv: int | None = None
    hq: int = 2
    hkv: int = 1
    b: int = 1
    dtype: torch.dtype = torch.bfloat16
    expanded_kv: bool = False
    # Q's and K's channels scaled by different powers of two, as real models'
    # are: what balancing (AttentionPolicy.balance_qk) acts on.
    channels: bool = False
    # A policy whose reference must NOT match: proves the comparison can fail.
    other: AttentionPolicy | None = field(default=None)
    # Why the compiled kernel is known to miss the bound on a GPU (strict xfail there).
    gpu_defect: str | None = None


def make_mask(kind, b, hq, lq, lk, dtype, device):
    if kind is None:
        return None
    if kind == "causal_bool":  # what transformers passes under torch.compile
        return torch.ones(lq, lk, dtype=torch.bool, device=device).tril(lk - lq)[None, None].expand(b, 1, lq, lk)
    if kind == "padding":  # (B, 1, 1, Lk): right padding in batch 0, left padding in batch 1
        keep = torch.ones(b, 1, 1, lk, dtype=torch.bool, device=device)
        keep[0, ..., lk - lk // 3:] = False
        keep[-1, ..., : lk // 4] = False
        return keep
    if kind == "padded_causal":
        causal = torch.ones(lq, lk, dtype=torch.bool, device=device).tril(lk - lq)
        return make_mask("padding", b, hq, lq, lk, dtype, device) & causal
    if kind == "additive":
        bias = torch.randn(b, hq, lq, lk, device=device).to(dtype)
        bias[..., lk // 3: lk // 2] = float("-inf")
        return bias
    if kind == "rows_masked":  # random keep pattern, some rows with no key at all
        keep = torch.rand(1, hq, lq, lk, device=device) > 0.3
        keep[..., 3: 3 + lq // 5, :] = False
        return keep
    raise ValueError(kind)


def inputs(case, device, scale_up=1):
    lq, lk = case.lq * scale_up, case.lk * scale_up
    b, hq, hkv = case.b, case.hq, case.hkv
    dv = case.dv or case.d
    q = torch.randn(b, hq, lq, case.d, device=device).to(case.dtype)
    # An offset on K: smoothing has something to remove.
    k = (torch.randn(b, hkv, lk, case.d, device=device) + 0.5).to(case.dtype)
    v = torch.randn(b, hkv, lk, dv, device=device).to(case.dtype)
    if case.channels:
        q = q * torch.exp2(torch.randint(-6, 7, (case.d,), device=device)).to(case.dtype)
        k = k * torch.exp2(torch.randint(-6, 7, (case.d,), device=device)).to(case.dtype)
    if case.expanded_kv:  # a single KV head expanded to all query heads with stride 0
        k, v = k[:, :1].expand(b, hq, lk, case.d), v[:, :1].expand(b, hq, lk, dv)
    mask = make_mask(case.mask, b, hq, lq, lk, case.dtype, device)
    return q, k, v, mask


def errors(out, ref, v, dtype, pv):
    diff = (out.float() - ref.float()).abs()
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    p_round = 2.0**-3 if pv == "fp8" else (2.0**-8 if dtype == torch.bfloat16 else 2.0**-11)
    bound = ulp * ref.float().abs() + p_round * v.float().abs().max() + 1e-5
    excess = (diff - bound).max().item()
    rms = (diff.pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt()).item()
    return excess, rms


def assert_matches(out, ref, v, case, what):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not torch.isnan(out).any(), f"{what}: NaN in the output"
    excess, rms = errors(out, ref, v, case.dtype, case.policy.pv)
    assert excess <= 0, f"{what}: error exceeds the bound by {excess:.3g}"
    if case.policy.pv == "fp8":
        assert rms <= 2.0**-5, f"{what}: relative RMS error {rms:.3g}"


def run_case(case, device, scale_up, seed, config=None):
    q, k, v, mask = inputs(case, device, scale_up)
    if config is None:
        out = dma_attention(q, k, v, attn_mask=mask, is_causal=case.causal, policy=case.policy, impl="sm90")
    else:
        from dma_compile.kernels.attention_sm90 import attention_sm90

        out = attention_sm90(q, k, v, mask, case.causal, None, case.policy, config=config)
    # The reference runs on the CPU: its rceil scale rule (formats.rceil_exponent)
    # was seen to disagree with the exact answer at ties on an H200.
    cpu = [x.cpu() if x is not None else None for x in (q, k, v, mask)]
    out = out.cpu()
    ref = dma_attention_reference(*cpu, case.causal, None, case.policy)
    assert_matches(out, ref, cpu[2], case, f"{case.name} seed {seed}")
    if case.other is not None:
        other = dma_attention_reference(*cpu, case.causal, None, case.other)
        excess, _ = errors(out, other, cpu[2], case.dtype, case.policy.pv)
        assert excess > 0, f"{case.name} seed {seed}: also matches {case.other}"
    return q, k, v, mask, out


def small(policy):
    return policy.replace(tile=32)


CASES = [
    Case("hopper_causal_gqa", small(HOPPER), 75, 75, causal=True, hq=4, hkv=2,
         other=small(HOPPER).replace(lo="mxfp4_e2m1")),
    Case("hopper_fp8pv_causal", small(HOPPER).replace(pv="fp8"), 70, 70, causal=True),
    Case("paper_folded_lq_lt_lk", small(PAPER_FOLDED), 40, 90,
         other=small(PAPER_FOLDED).replace(hi="mxfp4_e2m1", lo="mxfp8_e4m3")),
    Case("paper_exact_d128_fp16", small(PAPER_EXACT), 66, 66, causal=True, d=128, dtype=torch.float16,
         other=small(PAPER_EXACT).replace(diag_tiles=2)),
    Case("paper_exact_fp8pv_lq_gt_lk", small(PAPER_EXACT).replace(pv="fp8"), 90, 40),
    Case("all_mxfp8_causal_bool_mask", small(ALL_MXFP8), 70, 70, mask="causal_bool", b=2),
    Case("e5m2_floor_diag2_padding", small(PAPER_EXACT).replace(
        hi="mxfp8_e5m2", scale_rule="floor", diag_tiles=2, sink_tiles=0), 50, 80, mask="padding", b=2),
    Case("hopper_additive_fp16", small(HOPPER), 60, 60, mask="additive", dtype=torch.float16),
    Case("all_mxfp4_rows_masked", small(ALL_MXFP4), 64, 64, mask="rows_masked"),
    Case("exact_preset_causal_d128", small(EXACT), 50, 50, causal=True, d=128),
    Case("hopper_expanded_kv", small(HOPPER), 60, 60, causal=True, hq=3, expanded_kv=True),
    Case("unsmoothed_e4m3_d32_dv64", small(ALL_MXFP8).replace(smooth_k=False), 45, 45, causal=True, d=32, dv=64),
    Case("hopper_short_queries", small(HOPPER), 5, 70),
    Case("paper_folded_causal_lq_gt_lk", small(PAPER_FOLDED), 80, 50, causal=True),
    Case("hopper_padded_causal", small(HOPPER), 70, 70, mask="padded_causal", b=2),
    # Rotated Q and K (dma_compile.rotation): the other rotation, or none, must not match.
    Case("paper_exact_hadamard_causal_gqa", small(PAPER_EXACT).replace(rotate="hadamard"), 70, 70, causal=True,
         hq=4, hkv=2, other=small(PAPER_EXACT)),
    Case("all_mxfp4_signed_padding_d128", small(ALL_MXFP4).replace(rotate="signed_hadamard"), 50, 80,
         mask="padding", b=2, d=128, other=small(ALL_MXFP4).replace(rotate="hadamard")),
    Case("hopper_signed_fp8pv", small(HOPPER).replace(rotate="signed_hadamard", pv="fp8"), 60, 60, causal=True),
    Case("e5m2_hadamard_lq_gt_lk", small(PAPER_FOLDED).replace(hi="mxfp8_e5m2", rotate="hadamard"), 90, 40,
         other=small(PAPER_FOLDED).replace(hi="mxfp8_e5m2")),
    # Balanced Q and K (AttentionPolicy.balance_qk): unbalanced must not match.
    Case("paper_folded_balanced_padded_gqa", small(PAPER_FOLDED).replace(balance_qk=True), 60, 60,
         mask="padded_causal", b=2, hq=4, hkv=2, channels=True,
         gpu_defect="folded MX on an H100 misses the bound on these channel-scaled inputs by about 0.2, with "
                    "balancing on or off (the interpreter meets it; BENCHMARKS.md, 2026-12-06): not yet explained"),
    Case("all_mxfp4_balanced_signed_lq_lt_lk", small(ALL_MXFP4).replace(balance_qk=True, rotate="signed_hadamard"),
         40, 90, channels=True, other=small(ALL_MXFP4).replace(rotate="signed_hadamard")),
    Case("paper_exact_balanced_causal_d128", small(PAPER_EXACT).replace(balance_qk=True), 70, 70, causal=True,
         d=128, channels=True),
    Case("hopper_balanced_fp8pv_causal", small(HOPPER).replace(balance_qk=True, pv="fp8"), 70, 70, causal=True,
         channels=True),
]


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_interpreter_matches_reference(case, seed):
    run_case(case, "cpu", 1, seed)


def large(case):
    policy = case.policy.replace(tile=128 if case.lq >= 60 else 64)
    other = case.other.replace(tile=policy.tile) if case.other is not None else None
    return Case(**{**case.__dict__, "policy": policy, "other": other, "hq": case.hq * 4, "b": case.b + 1
                   if case.mask not in ("padding", "padded_causal") else case.b})


@pytest.fixture
def no_autotune(monkeypatch):
    from dma_compile.kernels import launch

    monkeypatch.setattr(launch, "AUTOTUNE", False)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gpu_matches_reference(case, seed, no_autotune, request):
    if case.gpu_defect:
        request.applymarker(pytest.mark.xfail(reason=case.gpu_defect, raises=AssertionError, strict=True))
    # Channel-scaled inputs (2^-6..2^6 per channel) at 13x give scores whose
    # FP8 tensor-core accumulation (fewer bits than float32) errs beyond the
    # float32-based bound of `errors`, balanced or not (BENCHMARKS.md,
    # 2026-12-06): they keep the unit scale here.
    run_case(large(case), "cuda", 1 if case.channels else 13, seed)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_gpu_every_config(d, seed):
    from dma_compile.kernels.attention_sm90 import _configs_for

    case = Case(f"hopper_d{d}", HOPPER.replace(pv="fp8") if d == 128 else HOPPER, 700, 700, causal=True, d=d,
                hq=8, hkv=2)
    for config in _configs_for(d, case.policy.tile):
        run_case(case, "cuda", 1, seed, config=config)


def check_unaligned_views(device, lk, seed):
    """K and V as views a bulk-copy descriptor cannot address (rows of D + 1
    elements, base one element in): the kernel copies them and still matches."""
    case = Case("unaligned_views", small(HOPPER), lk, lk, causal=True)
    q = torch.randn(1, 2, lk, 64, device=device).to(torch.bfloat16)
    k = (torch.randn(1, 1, lk, 65, device=device) + 0.5).to(torch.bfloat16)[..., 1:]
    v = torch.randn(1, 1, lk, 65, device=device).to(torch.bfloat16)[..., 1:]
    assert k.data_ptr() % 16 != 0
    out = dma_attention(q, k, v, is_causal=True, policy=case.policy, impl="sm90")
    ref = dma_attention_reference(q.cpu(), k.cpu(), v.cpu(), None, True, None, case.policy)
    assert_matches(out.cpu(), ref, v.cpu(), case, f"seed {seed}")


@needs_interpreter
def test_interpreter_unaligned_views(seed):
    check_unaligned_views("cpu", 45, seed)


@pytest.mark.gpu
def test_gpu_unaligned_views(seed):
    check_unaligned_views("cuda", 900, seed)


@needs_interpreter
@pytest.mark.parametrize("policy", [AttentionPolicy.hopper(), PAPER_FOLDED], ids=["hopper", "paper_folded"])
def test_pass_can_leave_q_to_the_kernel(policy, seed):
    """quantize_q=False (the Gluon kernel quantizes Q in its prologue): Q is
    passed through as given and K and V come out as with Q quantized."""
    from dma_compile.kernels.attention_sm90 import quantize_inputs

    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, 50, 64, generator=gen).bfloat16() for h in (4, 2, 2))
    full = quantize_inputs(q, k, v, policy, v_wgmma_order=True)
    lean = quantize_inputs(q, k, v, policy, v_wgmma_order=True, quantize_q=False)
    assert full.q_quantized and not lean.q_quantized
    assert lean.q_hi.values is q and lean.q_lo.values is q and lean.q_lo.scales is None
    for name in ("k_hi", "k_lo"):
        a, b = getattr(full, name), getattr(lean, name)
        assert torch.equal(a.values.view(torch.uint8), b.values.view(torch.uint8)), name
    assert torch.equal(full.v.view(torch.uint8), lean.v.view(torch.uint8))
    with pytest.raises(ValueError, match="quantize_q=False"):
        quantize_inputs(q, k, v, policy.replace(rotate="hadamard"), quantize_q=False)


@needs_interpreter
def test_mask_classification_is_cached_and_sees_writes(seed):
    from dma_compile.kernels.masks import classify_mask

    case = Case("cache", small(HOPPER), 60, 60, mask="rows_masked")
    q, k, v, mask, _ = run_case(case, "cpu", 1, seed)
    assert classify_mask(mask, 1, 2, 60, 60) is classify_mask(mask, 1, 2, 60, 60)
    # An in-place write bumps the version counter: the stale classification must not be used.
    mask[..., :, :] = True
    out = dma_attention(q, k, v, attn_mask=mask, policy=case.policy, impl="sm90")
    ref = dma_attention_reference(q, k, v, mask, False, None, case.policy)
    assert_matches(out, ref, v, case, f"after write, seed {seed}")


@needs_interpreter
def test_bad_input_errors():
    q = torch.randn(1, 2, 40, 64, dtype=torch.bfloat16)
    kv = torch.randn(1, 1, 40, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q must have 4 dimensions"):
        dma_attention(q[0], kv, kv, impl="sm90")
    with pytest.raises(ValueError, match="KV heads"):
        dma_attention(torch.randn(1, 3, 40, 64, dtype=torch.bfloat16), torch.randn(1, 2, 40, 64, dtype=torch.bfloat16),
                      torch.randn(1, 2, 40, 64, dtype=torch.bfloat16), impl="sm90")
    with pytest.raises(ValueError, match="head_dim must match"):
        dma_attention(q, kv[..., :32], kv, impl="sm90")
    with pytest.raises(Unsupported, match="bfloat16 or float16"):
        dma_attention(q.float(), kv.float(), kv.float(), impl="sm90")
    with pytest.raises(Unsupported, match="head_dim in"):
        dma_attention(q[..., :48], kv[..., :48], kv[..., :48], policy=EXACT, impl="sm90")
    with pytest.raises(Unsupported, match="positive softmax scale"):
        dma_attention(q, kv, kv, scale=-1.0, impl="sm90")


@pytest.mark.gpu
def test_gpu_rejects_cpu_tensors_and_auto_falls_back():
    q = torch.randn(1, 2, 40, 64, dtype=torch.bfloat16)
    with pytest.raises(Unsupported, match="needs CUDA tensors"):
        dma_attention(q, q, q, impl="sm90")
    q = q.cuda()[..., :48]
    out = dma_attention(q, q, q, policy=EXACT, impl="auto")
    torch.testing.assert_close(out, dma_attention_reference(q, q, q, policy=EXACT))


@pytest.mark.gpu
@pytest.mark.parametrize("policy", [HOPPER, HOPPER.replace(pv="fp8"), PAPER_EXACT, ALL_MXFP8.replace(pv="fp8"),
                                    EXACT], ids=str)
@pytest.mark.parametrize("shape", [(1, 8, 2, 700, 700, 128, True), (2, 4, 4, 300, 500, 64, False),
                                   (1, 6, 2, 513, 513, 256, True)], ids=str)
def test_gpu_replayed_calls_are_bit_identical_to_triton_launches(policy, shape, seed):
    """A repeated call signature replays its launches (kernels.launch); on
    fresh inputs every replayed output equals the same call through Triton's
    launcher bit for bit."""
    from dma_compile.kernels import attention_sm90
    from dma_compile.kernels.launch import Replay

    b, hq, hkv, lq, lk, d, causal = shape

    def fresh():
        q = torch.randn(b, hq, lq, d, device="cuda").to(torch.bfloat16)
        return q, *(torch.randn(b, hkv, lk, d, device="cuda").to(torch.bfloat16) for _ in range(2))

    first = fresh()
    attention_sm90.attention_sm90(*first, None, causal, None, policy)
    assert isinstance(attention_sm90._replays[attention_sm90.signature(*first, causal, None, policy)], Replay)
    for _ in range(3):
        q, k, v = fresh()
        replayed = attention_sm90.attention_sm90(q, k, v, None, causal, None, policy)
        launched = attention_sm90._attention(q, k, v, None, causal, None, policy, None)
        assert torch.equal(replayed, launched), f"seed {seed}"
        ref = dma_attention_reference(q.float(), k.float(), v.float(), None, causal, None, policy)
        # Not garbage either (the tolerances proper are test_gpu_matches_reference's).
        assert (replayed.float() - ref).norm() / ref.norm() < 0.05, f"seed {seed}"
