"""The dma::attention custom op and the dma_attention entry point."""

import pytest
import torch
import torch.nn.functional as F

from dma_compile import AttentionPolicy, dma_attention
from dma_compile.reference import dma_attention_reference

POLICY = AttentionPolicy(tile=32, min_q_len=4)


def qkv(b=1, hq=4, hkv=2, lq=40, lk=40, d=64, dtype=torch.float32):
    return torch.randn(b, hq, lq, d, dtype=dtype), torch.randn(b, hkv, lk, d, dtype=dtype), torch.randn(b, hkv, lk, d, dtype=dtype)


def test_opcheck():
    q, k, v = qkv()
    mask = torch.rand(1, 1, 40, 40) > 0.2
    for args in [
        (q, k, v, None, True, None, POLICY.to_string(), "reference"),
        (q, k, v, mask, False, 0.2, POLICY.to_string(), "auto"),
    ]:
        torch.library.opcheck(torch.ops.dma.attention.default, args)


def test_eager_matches_reference(seed):
    q, k, v = qkv()
    out = dma_attention(q, k, v, is_causal=True, policy=POLICY)
    ref = dma_attention_reference(q, k, v, is_causal=True, policy=POLICY)
    assert torch.equal(out, ref), f"seed {seed}"


def test_compiled_equals_eager_without_recompiles(seed):
    torch._dynamo.reset()
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    def f(q, k, v):
        return dma_attention(q, k, v, is_causal=True, policy=POLICY) * 2

    compiled = torch.compile(f, backend=backend, fullgraph=True, dynamic=True)
    for length in (40, 57, 96):
        q, k, v = qkv(lq=length, lk=length)
        assert torch.equal(compiled(q, k, v), f(q, k, v)), f"seed {seed} length {length}"
    assert len(compiles) == 1
    assert any(n.target in (torch.ops.dma.attention, torch.ops.dma.attention.default) for n in compiles[0].graph.nodes)


def test_inductor_compile_equals_eager(seed):
    torch._dynamo.reset()

    def f(q, k, v, mask):
        return dma_attention(q, k, v, attn_mask=mask, policy=POLICY) + 1

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for length in (40, 70):
        q, k, v = qkv(lq=length, lk=length)
        mask = torch.rand(1, 1, length, length) > 0.3
        torch.testing.assert_close(compiled(q, k, v, mask), f(q, k, v, mask), rtol=0, atol=1e-6, msg=f"seed {seed}")


def test_short_queries_run_stock_sdpa_with_auto():
    q, k, v = qkv(lq=2, lk=50)
    out = dma_attention(q, k, v, policy=POLICY)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, enable_gqa=True), atol=1e-6)
    forced = dma_attention(q, k, v, policy=POLICY, impl="reference")
    assert not torch.allclose(forced, out, atol=1e-3)  # the forced reference quantizes


def test_default_policy_and_strings_are_accepted():
    q, k, v = qkv()
    a = dma_attention(q, k, v, is_causal=True, policy=None)
    b = dma_attention(q, k, v, is_causal=True, policy=AttentionPolicy().to_string())
    c = dma_attention(q, k, v, is_causal=True, policy="paper")
    assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize(
    "change,msg",
    [
        (lambda q, k, v: (q[0], k, v, {}), "q must have 4 dimensions"),
        (lambda q, k, v: (q, k[:, :, :, :32], v, {}), "k: head_dim must match"),
        (lambda q, k, v: (q, k[:, :1].repeat(1, 3, 1, 1), v[:, :1].repeat(1, 3, 1, 1), {}), "must divide"),
        (lambda q, k, v: (q.to(torch.int32), k, v, {}), "q: dtype must be one of"),
        (lambda q, k, v: (q, k.half(), v, {}), "k, v: dtype must match"),
        (lambda q, k, v: (q, k, v[:, :, :7], {}), "v: \\(batch, heads, length\\) must match"),
        (lambda q, k, v: (q, k, v, {"attn_mask": torch.ones(3, 40, 40, dtype=torch.bool)}), "not broadcastable"),
        (lambda q, k, v: (q, k, v, {"attn_mask": torch.ones(40, 40, dtype=torch.int64)}), "attn_mask: dtype"),
        (lambda q, k, v: (q, k, v, {"attn_mask": torch.ones(40, 40, dtype=torch.bool), "is_causal": True}), "cannot be used together"),
        (lambda q, k, v: (q, k, v, {"impl": "cuda"}), "impl must be one of"),
        (lambda q, k, v: (q, k, v, {"policy": 3}), "policy must be"),
        (lambda q, k, v: (q[..., :48], k[..., :48], v, {}), "multiple of 32 for MX formats"),
    ],
)
def test_bad_input_names_the_argument(change, msg):
    q, k, v = qkv()
    q, k, v, kwargs = change(q, k, v)
    with pytest.raises(ValueError, match=msg):
        dma_attention(q, k, v, **kwargs)


def test_inputs_requiring_grad_are_refused():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="no backward yet"):
        dma_attention(q.requires_grad_(), k, v)
    with torch.no_grad():
        dma_attention(q, k, v)


def test_float64_only_on_the_reference():
    q, k, v = qkv(dtype=torch.float64)
    dma_attention(q, k, v, policy=POLICY, impl="reference")
    with pytest.raises(ValueError, match="q: dtype"):
        dma_attention(q, k, v, policy=POLICY)


def test_head_dim_not_multiple_of_32_runs_with_formats_off(seed):
    q, k, v = qkv(d=40)
    out = dma_attention(q, k, v, is_causal=True, policy="exact")
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.allclose(out, ref, atol=1e-5), f"seed {seed}"
