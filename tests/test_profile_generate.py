"""benchmarks/profile_generate.py runs end to end on CPU (--tiny), eager and
compiled: each variant prints its prefill and decode tables and, with
--host, the host-side one."""

import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_tiny_eager_and_compiled_print_both_phases(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports bench_generate as a sibling
    spec = importlib.util.spec_from_file_location("profile_generate", BENCHMARKS / "profile_generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        module.main(["--tiny", "--modes", "eager,compiled", "--variants", "sdpa,dma", "--host", "3"])
    finally:
        sys.modules.pop("bench_generate", None)
    printed = capsys.readouterr().out
    for label in ("sdpa (eager)", "dma (eager)", "sdpa (compiled)", "dma (compiled)"):
        assert f"{label}, prompt 64, 4 new tokens, 2 layers" in printed, label
    assert printed.count("prefill: GPU kernels") == 4 and printed.count("decode, 3 steps: GPU kernels") == 4
    assert printed.count("host, the whole generate(): 3 entries by self CPU time") == 4
