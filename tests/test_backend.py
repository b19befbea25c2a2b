"""The "dma" torch.compile backend and the Inductor custom pass (dma_compile.backend).

These compile tiny random-weight transformers models with Inductor on CPU,
where the op runs the reference.
"""

import logging
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code
from tiny_models import causal_lm, gpt2

import dma_compile
import dma_compile.hf
import dma_compile.ops
from dma_compile import AttentionPolicy, ModelPolicy, dma_attention
from dma_compile.backend import (
    DmaBackend,
    SdpaRewritePass,
    dma_backend,
    inductor_config_patches,
    install_inductor_pass,
    uninstall_inductor_pass,
)

POLICY = ModelPolicy(
    default=AttentionPolicy(tile=32),
    layers={1: AttentionPolicy(tile=32, hi="none", lo="mxfp8_e4m3", mx_mode="folded", pv="fp8")},
)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.gpu
def test_llama_on_the_gpu_runs_the_kernel(seed, caplog):
    """backend="dma" on CUDA: the kernel (not the reference fallback) serves every
    layer, close to the eager reference of the same policy."""
    dma_compile.ops._warn_fallback_once.cache_clear()
    model = causal_lm("llama", "sdpa", seed, head_dim=64).cuda().to(torch.bfloat16)
    ids = torch.randint(0, 97, (2, 300), generator=torch.Generator().manual_seed(seed)).cuda()
    mask = torch.ones_like(ids)
    mask[0, :37] = 0
    with torch.no_grad(), caplog.at_level(logging.INFO):
        out = torch.compile(model, backend="dma", fullgraph=True)(ids, attention_mask=mask).logits
        dma_compile.hf.register(None, impl="reference")
        ref = causal_lm("llama", "dma", seed, head_dim=64).cuda().to(torch.bfloat16)(ids, attention_mask=mask).logits
    assert any("2 of 2 SDPA call sites run dma.attention" in r.getMessage() for r in caplog.records)
    assert not any("instead of the kernel" in r.getMessage() for r in caplog.records)
    valid = mask.bool()
    assert relative_error(out[valid].float(), ref[valid].float()) < 2e-2, f"seed {seed}"


@pytest.mark.gpu
def test_llama_under_cuda_graphs_matches_eager_dma(seed, caplog):
    """mode="reduce-overhead": the kernel's launches are captured and replayed
    through CUDA graphs (the third call on replays), with a padding mask that
    changes between calls: the mask classification must follow the replayed
    mask's contents, not a cached earlier one."""
    dma_compile.ops._warn_fallback_once.cache_clear()
    model = causal_lm("llama", "sdpa", seed, head_dim=64).cuda().to(torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    dma_compile.hf.register(None, impl="reference")
    ref_model = causal_lm("llama", "dma", seed, head_dim=64).cuda().to(torch.bfloat16)
    compiled = torch.compile(model, backend="dma", mode="reduce-overhead", fullgraph=True)
    with torch.no_grad(), caplog.at_level(logging.INFO):
        for pad in (0, 21, 150, 7):
            mask = torch.ones(2, 300, dtype=torch.long)
            mask[1, :pad] = 0
            mask = mask.cuda()
            ids = torch.randint(0, 97, (2, 300), generator=gen).cuda()
            out = compiled(ids, attention_mask=mask).logits.float().clone()
            ref = ref_model(ids, attention_mask=mask).logits.float()
            valid = mask.bool()
            assert relative_error(out[valid], ref[valid]) < 2e-2, f"seed {seed}"
    assert any("2 of 2 SDPA call sites run dma.attention" in r.getMessage() for r in caplog.records)
    assert not any("instead of the kernel" in r.getMessage() for r in caplog.records)
    assert counters["inductor"]["cudagraph_skips"] == 0


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


def test_llama_one_compile_for_all_lengths_matches_eager_dma(seed):
    backend = dma_backend(POLICY, impl="reference")
    model = causal_lm("llama", "sdpa", seed)
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=True)
    dma_compile.hf.register(POLICY, impl="reference")
    eager_dma = causal_lm("llama", "dma", seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for length in (45, 70, 97):
            ids = torch.randint(0, 97, (2, length), generator=gen)
            mask = torch.ones_like(ids)
            mask[1, : length // 4] = 0
            out = compiled(ids, attention_mask=mask).logits
            ref = eager_dma(ids, attention_mask=mask).logits
            sdpa = model(ids, attention_mask=mask).logits
            valid = mask.bool()
            # Inductor's fp32 arithmetic may flip a rare MX or FP8 rounding against
            # eager: compiled output must be far closer to eager DMA than to SDPA.
            error = relative_error(out[valid], ref[valid])
            error_sdpa = relative_error(out[valid], sdpa[valid])
            assert error < 1e-3 < error_sdpa < 0.05, f"seed {seed} L {length}: {error} vs DMA, {error_sdpa} vs SDPA"
    assert counters["stats"]["unique_graphs"] == 1
    sites = backend.reports[-1].rewritten
    assert [s.policy for s in sites] == [POLICY.for_layer(i).to_string() for i in range(2)]
    assert all(s.unexpanded_kv for s in sites)


def op_call_arguments(code: str) -> list[list[str]]:
    """Top-level arguments of each dma.attention call in Inductor's output code."""
    calls = []
    for start in (m.end() for m in re.finditer(r"torch\.ops\.dma\.attention\.default\(", code)):
        depth, quoted, args, current = 0, False, [], ""
        for char in code[start:]:
            quoted ^= char == "'"
            if char == "," and depth == 0 and not quoted:
                args.append(current.strip())
                current = ""
                continue
            if not quoted:
                depth += {"(": 1, ")": -1}.get(char, 0)
            if depth < 0:
                break
            current += char
        calls.append(args + [current.strip()])
    return calls


def test_inductor_builds_the_mask_once_for_all_layers(seed):
    """transformers' boolean mask reaches every layer's op as one buffer, so it
    is written once and the kernel's per-mask block classification is reused."""
    model = causal_lm("llama", "sdpa", seed)
    ids = torch.randint(0, 97, (2, 70), generator=torch.Generator().manual_seed(seed))
    compiled = torch.compile(model, backend=dma_backend(POLICY, impl="reference"), fullgraph=True, dynamic=True)
    # Generate the code afresh: a cached entry could predate the op's layout tag.
    with (
        torch.no_grad(),
        torch._inductor.config.patch(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        _, codes = run_and_get_code(compiled, ids, attention_mask=torch.ones_like(ids), use_cache=False)
    calls = [args for code in codes for args in op_call_arguments(code)]
    assert len(calls) == 2 and all(len(args) == 8 for args in calls)
    masks = {args[3] for args in calls}
    assert len(masks) == 1 and masks != {"None"}, masks


def test_backend_by_name_through_the_entry_point(seed, caplog):
    (entry,) = [e for e in entry_points(group="torch_dynamo_backends") if e.name == "dma"]
    assert entry.value == "dma_compile.backend:dma_backend" and entry.load() is dma_backend
    assert "dma" in torch._dynamo.list_backends()

    model = gpt2("sdpa", seed)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad(), caplog.at_level(logging.INFO, logger="dma_compile.backend"):
        out = torch.compile(model, backend="dma", fullgraph=True)(ids).logits
        dma_compile.hf.register(None, impl="reference")
        ref = gpt2("dma", seed)(ids).logits
    assert any("2 of 2 SDPA call sites run dma.attention" in r.getMessage() for r in caplog.records)
    assert relative_error(out, ref) < 1e-3, f"seed {seed}"


def repeat_kv_attention(q, k, v):
    k = k[:, :, None].expand(2, 2, 2, k.shape[2], 32).reshape(2, 4, k.shape[2], 32)
    v = v[:, :, None].expand(2, 2, 2, v.shape[2], 32).reshape(2, 4, v.shape[2], 32)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2


def qkv(length=50):
    return torch.randn(2, 4, length, 32), torch.randn(2, 2, length, 32), torch.randn(2, 2, length, 32)


def test_sdpa_inside_higher_order_op_bodies(seed):
    def f(q, k, v):
        return torch.cond(
            q.sum() > 0,
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v) * 2,
            (q, k, v),
        )

    policy = AttentionPolicy(tile=32)
    backend = dma_backend(policy, impl="reference")
    q, k, v = (torch.randn(1, 2, 40, 32) for _ in range(3))
    out = torch.compile(f, backend=backend, fullgraph=True)(q, k, v)
    assert len(backend.reports[-1].rewritten) == 2
    if q.sum() > 0:
        expected = dma_attention(q, k, v, is_causal=True, policy=policy, impl="reference")
    else:
        expected = dma_attention(q, k, v, policy=policy, impl="reference") * 2
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6, msg=f"seed {seed}")


def test_mode_and_options_are_inductors():
    patches = inductor_config_patches("max-autotune-no-cudagraphs", {"epilogue-fusion": False})
    assert patches["max_autotune"] is True and patches["epilogue_fusion"] is False
    assert inductor_config_patches() == {} and inductor_config_patches("default") == {}
    with pytest.raises(ValueError, match="options: unknown Inductor option 'no_such_option'"):
        inductor_config_patches(None, {"no_such_option": 1})


def test_policy_backend_takes_compile_options(seed):
    policy = AttentionPolicy(tile=32)
    backend = dma_backend(policy, impl="reference")
    assert isinstance(backend, DmaBackend) and backend.policy == ModelPolicy(default=policy)
    q, k, v = qkv()
    compiled = torch.compile(repeat_kv_attention, backend=backend, options={"epilogue_fusion": False})
    expected = dma_attention(q, k, v, is_causal=True, policy=policy, impl="reference") * 2
    torch.testing.assert_close(compiled(q, k, v), expected, rtol=0, atol=1e-6, msg=f"seed {seed}")
    with pytest.raises(ValueError, match="impl must be one of"):
        dma_backend(policy, impl="cuda")


def test_inductor_pass_follows_the_policy_through_the_cache(seed):
    """Compile the same function under two policies with Inductor's caches on:
    each compile must see its own policy (a stale cache entry would give the
    other policy's output)."""
    q, k, v = qkv()
    policies = [AttentionPolicy(tile=32), AttentionPolicy(tile=32, hi="mxfp4_e2m1", lo="mxfp4_e2m1")]
    outputs = []
    try:
        for policy in policies:
            torch._dynamo.reset()
            install_inductor_pass(policy, impl="reference")
            outputs.append(torch.compile(repeat_kv_attention, fullgraph=True)(q, k, v))
            expected = dma_attention(q, k, v, is_causal=True, policy=policy, impl="reference") * 2
            torch.testing.assert_close(outputs[-1], expected, rtol=0, atol=1e-6, msg=f"seed {seed} policy {policy}")
    finally:
        uninstall_inductor_pass()
    assert torch._inductor.config.pre_grad_custom_pass is None
    assert not torch.allclose(outputs[0], outputs[1], atol=1e-3)


def test_pass_uuid_covers_policy_and_impl():
    def uuid(policy, impl="auto"):
        return SdpaRewritePass(ModelPolicy(default=policy) if policy else None, impl).uuid()

    paper, hopper = AttentionPolicy.paper(), AttentionPolicy.hopper()
    assert uuid(paper) == uuid(AttentionPolicy())
    assert len({uuid(paper), uuid(hopper), uuid(paper, "reference"), uuid(None)}) == 4
    per_layer = SdpaRewritePass(ModelPolicy(default=paper, layers={3: hopper}), "auto").uuid()
    assert per_layer != uuid(paper)


def test_install_refuses_a_foreign_pass():
    def foreign(graph):
        return None

    torch._inductor.config.pre_grad_custom_pass = foreign
    try:
        with pytest.raises(ValueError, match="pre_grad_custom_pass already holds"):
            install_inductor_pass()
    finally:
        torch._inductor.config.pre_grad_custom_pass = None


def test_compiled_generate_with_inductor_runs_dma_in_every_graph(seed):
    """The flow of a new user: model.forward compiled with dynamic=True, then
    generate(). The third graph (a recompile for the new strides of the cache
    Inductor returned) has two length symbols for the cached keys and values."""
    model = causal_lm("llama", "sdpa", seed)
    backend = dma_backend(POLICY, impl="reference")
    model.forward = torch.compile(model.forward, backend=backend, dynamic=True)
    ids = torch.randint(0, 97, (1, 40), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert len(backend.reports) >= 3
    assert all(len(r.rewritten) == 2 and not r.kept for r in backend.reports), [
        [s.reason for s in r.kept] for r in backend.reports
    ]


WITHOUT_ENTRY_POINT = """
import importlib.metadata as metadata

installed = metadata.entry_points


def entry_points(**selection):  # as in a source checkout that was never pip-installed
    found = installed(**selection)
    if "group" not in selection:
        return found
    return metadata.EntryPoints(e for e in found if (e.group, e.name) != ("torch_dynamo_backends", "dma"))


metadata.entry_points = entry_points
"""
COMPILE_BY_NAME = """
import torch
import torch.nn.functional as F

import dma_compile
from dma_compile.backend import _default_backend


def attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


q, k, v = (torch.randn(1, 2, 40, 32) for _ in range(3))
with torch.no_grad():
    out = torch.compile(attention, backend="dma", fullgraph=True)(q, k, v)
expected = dma_compile.dma_attention(q, k, v, is_causal=True)
assert torch.allclose(out, expected, atol=1e-6), (out - expected).abs().max()
print("rewritten", len(_default_backend.reports[-1].rewritten))
"""


def run_python(code: str, cwd) -> str:
    """Run `code` in a fresh interpreter that finds the package only through PYTHONPATH."""
    root = Path(dma_compile.__file__).parents[1]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_backend_by_name_without_the_entry_point(tmp_path):
    """`import dma_compile` registers backend="dma" with Dynamo itself."""
    assert run_python(WITHOUT_ENTRY_POINT + COMPILE_BY_NAME, tmp_path).split() == ["rewritten", "1"]


def test_entry_point_loaded_before_import_registers_once(tmp_path):
    """Dynamo loading the entry point imports the package: that import must not
    register the name a second time (Dynamo refuses duplicates)."""
    code = (
        "import torch._dynamo\n"
        "backend = torch._dynamo.lookup_backend('dma')\n"
        "import dma_compile.backend\n"
        "assert backend is dma_compile.backend.dma_backend, backend\n"
        "print('ok')\n"
    )
    assert run_python(code, tmp_path).split() == ["ok"]


@pytest.mark.parametrize(
    "door",
    [
        lambda: dma_backend(None, impl="cuda"),
        lambda: DmaBackend(None, impl="cuda"),
        lambda: install_inductor_pass(None, impl="cuda"),
        lambda: SdpaRewritePass(None, "cuda"),
    ],
    ids=["dma_backend", "DmaBackend", "install_inductor_pass", "SdpaRewritePass"],
)
def test_unknown_impl_is_refused(door):
    expected = r"impl must be one of \['auto', 'reference', 'sm90_gluon', 'sm90', 'sm100'\], got 'cuda'"
    with pytest.raises(ValueError, match=expected):
        door()
    assert torch._inductor.config.pre_grad_custom_pass is None
