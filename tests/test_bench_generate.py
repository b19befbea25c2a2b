"""benchmarks/bench_generate.py runs end to end on CPU (--tiny): every eager
variant gets a row with finite timings and a logits comparison, and the JSON
on disk holds the same rows."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_generate.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_generate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through sys.modules
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_tiny_run_has_every_variant_with_finite_numbers(bench, tmp_path, capsys):
    out = tmp_path / "bench.json"
    results = bench.main(["--tiny", "--warmup", "0", "--repeats", "1", "--new-tokens", "4", "--out", str(out)])
    printed = capsys.readouterr().out
    rows = results["rows"]
    assert [(r["variant"], r["mode"]) for r in rows] == [("sdpa", "eager"), ("dma", "eager"), ("dma-input-pv", "eager")]
    for row in rows:
        assert "error" not in row, row
        assert row["prompt"] == 64 and row["layers"] == 2
        for key in ("ttft_ms", "decode_tok_s", "ttft_x_sdpa", "decode_x_sdpa"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
    for row in rows[1:]:
        # Lossy formats move the logits, but only a little.
        assert 0 < row["logits_rel_err"] < 0.2, row
        assert isinstance(row["argmax_agree"], bool)
    assert rows[0]["ttft_x_sdpa"] == 1.0
    assert json.loads(out.read_text())["rows"] == rows
    assert "2 decoder layers" in printed and "dma-input-pv" in printed
    assert "target: compiled DMA TTFT >= 1.4x compiled SDPA at 16384 tokens: not measured" in printed


def test_variants_run_in_the_given_order_and_are_compared_to_a_later_sdpa(bench, tmp_path):
    out = tmp_path / "bench.json"
    rows = bench.main(["--tiny", "--warmup", "0", "--repeats", "1", "--new-tokens", "3", "--variants", "dma,sdpa",
                       "--out", str(out)])["rows"]
    assert [r["variant"] for r in rows] == ["dma", "sdpa"]
    assert 0 < rows[0]["logits_rel_err"] < 0.2 and math.isfinite(rows[0]["ttft_x_sdpa"]), rows[0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt-lens", "4k"], "--prompt-lens: expected comma-separated integers"),
        (["--prompt-lens", "0"], "--prompt-lens: lengths must be positive"),
        (["--new-tokens", "1"], "--new-tokens: at least 2"),
        (["--variants", "sdpa,flash"], "--variants: unknown ['flash']"),
        (["--modes", "eager,jit"], "--modes: unknown ['jit']"),
    ],
)
def test_bad_arguments_name_the_option(bench, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_compiled_is_shorthand_for_both_modes(bench):
    assert bench.parse_args(["--compiled"]).modes == ["eager", "compiled"]
    assert bench.parse_args(["--modes", "compiled"]).modes == ["compiled"]


def test_targets_are_judged_per_mode_and_length(bench):
    """The footer's verdicts follow the rows: a compiled 16k row below 1.4x fails
    its target, an eager 16k row at 1.0x meets its own."""
    rows = [
        {"variant": "sdpa", "mode": "eager", "prompt": 16384, "ttft_ms": 100.0, "decode_tok_s": 50.0},
        {"variant": "dma", "mode": "eager", "prompt": 16384, "ttft_ms": 100.0, "decode_tok_s": 49.0},
        {"variant": "sdpa", "mode": "compiled", "prompt": 16384, "ttft_ms": 90.0, "decode_tok_s": 60.0},
        {"variant": "dma", "mode": "compiled", "prompt": 16384, "ttft_ms": 75.0, "decode_tok_s": 55.0},
        {"variant": "dma-cache", "mode": "compiled", "prompt": 16384, "ttft_ms": 95.0, "decode_tok_s": 30.0},
        {"variant": "sdpa", "mode": "compiled", "prompt": 32768, "ttft_ms": 200.0, "decode_tok_s": 40.0},
        {"variant": "dma-cache", "mode": "compiled", "prompt": 32768, "ttft_ms": 190.0, "decode_tok_s": 56.0},
    ]
    bench.add_ratios(rows)
    lines = bench.target_lines(rows)
    # The quantized-cache rows have their own decode target, and stay out of the bf16-cache ones.
    assert lines[4] == "target: dma-cache decode tok/s >= 1.3x SDPA's from 32768 tokens: met (compiled 32768: 1.400x)"
    assert lines[0].startswith("target: eager DMA TTFT >= 1.0x eager SDPA at 16384 tokens: met")
    assert "at 4096 tokens: not measured" in lines[1]
    assert lines[2].startswith("target: compiled DMA TTFT >= 1.4x compiled SDPA at 16384 tokens: not met (dma 1.200x)")
    assert "not met (lowest: dma compiled at 16384: 0.917x)" in lines[3]
