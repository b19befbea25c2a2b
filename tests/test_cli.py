"""The dma-compile command: bad input gives one line and exit status 2; the
calibrate and compare subcommands work on a tiny model."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dma_compile.cli import main
from dma_compile.policy import AttentionPolicy, ModelPolicy
from test_calibrate import save_tiny, tiny_text


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    model = save_tiny(root / "model")
    text = root / "text.txt"
    text.write_text(tiny_text(2000, seed=3))
    empty = root / "empty.txt"
    empty.write_text("  \n\n")
    binary = root / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 10)
    no_config = root / "no_config"
    no_config.mkdir()
    other = root / "other_policy.json"
    ModelPolicy(AttentionPolicy.paper(), num_layers=30).save(other)
    broken = root / "broken.json"
    broken.write_text("{not json")
    return {"root": root, "model": str(model), "text": str(text), "empty": str(empty), "binary": str(binary),
            "no_config": str(no_config), "other": str(other), "broken": str(broken)}


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["calibrate", "--model", "{root}/missing", "--text", "{text}", "--budget", "0.1", "--out", "{root}/p.json"],
         "does not exist"),
        (["calibrate", "--model", "{no_config}", "--text", "{text}", "--budget", "0.1", "--out", "{root}/p.json"],
         "no config.json"),
        (["calibrate", "--model", "{text}", "--text", "{text}", "--budget", "0.1", "--out", "{root}/p.json"],
         "not a directory"),
        (["calibrate", "--model", "{model}", "--text", "{root}/missing.txt", "--budget", "0.1", "--out", "{root}/p.json"],
         "does not exist"),
        (["calibrate", "--model", "{model}", "--text", "{empty}", "--budget", "0.1", "--out", "{root}/p.json"],
         "is empty"),
        (["calibrate", "--model", "{model}", "--text", "{binary}", "--budget", "0.1", "--out", "{root}/p.json"],
         "not UTF-8"),
        (["calibrate", "--model", "{model}", "--text", "{root}", "--budget", "0.1", "--out", "{root}/p.json"],
         "is a directory"),
        (["calibrate", "--model", "{model}", "--text", "{text}", "--budget", "0", "--out", "{root}/p.json"],
         "--budget: must be a positive number"),
        (["calibrate", "--model", "{model}", "--text", "{text}", "--budget", "-0.5", "--out", "{root}/p.json"],
         "--budget: must be a positive number"),
        (["calibrate", "--model", "{model}", "--text", "{text}", "--budget", "abc", "--out", "{root}/p.json"],
         "expected a number"),
        (["calibrate", "--model", "{model}", "--text", "{text}", "--budget", "0.1", "--out", "{root}/no/dir/p.json"],
         "--out: directory"),
        (["calibrate", "--model", "{model}", "--text", "{text}", "--budget", "0.1", "--out", "{root}/p.json",
          "--target", "sm80"], "invalid choice"),
        (["calibrate", "--model", "{model}", "--text", "{text}", "--budget", "0.1", "--out", "{root}/p.json",
          "--allocation", "global"], "invalid choice"),
        (["compare", "--model", "{model}", "--text", "{text}", "--policy", "{other}"], "30 attention layers"),
        (["compare", "--model", "{model}", "--text", "{text}", "--policy", "{broken}"], "not valid JSON"),
        (["compare", "--model", "{model}", "--text", "{text}", "--policy", "{root}/none.json"], "does not exist"),
        (["compare", "--model", "{model}", "--text", "{empty}"], "is empty"),
        (["compare", "--model", "{model}", "--text", "{text}", "--windows", "0"], "must be >= 1"),
        (["compare", "--model", "{model}", "--text", "{text}", "--json", "{root}/no/dir/out.json"],
         "--json: directory"),
        (["compare", "--model", "{model}", "--text", "{text}", "--plot", "{root}/no/dir/errors.png"],
         "--plot: directory"),
        (["compare", "--model", "{model}", "--text", "{text}", "--json", "{root}"], "--json"),
        (["calibrate", "--model", "{model}", "--text", "{text}", "--budget", "0.1", "--out", "{root}"], "--out"),
        (["quickstart", "--out", "{text}/sub"], "--out: cannot create directory"),
        ([], "required"),
    ],
)
def test_bad_input_exits_2_with_one_line(files, capsys, argv, expected):
    argv = [a.format(**files) for a in argv]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("dma-compile") and "error" in lines[0]
    assert expected in lines[0]
    assert "Traceback" not in err


def test_calibrate_then_compare(files, capsys, tmp_path):
    policy_path = tmp_path / "policy.json"
    code, out, _ = run(capsys, "calibrate", "--model", files["model"], "--text", files["text"], "--budget", "0.05",
                       "--out", str(policy_path), "--target", "sm90", "--windows", "1", "--window-len", "200")
    assert code == 0
    assert "worst row" in out and "target sm90, budget 0.05" in out
    policy = ModelPolicy.load(policy_path)
    assert policy.num_layers == 2 and policy.stats["target"] == "sm90"
    assert all(p.mx_mode == "folded" for p in policy.layers.values())

    json_path = tmp_path / "compare.json"
    code, out, _ = run(capsys, "compare", "--model", files["model"], "--text", files["text"], "--policy",
                       str(policy_path), "--json", str(json_path), "--plot", str(tmp_path / "errors.png"),
                       "--windows", "1", "--window-len", "128", "--prompts", "1", "--prompt-len", "100",
                       "--new-tokens", "3")
    assert code == 0
    assert "(a) per-layer" in out and "(b) held-out perplexity" in out and "calibrated (sm90)" in out
    saved = json.loads(json_path.read_text())
    assert set(saved["policies"]) == {"sdpa", "all_mxfp8", "all_mxfp4", "paper", "paper_rotated", "hopper", "calibrated (sm90)"}
    assert (tmp_path / "errors.png").is_file()


def test_calibrate_model_allocation(files, capsys, tmp_path):
    policy_path = tmp_path / "policy.json"
    code, out, _ = run(capsys, "calibrate", "--model", files["model"], "--text", files["text"], "--budget", "0.05",
                       "--out", str(policy_path), "--target", "sm100", "--windows", "1", "--window-len", "200",
                       "--allocation", "model")
    assert code == 0 and "model allocation: root mean square" in out
    stats = ModelPolicy.load(policy_path).stats
    assert stats["allocation"] == "model" and stats["model_error"] <= 0.05


@pytest.mark.parametrize("flag, compiled", [([], True), (["--eager-only"], False)])
def test_eager_only_skips_the_compiled_prefill(files, capsys, monkeypatch, flag, compiled):
    import dma_compile.compare

    seen = {}

    class Result:
        plot = None

        def report(self):
            return "report"

    def fake_compare(*args, **kwargs):
        seen.update(kwargs)
        return Result()

    monkeypatch.setattr(dma_compile.compare, "compare", fake_compare)
    code, out, _ = run(capsys, "compare", "--model", files["model"], "--text", files["text"], *flag)
    assert code == 0 and "report" in out
    assert seen["compiled_prefill"] is compiled


@pytest.mark.parametrize("argv", [
    ["compare", "--model", "{model}", "--text", "{text}", "--json", "{root}/no/dir/out.json"],
    ["compare", "--model", "{model}", "--text", "{text}", "--json", "{root}/out.json", "--plot", "{root}/no/p.png"],
    ["calibrate", "--model", "{model}", "--text", "{text}", "--budget", "0.1", "--out", "{root}/no/dir/p.json"],
])
def test_output_paths_are_checked_before_any_work(files, capsys, monkeypatch, argv):
    import dma_compile.cli

    def no_work(*args, **kwargs):
        raise AssertionError("the output path must be checked before the model loads")

    monkeypatch.setattr(dma_compile.cli, "_load_model", no_work)
    monkeypatch.setattr(dma_compile.cli, "_read_text", no_work)
    code, _, err = run(capsys, *[a.format(**files) for a in argv])
    assert code == 2 and "does not exist" in err


# Runs dma_compile.cli.main in a fresh interpreter and reports whether torch got imported.
WITHOUT_TORCH = """
import sys
from dma_compile.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print("torch imported:", "torch" in sys.modules, file=sys.stderr)
sys.exit(code)
"""


def _run_fresh(files, *argv) -> subprocess.CompletedProcess:
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", WITHOUT_TORCH, *[a.format(**files) for a in argv]], env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("argv, code", [
    (["--help"], 0),
    (["compare", "--help"], 0),
    (["calibrate", "--model", "{model}", "--budget", "-1", "--text", "{text}", "--out", "p.json"], 2),
    (["compare", "--model", "{root}/missing", "--text", "{text}"], 2),
    (["compare", "--model", "{model}", "--text", "{text}", "--plot", "{root}/no/dir/p.png"], 2),
])
def test_help_and_argument_errors_do_not_import_torch(files, argv, code):
    done = _run_fresh(files, *argv)
    assert done.returncode == code, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "torch imported: False"
    if code == 0:
        assert "usage: dma-compile" in done.stdout
    else:
        assert "error" in done.stderr.splitlines()[0]


def test_cuda_home_warning_is_dropped_and_others_kept(caplog):
    import logging

    from dma_compile.cli import quiet_cuda_home_warning

    quiet_cuda_home_warning()
    logger = logging.getLogger("torch.utils.cpp_extension")
    with caplog.at_level(logging.WARNING):
        logger.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local/cuda")
        logger.warning("something else")
    assert [r.getMessage() for r in caplog.records] == ["something else"]


def test_compile_check_reports_relative_figures(files):
    import torch

    from dma_compile.loading import load_model
    from dma_compile.cli import compile_check

    model, _ = load_model(files["model"])
    window = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
    line = compile_check(model, ModelPolicy(AttentionPolicy.preset("all_mxfp4")), window)
    assert "compiled and ran 64 tokens" in line
    assert "compiled against eager, same policy: logits relative L2" in line
    assert "eager policy against eager SDPA: relative L2" in line
    figures = [float(f) for f in re.findall(r"relative L2 ([0-9.]+)", line)]
    assert len(figures) == 2 and all(0 <= f < 1 for f in figures)
    assert figures[1] > 0  # all-MXFP4 moves the logits away from SDPA's
