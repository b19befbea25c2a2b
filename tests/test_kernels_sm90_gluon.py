"""The Gluon Hopper kernel against the reference (on the GPU: Gluon has no
interpreter), and which calls it serves (on any machine).

The same matrix as tests/test_kernels_sm90.py at its GPU sizes, with the same
error bounds (that file's docstring derives them): every case the Gluon
kernel serves must match the reference; every case it does not serve must be
refused with `Unsupported` (ops routes those to the Triton kernel). Then a
seeded sweep of random shapes, policies and dtypes. CI checks the kernel's
code generation without a GPU (tests/test_sm90_gluon_compile.py).
"""

import random

import pytest
import torch

from dma_compile import AttentionPolicy, dma_attention
from dma_compile.kernels import Unsupported
from dma_compile.reference import dma_attention_reference
from test_kernels_sm90 import CASES, HOPPER, PAPER_FOLDED, Case, assert_matches, inputs, large

def check(case, seed, scale_up=1, **variant):
    """variant: a launch variant of the kernel (`attention_sm90_gluon`), called directly."""
    from dma_compile.kernels.attention_sm90_gluon import attention_sm90_gluon, unsupported_reason

    q, k, v, mask = inputs(case, "cuda", scale_up)
    reason = unsupported_reason(q, k, v, mask, case.causal, case.policy)
    if reason is not None:
        with pytest.raises(Unsupported):
            dma_attention(q, k, v, attn_mask=mask, is_causal=case.causal, policy=case.policy, impl="sm90_gluon")
        return False
    if variant:
        out = attention_sm90_gluon(q, k, v, mask, case.causal, None, case.policy, **variant)
    else:
        out = dma_attention(q, k, v, attn_mask=mask, is_causal=case.causal, policy=case.policy, impl="sm90_gluon")
    cpu = [x.cpu() if x is not None else None for x in (q, k, v, mask)]
    ref = dma_attention_reference(*cpu, case.causal, None, case.policy)
    assert_matches(out.cpu(), ref, cpu[2], case, f"{case.name} seed {seed}")
    return True


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_gluon_matches_reference_or_refuses(case, seed):
    # As tests/test_kernels_sm90.py: channel-scaled inputs keep the unit
    # scale, where FP8 tensor-core accumulation stays within the float32-based
    # bound (at 13x `hopper_balanced_fp8pv_causal` exceeded it in two of three
    # H100 runs of 2026-12-07, as the Triton kernel did on 2026-12-06).
    check(large(case), seed, 1 if case.channels else 13)


SWEEP_POLICIES = [
    HOPPER, HOPPER.replace(pv="fp8"), PAPER_FOLDED, HOPPER.replace(diag_tiles=2, sink_tiles=0),
    AttentionPolicy.preset("all_mxfp8").replace(mx_mode="folded", pv="fp8"), HOPPER.replace(tile=256),
    PAPER_FOLDED.replace(rotate="signed_hadamard"), HOPPER.replace(rotate="hadamard"),
]


def sweep_cases():
    rng = random.Random(20261203)
    for i in range(120):
        policy = rng.choice(SWEEP_POLICIES)
        hkv = rng.choice([1, 2, 3])
        lq, lk = rng.randint(1, 700), rng.randint(1, 700)
        causal = rng.random() < 0.5
        # Causal calls with Lq < Lk go to the Triton kernel (unsupported_reason).
        case = Case(f"sweep{i}", policy, lq, lk if not causal or lk <= lq else lq, causal=causal,
                    d=rng.choice([64, 128]), hq=hkv * rng.choice([1, 2, 4]), hkv=hkv, b=rng.randint(1, 3),
                    dtype=rng.choice([torch.bfloat16, torch.bfloat16, torch.float16]))
        yield i, case


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", range(8))
def test_gluon_random_shape_sweep(chunk):
    """120 seeded cases in 8 chunks (so that pytest-xdist spreads their compiles)."""
    for i, case in sweep_cases():
        if i % 8 == chunk:
            torch.manual_seed(i)
            assert check(case, i), f"{case}: the Gluon kernel must serve every sweep case"


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", range(2))
def test_gluon_ping_pong_variant_matches_reference(chunk):
    """The `pingpong` schedule (consumers take turns issuing matmuls; not the
    default) on every fourth sweep case."""
    for i, case in sweep_cases():
        if i % 8 == chunk:
            torch.manual_seed(i)
            assert check(case, i, pingpong=True), f"{case}: the Gluon kernel must serve every sweep case"


PROLOGUE_POLICIES = [HOPPER, HOPPER.replace(pv="fp8"), PAPER_FOLDED,
                     AttentionPolicy.preset("all_mxfp4").replace(mx_mode="folded", pv="fp8")]


@pytest.mark.gpu
@pytest.mark.parametrize("policy", PROLOGUE_POLICIES, ids=lambda p: p.to_string())
@pytest.mark.parametrize("d, causal", [(128, True), (64, False)])
def test_gluon_prologue_quantizes_q_as_the_pass_does(policy, d, causal, seed):
    """Q quantized in the kernel's prologue gives the output of Q quantized by
    the pass, bit for bit (`quantize.folded_mx` is one function for both), on
    channel-scaled inputs with NaN and Inf in some of Q's blocks and a tail."""
    import math

    from dma_compile.kernels.attention_sm90 import quantize_inputs
    from dma_compile.kernels.attention_sm90_gluon import can_quantize_q, gluon_attention_from_quantized

    assert can_quantize_q(policy)
    b, hq, hk, lq, lk = 2, 4, 2, 333, 333
    channels = 2.0 ** torch.randint(-6, 7, (d,), device="cuda")
    q = (torch.randn(b, hq, lq, d, device="cuda") * channels).bfloat16()
    q[0, 1, 7, 3], q[1, 2, 300, 40] = float("nan"), float("inf")
    k = torch.randn(b, hk, lk, d, device="cuda").bfloat16()
    v = torch.randn(b, hk, lk, d, device="cuda").bfloat16()
    shape = (b, hq, hk, lq, lk, d, d)
    outs = [gluon_attention_from_quantized(
        quantize_inputs(q, k, v, policy, is_causal=causal, v_wgmma_order=True, quantize_q=quantize_q),
        shape, causal, 1 / math.sqrt(d), policy) for quantize_q in (True, False)]
    assert outs[0].isnan().any() and not outs[0].isnan().all()
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), f"seed {seed} {policy}"


def test_gluon_q_prologue_only_where_the_pass_does_not_transform_q():
    from dma_compile.kernels.attention_sm90_gluon import attention_sm90_gluon, can_quantize_q, pass_options

    assert can_quantize_q(HOPPER) and can_quantize_q(PAPER_FOLDED)
    assert not can_quantize_q(HOPPER.replace(rotate="hadamard"))
    assert not can_quantize_q(PAPER_FOLDED.replace(balance_qk=True))
    assert pass_options() == {"v_wgmma_order": True, "quantize_q": True}
    assert pass_options(q_prologue=True)["quantize_q"] is False
    q = torch.empty(1, 2, 256, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q_prologue: the kernel cannot quantize a rotated"):
        attention_sm90_gluon(q, q, q, None, True, None, HOPPER.replace(rotate="hadamard"), q_prologue=True)


@pytest.mark.parametrize("what, expect", [
    ({}, None),
    ({"capability": (10, 0)}, "sm_90 GPU"),
    ({"dtype": torch.float32}, "bfloat16 or float16"),
    ({"d": 96}, "head_dim"),
    ({"mask": True}, "explicit masks"),
    ({"policy": AttentionPolicy()}, "folded MX only"),
    ({"policy": HOPPER.replace(tile=64)}, "multiple of 128"),
    ({"causal": True, "lk": 300}, "Lq < Lk"),
    ({"causal": True}, None),
    ({"policy": HOPPER.replace(pv="fp8"), "hkv": 2, "lk": 90}, None),
])
def test_gluon_routing_rule(what, expect):
    """Which calls the Gluon kernel serves, decided for an H100/H200 on any machine (no GPU needed)."""
    from dma_compile.kernels.attention_sm90_gluon import unsupported_reason

    d, dtype = what.get("d", 128), what.get("dtype", torch.bfloat16)
    q = torch.empty(1, 4, 200, d, dtype=dtype)
    kv = torch.empty(1, what.get("hkv", 4), what.get("lk", 200), d, dtype=dtype)
    mask = torch.ones(200, kv.shape[2], dtype=torch.bool) if what.get("mask") else None
    reason = unsupported_reason(q, kv, kv, mask, what.get("causal", False), what.get("policy", HOPPER),
                                capability=what.get("capability", (9, 0)))
    if expect is None:
        assert reason is None
    else:
        assert reason is not None and expect in reason


@pytest.mark.parametrize("what, expect", [
    ({}, None),
    ({"pv": "fp8", "causal": False}, None),
    ({"lq": 16384, "lk": 16384, "hkv": 1}, None),
    ({"causal": False}, "non-causal"),
    ({"d": 64}, "head_dim below 128"),
    ({"lq": 4096, "lk": 4096}, "fewer than 8192"),
    ({"lq": 8191, "lk": 8191}, "fewer than 8192"),
    ({"lq": 2048, "causal": False, "pv": "fp8"}, "fewer than 8192"),
    ({"triton": (3, 9)}, "with Triton 3.6 only"),
])
def test_gluon_takes_auto_calls_where_it_measured_faster(monkeypatch, what, expect):
    """The speed rule of impl="auto" (`slower_reason`): the Gluon kernel
    takes D128 calls of 8192 queries and keys or more, causal or with FP8
    P·V, on the Triton versions it was timed with; the Triton kernel the rest."""
    from dma_compile.kernels import attention_sm90_gluon as gluon_kernel

    monkeypatch.setattr(gluon_kernel, "TRITON_VERSION", what.get("triton", (3, 6)))
    d = what.get("d", 128)
    q = torch.empty(1, 4, what.get("lq", 8192), d, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(1, what.get("hkv", 4), what.get("lk", 8192), d, dtype=torch.bfloat16, device="meta")
    policy = HOPPER.replace(pv=what.get("pv", "input"))
    reason = gluon_kernel.slower_reason(q, kv, kv, None, what.get("causal", True), None, policy)
    if expect is None:
        assert reason is None
    else:
        assert reason is not None and expect in reason
