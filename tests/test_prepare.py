"""dma_compile.prepare.warmup: one op call per shape ahead of time (checks only, off CUDA)."""

import time

import pytest
import torch
from tiny_models import causal_lm, gpt2

import dma_compile
from dma_compile import AttentionPolicy, ModelPolicy
from dma_compile.prepare import model_shapes, warmup


def test_model_shapes_of_transformers_configs():
    assert model_shapes(causal_lm("llama", "sdpa", 0, head_dim=64), [100, 300]) == [(1, 4, 2, 100, 64), (1, 4, 2, 300, 64)]
    assert model_shapes(gpt2("sdpa", 0), [50]) == [(1, 2, 2, 50, 32)]


def test_model_warmup_covers_every_shape_policy_and_mask():
    policy = ModelPolicy(default=AttentionPolicy(tile=32), layers={1: AttentionPolicy.hopper()})
    records = dma_compile.warmup(causal_lm("llama", "sdpa", 0), policy, lengths=(64, 200))
    assert [(r["shape"][3], r["policy"], r["mask"]) for r in records] == [
        (length, p.to_string(), mask)
        for length in (64, 200)
        for p in (AttentionPolicy(tile=32), AttentionPolicy.hopper())
        for mask in ("causal", "bool")
    ]
    assert all(r["shape"][:3] == (1, 4, 2) and r["shape"][4] == 32 for r in records)


@pytest.mark.parametrize(
    "shapes, kwargs, msg",
    [
        ([(1, 4, 2, 64, 48)], {}, "q: head_dim must be a multiple of 32 for MX formats"),
        ([(1, 4, 3, 64, 64)], {}, "must divide q's heads"),
        ([(1, 4, 2, 64)], {}, "a shape must be 5 positive ints"),
        ([(1, 4, 2, 0, 64)], {}, "a shape must be 5 positive ints"),
        ([(1, 4, 2, 64, 64)], {"masks": ("padded",)}, "masks must be drawn from"),
        ([(1, 4, 2, 64, 64)], {"impl": "triton"}, "impl must be one of"),
        ([(1, 4, 2, 64, 64)], {"policy": "tile=33"}, "tile must be one of"),
    ],
)
def test_bad_shapes_fail_in_warmup(shapes, kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        warmup(shapes, device="cpu", **kwargs)


def test_head_dim_48_is_fine_without_mx():
    (record,) = warmup([(2, 4, 2, 64, 48)], "exact", masks=("none",), device="cpu")
    assert record["shape"] == (2, 4, 2, 64, 48) and record["mask"] == "none"


@pytest.mark.gpu
def test_warmup_compiles_ahead_on_the_gpu():
    shape = (1, 8, 2, 1500, 128)
    warmup([shape], masks=("causal",))
    q = torch.randn(1, 8, 1500, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 1500, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    start = time.perf_counter()
    dma_compile.dma_attention(q, k, v, is_causal=True)
    torch.cuda.synchronize()
    assert time.perf_counter() - start < 0.5


@pytest.mark.gpu
def test_after_warmup_the_first_call_replays_its_launches(monkeypatch):
    """warmup leaves what a repeated call needs: the call itself makes no launch through Triton's launcher."""
    from dma_compile.kernels import attention_sm90

    shape = (1, 8, 2, 1100, 128)
    warmup([shape], masks=("causal",))
    q = torch.randn(1, 8, 1100, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 1100, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    monkeypatch.setattr(attention_sm90, "_attention", lambda *args: pytest.fail("not replayed"))
    with torch.inference_mode():
        out = dma_compile.dma_attention(q, k, v, is_causal=True)
    assert out.shape == q.shape and torch.isfinite(out).all()
