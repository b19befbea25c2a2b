"""The FX rewrite of SDPA into dma.attention (dma_compile.passes.rewrite_sdpa).

Graphs come from Dynamo (fullgraph, dynamic) through a backend that rewrites
and then runs the graph eagerly, so these tests need no Inductor compile.
"""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from tiny_models import causal_lm, gpt2

import dma_compile.hf
from dma_compile import AttentionPolicy, ModelPolicy, dma_attention
from dma_compile.passes import rewrite_sdpa as rewrite_sdpa_module
from dma_compile.passes.rewrite_sdpa import (
    SDPA_TARGETS,
    bind_sdpa_args,
    layer_index,
    module_path,
    rewrite_sdpa,
    unsupported_reason,
)

DMA_OP = torch.ops.dma.attention.default
POLICY = ModelPolicy(
    default=AttentionPolicy(tile=32),
    layers={
        1: AttentionPolicy(tile=32, hi="none", lo="mxfp8_e4m3", mx_mode="folded"),
        2: AttentionPolicy(tile=64, hi="mxfp4_e2m1", lo="mxfp4_e2m1", diag_tiles=2),
    },
)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# GQA decoder families whose attention goes through transformers' sdpa_attention_forward.
class Captured:
    """A Dynamo backend that rewrites each graph and runs it eagerly."""

    def __init__(self, policy, impl="reference"):
        self.policy, self.impl = policy, impl
        self.graphs, self.reports = [], []

    def __call__(self, gm, example_inputs):
        self.reports.append(rewrite_sdpa(gm.graph, self.policy, self.impl))
        gm.recompile()
        self.graphs.append(gm)
        return gm.forward

    def ops(self):
        return [n for n in self.graphs[-1].graph.nodes if n.target is DMA_OP]

    def sdpa_nodes(self):
        return [n for n in self.graphs[-1].graph.nodes if n.op == "call_function" and n.target in SDPA_TARGETS]


def fake(node_arg):
    return node_arg.meta["example_value"]


def inputs(seed, batch=2, length=70, padded=True):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (batch, length), generator=gen)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, : length // 5] = 0  # left padding in the first sequence
    return ids, mask


@pytest.mark.parametrize(
    "family, with_mask",
    [("llama", True), ("llama", False), ("qwen2", True), ("mistral", True)],
    ids=["llama-bool-mask+repeat_kv", "llama-is_causal+enable_gqa", "qwen2", "mistral-sliding-window"],
)
def test_gqa_families_every_layer_rewritten_with_its_policy(seed, family, with_mask):
    model = causal_lm(family, "sdpa", seed, num_layers=3)
    ids, mask = inputs(seed)
    kwargs = {"attention_mask": mask} if with_mask else {}
    backend = Captured(POLICY)
    with torch.no_grad():
        compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)(ids, **kwargs).logits
        dma_compile.hf.register(POLICY, impl="reference")
        eager_dma = causal_lm(family, "dma", seed, num_layers=3)(ids, **kwargs).logits
        sdpa = model(ids, **kwargs).logits

    ops = backend.ops()
    assert len(ops) == 3 and not backend.sdpa_nodes()
    assert [op.args[6] for op in ops] == [POLICY.for_layer(i).to_string() for i in range(3)]
    assert [s.layer for s in backend.reports[-1].rewritten] == [0, 1, 2]
    # K/V reach the op with their 2 KV heads, and the repeat_kv expansions are gone.
    assert all(fake(op.args[1]).shape[1] == 2 and fake(op.args[2]).shape[1] == 2 for op in ops)
    assert not [n for n in backend.graphs[-1].graph.nodes if n.target == "expand" and fake(n).dim() == 5]
    assert (ops[0].args[3] is not None) == with_mask

    torch.testing.assert_close(compiled, eager_dma, rtol=0, atol=2e-5, msg=f"seed {seed}")
    valid = mask.bool() if with_mask else torch.ones_like(ids, dtype=torch.bool)
    error = (compiled - sdpa)[valid].norm() / sdpa[valid].norm()
    top1 = (compiled.argmax(-1) == sdpa.argmax(-1))[valid].float().mean()
    assert 1e-4 < error < 0.05 and top1 > 0.9, f"seed {seed}: DMA vs SDPA relative error {error}, top-1 {top1}"


@pytest.mark.parametrize("with_mask", [True, False])
def test_gpt2_every_layer_rewritten(seed, with_mask):
    model = gpt2("sdpa", seed, initializer_range=0.1)
    ids, mask = inputs(seed, length=45)
    kwargs = {"attention_mask": mask} if with_mask else {}
    backend = Captured(POLICY)
    with torch.no_grad():
        compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)(ids, **kwargs).logits
        dma_compile.hf.register(POLICY, impl="reference")
        eager_dma = gpt2("dma", seed, initializer_range=0.1)(ids, **kwargs).logits

    ops = backend.ops()
    assert len(ops) == 2 and not backend.sdpa_nodes()
    assert [s.module for s in backend.reports[-1].rewritten] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    assert [op.args[6] for op in ops] == [POLICY.for_layer(i).to_string() for i in range(2)]
    torch.testing.assert_close(compiled, eager_dma, rtol=0, atol=2e-5, msg=f"seed {seed}")


class Attention(torch.nn.Module):
    """One SDPA call site with configurable arguments, called twice."""

    def __init__(self, **sdpa_kwargs):
        super().__init__()
        self.sdpa_kwargs = sdpa_kwargs

    def forward(self, q, k, v):
        out = F.scaled_dot_product_attention(q, k, v, **self.sdpa_kwargs)
        return F.scaled_dot_product_attention(out, k, v, **self.sdpa_kwargs)


def qkv(heads=4, kv_heads=4, length=37, head_dim=32, dtype=torch.float32, requires_grad=False):
    q = torch.randn(2, heads, length, head_dim, dtype=dtype, requires_grad=requires_grad)
    k = torch.randn(2, kv_heads, length, head_dim, dtype=dtype, requires_grad=requires_grad)
    v = torch.randn(2, kv_heads, length, head_dim, dtype=dtype, requires_grad=requires_grad)
    return q, k, v


@pytest.mark.parametrize(
    "sdpa_kwargs, tensors, policy, reason",
    [
        ({"dropout_p": 0.5}, {}, AttentionPolicy(), "dropout_p > 0"),
        ({}, {"head_dim": 48}, AttentionPolicy(), "head_dim 48 is not a multiple of 32"),
        ({}, {"head_dim": 96}, AttentionPolicy(rotate="hadamard"), "head_dim 96 is not a power of two"),
        ({}, {"head_dim": 320}, AttentionPolicy.preset("exact"), "head_dim 320 > 256"),
        ({}, {"dtype": torch.float64}, AttentionPolicy(), "dtype torch.float64"),
        ({}, {"requires_grad": True}, AttentionPolicy(), "require grad"),
    ],
    ids=["dropout", "head_dim-48-mx", "head_dim-96-rotate", "head_dim-320", "float64", "requires-grad"],
)
def test_unservable_call_sites_keep_sdpa_and_log_once(caplog, monkeypatch, sdpa_kwargs, tensors, policy, reason):
    # Reasons are logged once per process: start from none logged.
    monkeypatch.setattr(rewrite_sdpa_module, "_logged_reasons", set())
    backend = Captured(ModelPolicy(default=policy))
    q, k, v = qkv(**tensors)
    with caplog.at_level(logging.WARNING, logger="dma_compile.passes.rewrite_sdpa"):
        torch.compile(Attention(**sdpa_kwargs), backend=backend, fullgraph=True)(q, k, v)
    assert len(backend.sdpa_nodes()) == 2 and not backend.ops()
    assert all(reason in s.reason for s in backend.reports[-1].kept)
    assert sum(reason in r.getMessage() for r in caplog.records) == 1


def test_head_dim_not_multiple_of_32_is_served_without_mx(seed):
    backend = Captured(ModelPolicy(default=AttentionPolicy.preset("exact")))
    q, k, v = qkv(head_dim=48)
    out = torch.compile(Attention(is_causal=True), backend=backend, fullgraph=True)(q, k, v)
    assert len(backend.ops()) == 2
    torch.testing.assert_close(out, Attention(is_causal=True)(q, k, v), rtol=1e-5, atol=1e-5, msg=f"seed {seed}")


def test_incompatible_heads_are_kept():
    args = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None}
    with FakeTensorMode():
        q, k, v = qkv(heads=6, kv_heads=4)
        gqa = unsupported_reason({**args, "query": q, "key": k, "value": v, "enable_gqa": True}, AttentionPolicy())
        plain = unsupported_reason({**args, "query": q, "key": k, "value": v, "enable_gqa": False}, AttentionPolicy())
        q, k, v = qkv(heads=6, kv_heads=2)
        ok = unsupported_reason({**args, "query": q, "key": k, "value": v, "enable_gqa": True}, AttentionPolicy())
    assert "enable_gqa with incompatible heads (6 query, 4 key/value)" in gqa
    assert "heads differ without enable_gqa" in plain
    assert ok is None


def test_positional_and_keyword_arguments(seed):
    q, k, v = qkv(length=50)
    mask = torch.rand(1, 1, 50, 50) > 0.3

    def f(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, mask, 0.0, False, scale=0.3)

    policy = AttentionPolicy(tile=32)
    backend = Captured(ModelPolicy(default=policy))
    out = torch.compile(f, backend=backend, fullgraph=True)(q, k, v, mask)
    (op,) = backend.ops()
    assert op.args[4:] == (False, 0.3, policy.to_string(), "reference")
    expected = dma_attention(q, k, v, mask, is_causal=False, scale=0.3, policy=policy, impl="reference")
    assert torch.equal(out, expected), f"seed {seed}"


def test_repeat_interleave_is_traced_back_to_kv_heads(seed):
    q, k, v = qkv(heads=6, kv_heads=2)

    def f(q, k, v):
        k6, v6 = k.repeat_interleave(3, dim=1), torch.repeat_interleave(v, 3, dim=1)
        return F.scaled_dot_product_attention(q, k6, v6, is_causal=True)

    backend = Captured(ModelPolicy(default=AttentionPolicy(tile=32)))
    out = torch.compile(f, backend=backend, fullgraph=True)(q, k, v)
    (op,) = backend.ops()
    assert fake(op.args[1]).shape[1] == 2 and backend.reports[-1].rewritten[0].unexpanded_kv
    expected = dma_attention(q, k, v, is_causal=True, policy=AttentionPolicy(tile=32), impl="reference")
    assert torch.equal(out, expected), f"seed {seed}"


def test_head_major_expansion_is_not_mistaken_for_gqa(seed):
    """k[:, None].expand(B, R, Hkv, ...) makes head h read KV head h % Hkv, not
    h // R: the op must get the expanded tensors."""
    q, k, v = qkv(heads=6, kv_heads=2)

    def f(q, k, v):
        k6 = k[:, None].expand(2, 3, 2, 37, 32).reshape(2, 6, 37, 32)
        v6 = v[:, None].expand(2, 3, 2, 37, 32).reshape(2, 6, 37, 32)
        return F.scaled_dot_product_attention(q, k6, v6, is_causal=True)

    backend = Captured(ModelPolicy(default=AttentionPolicy(tile=32)))
    out = torch.compile(f, backend=backend, fullgraph=True)(q, k, v)
    (op,) = backend.ops()
    assert fake(op.args[1]).shape[1] == 6 and not backend.reports[-1].rewritten[0].unexpanded_kv
    k6, v6 = k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1)
    expected = dma_attention(q, k6, v6, is_causal=True, policy=AttentionPolicy(tile=32), impl="reference")
    assert torch.equal(out, expected), f"seed {seed}"


def test_kv_mutated_after_expansion_is_not_traced_back(seed):
    """repeat_kv copies K/V; an in-place update of the source afterwards must not
    reach the attention."""
    q, k, v = qkv(heads=6, kv_heads=2)

    def f(q, k, v):
        k6 = k[:, :, None].expand(2, 2, 3, 37, 32).reshape(2, 6, 37, 32)
        v6 = v[:, :, None].expand(2, 2, 3, 37, 32).reshape(2, 6, 37, 32)
        k.mul_(2)
        return F.scaled_dot_product_attention(q, k6, v6, is_causal=True)

    backend = Captured(ModelPolicy(default=AttentionPolicy(tile=32)))
    k6, v6 = k.repeat_interleave(3, 1), v.repeat_interleave(3, 1)
    out = torch.compile(f, backend=backend, fullgraph=True)(q, k.clone(), v)
    assert not backend.reports[-1].rewritten[0].unexpanded_kv
    expected = dma_attention(q, k6, v6, is_causal=True, policy=AttentionPolicy(tile=32), impl="reference")
    assert torch.equal(out, expected), f"seed {seed}"


def test_aten_sdpa_in_exported_graph(seed):
    class RepeatKV(torch.nn.Module):
        def forward(self, q, k, v, mask):
            k = k[:, :, None].expand(2, 2, 3, 37, 32).reshape(2, 6, 37, 32)
            v = v[:, :, None].expand(2, 2, 3, 37, 32).reshape(2, 6, 37, 32)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.2)

    q, k, v = qkv(heads=6, kv_heads=2)
    mask = torch.rand(37, 37) > 0.2
    gm = torch.export.export(RepeatKV(), (q, k, v, mask)).graph_module
    assert any(n.target is torch.ops.aten.scaled_dot_product_attention.default for n in gm.graph.nodes)
    policy = AttentionPolicy(tile=32)
    report = rewrite_sdpa(gm.graph, ModelPolicy(default=policy), impl="reference")
    gm.recompile()
    assert len(report.rewritten) == 1 and report.rewritten[0].unexpanded_kv
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.expand.default]
    expected = dma_attention(q, k, v, mask, scale=0.2, policy=policy, impl="reference")
    assert torch.equal(gm(q, k, v, mask)[0], expected), f"seed {seed}"


def test_policy_for_fewer_layers_is_an_error(seed):
    graphs = []
    model = causal_lm("llama", "sdpa", seed, num_layers=3)
    ids, _ = inputs(seed, padded=False)
    with torch.no_grad():
        torch.compile(model, backend=lambda gm, ex: graphs.append(gm) or gm.forward, fullgraph=True)(ids)
    policy = ModelPolicy(default=AttentionPolicy(), num_layers=2)
    with pytest.raises(ValueError, match="calibrated for 2 layers.*model.layers.2.self_attn is layer 2"):
        rewrite_sdpa(copy.deepcopy(graphs[0]).graph, policy)


@pytest.mark.parametrize(
    "source, path, layer",
    [
        ("L['self'].model.layers.3.self_attn", "model.layers.3.self_attn", 3),
        ("L['args'][0].model.layers[11].self_attn", "model.layers.11.self_attn", 11),
        ("L['self']._modules['encoder']._modules['block']._modules['2'].layer.0", "encoder.block.2.layer.0", 2),
        ("transformer.h.5.attn", "transformer.h.5.attn", 5),
        ("L['self'].attn", "attn", None),
        ("", None, None),
    ],
)
def test_module_path_and_layer_index(source, path, layer):
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    node.meta["nn_module_stack"] = {"outer": ("L['self'].model", object), "inner": (source, object)}
    assert module_path(node) == path
    assert layer_index(module_path(node)) == layer


def test_bind_sdpa_args_rejects_unknown_keywords():
    graph = torch.fx.Graph()
    q, k, v = (graph.placeholder(n) for n in "qkv")
    node = graph.call_function(torch._C._nn.scaled_dot_product_attention, (q, k, v), {"softcap": 2.0})
    assert bind_sdpa_args(node) is None
    node = graph.call_function(torch._C._nn.scaled_dot_product_attention, (q, k, v, None, 0.0), {"is_causal": True})
    assert bind_sdpa_args(node)["is_causal"] is True and bind_sdpa_args(node)["scale"] is None


def assert_every_graph_rewritten(backend, layers):
    assert backend.reports, "nothing was compiled"
    for i, report in enumerate(backend.reports):
        assert not report.kept, f"graph {i} kept SDPA: {[s.reason for s in report.kept]}"
        assert len(report.rewritten) == layers, f"graph {i}: {len(report.rewritten)} of {layers} layers rewritten"


# Once Inductor has compiled a forward, the cache tensors it returns have new
# strides; the recompile that follows gives the cached keys and values two
# length symbols. Without duck shaping every graph has them, no Inductor needed.
no_duck_shapes = torch.fx.experimental._config.patch(use_duck_shape=False)


@no_duck_shapes
def test_compiled_generate_rewrites_every_graph(seed):
    """model.forward compiled with dynamic=True, then generate(): the prefill and
    the decode graphs (whose cache K and V lengths are two symbols) run the op."""
    policy = ModelPolicy(default=AttentionPolicy(tile=32))
    model = causal_lm("llama", "sdpa", seed)
    backend = Captured(policy)
    model.forward = torch.compile(model.forward, backend=backend, dynamic=True)
    ids, mask = inputs(seed, length=40)
    dma_compile.hf.register(policy, impl="reference")
    eager = causal_lm("llama", "dma", seed)
    settings = dict(attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, output_logits=True,
                    return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(ids, **settings)
        ref = eager.generate(ids, **settings)
    assert len(backend.reports) >= 2
    assert_every_graph_rewritten(backend, layers=2)
    assert torch.equal(out.sequences, ref.sequences), f"seed {seed}"
    for step, (a, b) in enumerate(zip(out.logits, ref.logits)):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5, msg=f"seed {seed} step {step}")


@no_duck_shapes
def test_decode_steps_keep_sdpa_by_design_with_impl_auto(seed, caplog, monkeypatch):
    """With impl="auto" the op hands decode steps to stock SDPA at run time, so
    the pass leaves them there: the prefill graph (query length a symbol) runs
    the op, the decode graphs (one query) are stock SDPA's, logged once at INFO."""
    monkeypatch.setattr(rewrite_sdpa_module, "_logged_reasons", set())
    policy = ModelPolicy(default=AttentionPolicy(tile=32))
    model = causal_lm("llama", "sdpa", seed)
    backend = Captured(policy, impl="auto")
    model.forward = torch.compile(model.forward, backend=backend, dynamic=True)
    ids, mask = inputs(seed, length=40)
    dma_compile.hf.register(policy)
    eager = causal_lm("llama", "dma", seed)
    settings = dict(attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, output_logits=True,
                    return_dict_in_generate=True)
    with caplog.at_level(logging.INFO, logger="dma_compile.passes.rewrite_sdpa"), torch.no_grad():
        out = model.generate(ids, **settings)
        ref = eager.generate(ids, **settings)
    prefill, *decode = backend.reports
    assert len(prefill.rewritten) == 2 and not prefill.kept
    assert decode, "no decode graph was compiled"
    for report in decode:
        assert not report.rewritten and len(report.kept) == 2
        assert all(site.by_design and "min_q_len (16)" in site.reason for site in report.kept)
    logged = [r for r in caplog.records if "decode steps" in r.getMessage()]
    assert len(logged) == 1 and logged[0].levelno == logging.INFO
    assert torch.equal(out.sequences, ref.sequences), f"seed {seed}"
    for step, (a, b) in enumerate(zip(out.logits, ref.logits)):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5, msg=f"seed {seed} step {step}")


def test_decode_reason_needs_a_query_provably_shorter_than_min_q_len():
    args = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
    policy = AttentionPolicy(min_q_len=8)
    with FakeTensorMode():
        def reason(length, impl="auto"):
            q, k, v = qkv(length=length)
            return rewrite_sdpa_module.decode_reason({**args, "query": q, "key": k, "value": v}, policy, impl)

        assert "min_q_len (8)" in reason(7)
        assert reason(8) is None
        assert reason(1, impl="reference") is None and reason(1, impl="sm90") is None


@no_duck_shapes
def test_prefill_into_a_filled_cache_and_chunked_prefill(seed):
    """Chunks of 30, 50 and 20 tokens into one DynamicCache (the later chunks
    attend to the cached keys): every graph runs the op, with eager DMA's output."""
    from transformers import DynamicCache

    policy = ModelPolicy(default=AttentionPolicy(tile=32))
    model = causal_lm("llama", "sdpa", seed)
    backend = Captured(policy)
    compiled = torch.compile(model, backend=backend, dynamic=True)
    dma_compile.hf.register(policy, impl="reference")
    eager = causal_lm("llama", "dma", seed)
    ids, _ = inputs(seed, batch=1, length=100, padded=False)
    caches = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with torch.no_grad():
        for start, end in ((0, 30), (30, 80), (80, 100)):
            chunk = ids[:, start:end]
            out = compiled(chunk, cache=caches[0], use_cache=True).logits
            ref = eager(chunk, cache=caches[1], use_cache=True).logits
            torch.testing.assert_close(out, ref, rtol=0, atol=2e-5, msg=f"seed {seed} chunk {start}:{end}")
    assert_every_graph_rewritten(backend, layers=2)


@no_duck_shapes
def test_kv_lengths_of_two_symbols_are_checked_at_run_time(seed):
    backend = Captured(ModelPolicy(default=AttentionPolicy(tile=32)))
    compiled = torch.compile(Attention(), backend=backend, fullgraph=True)
    q, k, v = qkv()
    torch._dynamo.mark_dynamic(k, 2)
    torch._dynamo.mark_dynamic(v, 2)
    # Both calls as the rewritten graph runs them: the reference of the same policy.
    policy = AttentionPolicy(tile=32)
    out = dma_attention(q, k, v, policy=policy, impl="reference")
    expected = dma_attention(out, k, v, policy=policy, impl="reference")
    torch.testing.assert_close(compiled(q, k, v), expected, rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
    assert len(backend.ops()) == 2 and len(backend.graphs) == 1
    with pytest.raises(ValueError, match=r"v: \(batch, heads, length\) must match k's \(2, 4, 37\), got \(2, 4, 30\)"):
        compiled(q, k, v[:, :, :30].contiguous())
    assert len(backend.graphs) == 1


def test_unknown_impl_is_refused():
    with pytest.raises(ValueError, match="impl must be one of .* got 'sm80'"):
        rewrite_sdpa(torch.fx.Graph(), None, impl="sm80")
