"""dma_compile.kernels.limits: the one table of what each kernel serves, read by the router."""

import logging

import pytest
import torch
import torch.nn.functional as F

from dma_compile import hf, ops
from dma_compile.kernels import Unsupported
from dma_compile.kernels.limits import LIMITS, MAX_HEAD_DIM
from dma_compile.ops import Route
from dma_compile.passes import rewrite_sdpa
from dma_compile.policy import AttentionPolicy


def _qkv(dtype=torch.bfloat16, d=64, dv=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 40, d, generator=gen).to(dtype)
    k = torch.randn(1, 2, 40, d, generator=gen).to(dtype)
    v = torch.randn(1, 2, 40, dv or d, generator=gen).to(dtype)
    return q, k, v


def test_every_kernel_has_limits():
    assert set(LIMITS) == set(ops.KERNELS)
    assert MAX_HEAD_DIM == max(d for limits in LIMITS.values() for d in limits.head_dims)
    # The doors above the op read the same constant.
    assert rewrite_sdpa.MAX_HEAD_DIM is hf.MAX_HEAD_DIM is ops.MAX_HEAD_DIM is MAX_HEAD_DIM


@pytest.mark.parametrize(
    "name, inputs, scale, refused",
    [
        ("sm90", dict(dtype=torch.float32), None, "the sm90 kernel takes bfloat16 or float16 inputs"),
        ("sm90", dict(d=48), None, "q, k: the sm90 kernel supports head_dim in"),
        ("sm90", dict(dv=48), None, "v: the sm90 kernel supports head_dim in"),
        ("sm90", {}, -1.0, "scale: the sm90 kernel needs a positive softmax scale"),
        ("sm90_gluon", dict(dv=128), None, "v's head_dim equal to q's"),
        ("sm90_gluon", dict(d=32), None, "the Gluon sm90 kernel supports head_dim in"),
        ("sm100", dict(d=48), None, "the sm100 kernel supports head_dim in"),
        # What the sm100 kernel accepts and the sm90 kernels do not.
        ("sm100", dict(dtype=torch.float32), -1.0, None),
        ("sm90", {}, 0.5, None),
    ],
)
def test_refusals_name_the_argument_and_the_kernel(name, inputs, scale, refused):
    q, _, v = _qkv(**inputs)
    reason = LIMITS[name].refusal(q, v, scale)
    if refused is None:
        assert reason is None
        LIMITS[name].check(q, v, scale)
    else:
        assert refused in reason
        with pytest.raises(Unsupported, match=refused.split(":")[0]):
            LIMITS[name].check(q, v, scale)


def test_router_passes_over_a_refused_kernel_without_loading_it(monkeypatch, caplog, seed):
    def no_import(module, function):
        raise AssertionError(f"{module} must not be loaded for a call its limits refuse")

    monkeypatch.setattr(ops, "_entry", no_import)
    ops._warn_fallback_once.cache_clear()
    q, k, v = _qkv(torch.float32, seed=seed)
    mask = torch.rand(1, 1, 40, 40, generator=torch.Generator().manual_seed(seed)) > 0.3
    policy = AttentionPolicy(tile=32)
    with caplog.at_level(logging.WARNING, logger="dma_compile.ops"):
        out = ops.run(Route(kernels=("sm90",), fallback="sdpa"), q, k, v, mask, False, 0.3, policy)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    assert torch.equal(out, expected), f"seed {seed}"
    assert [r.getMessage() for r in caplog.records] == [
        "dma attention: stock SDPA runs instead of the kernel: sm90: q: the sm90 kernel takes bfloat16 or float16 "
        "inputs, got torch.float32"
    ]
    with pytest.raises(Unsupported, match="positive softmax scale"):
        ops.run(Route(kernels=("sm90",)), *_qkv(seed=seed), None, True, -1.0, policy)
