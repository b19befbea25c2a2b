"""benchmarks/bench_hopper.py builds its methods on any machine (the Triton
pass under the interpreter): both stock-SDPA baselines compute the same
attention, the second on inputs laid out as transformers passes them; a
baseline version of the portable kernel's module is timed as its own row."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_hopper.py"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_hopper", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (no GPU): the pass runs on CPU tensors")
def test_sdpa_baselines_agree_across_layouts(seed):
    bench = _load_bench()
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 40, 64, generator=gen).bfloat16()
    k, v = (torch.randn(1, 2, 40, 64, generator=gen).bfloat16() for _ in range(2))
    methods = bench.methods_for(q, k, v, True, {"": {}}, ["hopper"])
    assert list(methods)[:3] == ["sdpa", "sdpa_model_layout", "graphed_sdpa"]
    assert methods["graphed_sdpa"] is methods["sdpa"]
    moved = bench.model_layout(q)
    assert torch.equal(moved, q) and moved.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(methods["sdpa_model_layout"](), methods["sdpa"](), rtol=0, atol=1e-2)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (no GPU): the kernel runs on CPU tensors")
def test_a_portable_kernel_baseline_gets_its_own_row(seed):
    bench = _load_bench()
    from dma_compile.kernels import attention_sm90

    baseline = bench.load_baseline(attention_sm90.__file__)
    assert baseline is not attention_sm90
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, 40, 64, generator=gen).bfloat16()
    k, v = (torch.randn(1, 1, 40, 64, generator=gen).bfloat16() for _ in range(2))
    methods = bench.methods_for(q, k, v, True, {"": {}}, ["hopper"], baseline)
    assert "baseline_hopper" not in methods and "baseline_hopper_kernel_only" not in methods
    # The same code loaded twice computes the same bits.
    assert torch.equal(methods["baseline_triton_hopper"](), methods["triton_hopper"]())
