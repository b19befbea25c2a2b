"""The `dma-compile` command: assets, calibrate, compare, quickstart.

    dma-compile assets                          fetch + prepare the default model and text
    dma-compile calibrate --model DIR --text FILE --budget 0.03 [--allocation model|weighted] --out policy.json
    dma-compile compare --model DIR --text FILE [--policy policy.json] [--json out.json]
    dma-compile quickstart [--out dma-out]     assets -> calibrate -> compile -> compare

Bad input (a missing model or text, an empty text, a budget <= 0, a policy
made for another layer count, an output path in a missing directory) prints
one line and exits with status 2, before any work. torch loads only once the
arguments are parsed, so `--help` and usage errors are instant.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from pathlib import Path

EXIT_BAD_INPUT = 2

# Per-layer error budgets of the quickstart (unit: see dma_compile.calibrate),
# chosen on SmolLM2-135M with 2048-token calibration windows (GPU). The
# quickstart calibrates at the comparison's window length, and errors grow with
# length, so the CPU's 1024-token windows get tighter budgets that pick
# comparable policies.
QUICKSTART_BUDGETS = {"gpu": {"sm100": 0.08, "sm90": 0.02}, "cpu": {"sm100": 0.05, "sm90": 0.012}}


class BadInput(ValueError):
    """A user error: reported in one line, exit status 2."""


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive number (a relative L2 error such as 0.03), got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line (still exit status 2)."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dma-compile", description="Calibrate and compare DMA (diagonal-tiled mixed-precision) attention."
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("assets", help="fetch and prepare the embedded default model and text (idempotent)")
    p.add_argument("--cache", help="cache directory (default: $DMA_COMPILE_CACHE or ~/.cache/dma-compile)")

    p = sub.add_parser("calibrate", help="choose a per-layer policy within an error budget")
    p.add_argument("--model", required=True, help="transformers model directory")
    p.add_argument("--text", required=True, help="UTF-8 text file (its last 10%% is held out, never calibrated on)")
    p.add_argument("--budget", required=True, type=_positive_float,
                   help="allowed relative L2 error of each layer's attention output, e.g. 0.03")
    p.add_argument("--out", required=True, help="policy JSON to write")
    p.add_argument("--target", default="auto", choices=["auto", "sm90", "sm100"], help="GPU the cost model is for")
    p.add_argument("--windows", type=_positive_int, help="calibration windows (default 2 on CPU, 4 on a GPU)")
    p.add_argument("--window-len", type=_positive_int, help="tokens per window (default 512 on CPU, 2048 on a GPU)")
    p.add_argument("--measure", action="store_true", help="measure the per-format rates through the kernels (GPU)")
    p.add_argument("--allocation", default="layer", choices=["layer", "model", "weighted"],
                   help="layer: every layer's error within the budget; model: the root mean square of the layers' "
                        "errors within it, spent where it buys the most (slower: all candidates scored in full); "
                        "weighted: the same with each layer's error weighted by its measured effect on the logits")

    p = sub.add_parser("compare", help="tables of per-layer error, perplexity, agreement and speed")
    p.add_argument("--model", required=True, help="transformers model directory")
    p.add_argument("--text", required=True, help="UTF-8 text file (evaluated on its held-out last 10%%)")
    p.add_argument("--policy", help="calibrated policy JSON to compare besides the standard policies")
    p.add_argument("--json", help="write the measurements to this JSON file")
    p.add_argument("--plot", help="write the per-layer error plot to this PNG file")
    _compare_sizes(p)

    p = sub.add_parser("quickstart", help="assets -> calibrate -> compile -> compare on the embedded default")
    p.add_argument("--out", default="dma-out", help="output directory (default ./dma-out)")
    p.add_argument("--target", default="auto", choices=["auto", "sm90", "sm100"], help="GPU the cost model is for")
    p.add_argument("--budget", type=_positive_float,
                   help="per-layer error budget (default: {gpu[sm100]} for sm100, {gpu[sm90]} for sm90 on a GPU; "
                        "{cpu[sm100]} and {cpu[sm90]} with the CPU's shorter windows)".format(**QUICKSTART_BUDGETS))
    p.add_argument("--cache", help="asset cache directory")
    _compare_sizes(p, "tokens per window, of calibration and comparison alike")
    return parser


def _compare_sizes(p: argparse.ArgumentParser, window_len_help: str = "tokens per window") -> None:
    p.add_argument("--windows", type=_positive_int, help="held-out perplexity windows (default 4 on CPU, 8 on a GPU)")
    p.add_argument("--window-len", type=_positive_int,
                   help=f"{window_len_help} (default 1024 on CPU, 2048 on a GPU)")
    p.add_argument("--prompts", type=_positive_int, help="generation prompts (default 8 on CPU, 16 on a GPU)")
    p.add_argument("--prompt-len", type=_positive_int, help="prompt tokens (default 512 on CPU, 1024 on a GPU)")
    p.add_argument("--new-tokens", type=_positive_int, help="greedy tokens generated (default 32 on CPU, 64 on a GPU)")
    p.add_argument("--eager-only", action="store_true",
                   help="on a GPU, time eager prefill only (skip one torch.compile per policy with CUDA graphs)")


def _check_model_dir(path: str) -> str:
    from dma_compile.loading import check_model_dir

    try:
        return check_model_dir(path, "--model")
    except ValueError as e:
        raise BadInput(str(e)) from None


def _check_output_file(flag: str, path: str | None) -> None:
    """Fail now, not after the run, when `path` cannot be written."""
    if path is None:
        return
    if os.path.isdir(path):
        raise BadInput(f"{flag} {path!r} is a directory (expected a file name)")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise BadInput(f"{flag}: directory {folder!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise BadInput(f"{flag}: directory {folder!r} is not writable")


def _make_output_dir(flag: str, path: str) -> Path:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise BadInput(f"{flag}: cannot create directory {path!r}: {e.strerror}") from None
    if not os.access(path, os.W_OK):
        raise BadInput(f"{flag}: directory {path!r} is not writable")
    return Path(path)


def _read_text(path: str) -> str:
    from dma_compile.loading import read_text

    try:
        return read_text(path)
    except ValueError as e:
        raise BadInput(f"--text: {e}") from None


def _load_model(path: str):
    from dma_compile.loading import load_model

    return load_model(_check_model_dir(path))


def _load_policy(path: str, model_dir: str):
    """The policy JSON, checked against the model's config before any weights load."""
    from transformers import AutoConfig

    from dma_compile.hf import checked_layers
    from dma_compile.policy import ModelPolicy

    try:
        policy = ModelPolicy.load(path)
    except ValueError as e:
        raise BadInput(f"--policy: {e}") from None
    try:
        config = AutoConfig.from_pretrained(model_dir)
    except Exception as e:  # transformers raises many kinds for a bad config
        raise BadInput(f"--model {model_dir!r}: config.json cannot be read: {str(e).splitlines()[0]}") from None
    try:
        checked_layers(policy, config)
    except ValueError as e:
        raise BadInput(f"--policy: {e}") from None
    return policy


def cmd_assets(args) -> int:
    from dma_compile.assets import prepare_assets

    assets = prepare_assets(args.cache)
    print(f"model: {assets.model_dir}")
    print(f"text:  {assets.text_path}")
    return 0


def run_calibrate(model, tokenizer, text: str, budget: float, target: str, out: str, windows=None, window_len=None,
                  measure: bool = False, allocation: str = "layer"):
    from dma_compile.calibrate import calibrate, policy_table

    policy = calibrate(model, text, budget, target, tokenizer=tokenizer, windows=windows, window_len=window_len,
                       measure=measure, allocation=allocation)
    policy.stats["text"] = "held-out split: calibration on the first 90% of the text's tokens"
    policy.save(out)
    print(policy_table(policy))
    print(f"\nwrote {out}")
    return policy


def cmd_calibrate(args) -> int:
    _check_model_dir(args.model)
    _check_output_file("--out", args.out)
    text = _read_text(args.text)
    model, tokenizer = _load_model(args.model)
    run_calibrate(model, tokenizer, text, args.budget, args.target, args.out, args.windows, args.window_len,
                  args.measure, args.allocation)
    return 0


def run_compare(model, tokenizer, text: str, policy, args, json_path=None, plot_path=None):
    from dma_compile.compare import compare

    result = compare(
        model, text, policy, tokenizer=tokenizer, windows=args.windows, window_len=args.window_len,
        prompts=args.prompts, prompt_len=args.prompt_len, new_tokens=args.new_tokens, plot=plot_path,
        compiled_prefill=not args.eager_only,
    )
    print(result.report())
    if json_path:
        result.save_json(json_path)
        print(f"\nwrote {json_path}")
    if result.plot:
        print(f"wrote {result.plot}")
    return result


def cmd_compare(args) -> int:
    _check_model_dir(args.model)
    if args.policy and not os.path.isfile(args.policy):
        raise BadInput(f"--policy {args.policy!r} does not exist")
    _check_output_file("--json", args.json)
    _check_output_file("--plot", args.plot)
    text = _read_text(args.text)
    policy = _load_policy(args.policy, args.model) if args.policy else None
    model, tokenizer = _load_model(args.model)
    run_compare(model, tokenizer, text, policy, args, args.json, args.plot)
    return 0


def quiet_cuda_home_warning() -> None:
    """Drop torch's "No CUDA runtime is found, using CUDA_HOME=..." warning.

    A CUDA build of torch on a machine without a GPU logs it when Inductor's
    C++ backend (the compile on CPU) first loads torch.utils.cpp_extension;
    there it is expected and asks for nothing.
    """
    logging.getLogger("torch.utils.cpp_extension").addFilter(
        lambda record: not record.getMessage().startswith("No CUDA runtime is found")
    )


def _logit_gap(logits, reference) -> tuple[float, float]:
    """(relative L2 of the logits, share of positions with the same argmax)."""
    rel = float((logits - reference).norm() / reference.norm())
    return rel, float((logits.argmax(-1) == reference.argmax(-1)).float().mean())


def compile_check(model, policy, window) -> str:
    """torch.compile the model with the DMA backend under `policy`, run one
    held-out window and compare its logits with the same policy run eagerly,
    beside the eager policy's own distance from stock SDPA."""
    import torch

    from dma_compile.backend import dma_backend
    from dma_compile.hf import running_policy

    quiet_cuda_home_warning()
    device = next(model.parameters()).device
    ids = window[None].to(device)
    with torch.no_grad():
        with running_policy(model, policy):
            eager = model(ids, use_cache=False).logits.float()
        start = time.perf_counter()
        compiled = torch.compile(model, backend=dma_backend(policy))
        logits = compiled(ids, use_cache=False).logits.float()
        seconds = time.perf_counter() - start
        sdpa = model(ids, use_cache=False).logits.float()
    rel, agree = _logit_gap(logits, eager)
    rel_sdpa, agree_sdpa = _logit_gap(eager, sdpa)
    return (
        f"compile: torch.compile(model, backend=dma_backend(policy)) compiled and ran {ids.shape[1]} tokens in "
        f"{seconds:.1f}s\n"
        f"  compiled against eager, same policy: logits relative L2 {rel:.4f} (|difference| / |logits| over all "
        f"positions), argmax agreement {100 * agree:.1f}%\n"
        f"  for scale, eager policy against eager SDPA: relative L2 {rel_sdpa:.4f}, argmax agreement "
        f"{100 * agree_sdpa:.1f}%\n"
        "  (both compute the same attention; Inductor fuses and reorders the bf16 arithmetic around it, and MX "
        "rounding can turn such last-bit differences into whole quantization steps, so expect a difference of the "
        "order of the policy's own against SDPA, not zero; a miscompiled model differs far more)"
    )


def cmd_quickstart(args) -> int:
    out = _make_output_dir("--out", args.out)
    from dma_compile.assets import prepare_assets
    from dma_compile.calibrate import resolve_target
    from dma_compile.compare import Settings
    from dma_compile.loading import split_heldout, take_windows, tokenize

    start = time.perf_counter()
    print("== 1/4 assets")
    assets = prepare_assets(args.cache)
    text = _read_text(str(assets.text_path))
    model, tokenizer = _load_model(str(assets.model_dir))
    device = next(model.parameters()).device
    target = resolve_target(args.target)
    budget = args.budget or QUICKSTART_BUDGETS["gpu" if device.type == "cuda" else "cpu"][target]
    # Calibrate at the length the comparison measures: errors grow with length.
    window_len = Settings.for_device(device, window_len=args.window_len).window_len
    print(f"\n== 2/4 calibrate (target {target}, budget {budget}, {window_len}-token windows)")
    policy = run_calibrate(model, tokenizer, text, budget, target, str(out / "policy.json"), window_len=window_len)
    print("\n== 3/4 compile")
    _, heldout = split_heldout(tokenize(tokenizer, text))
    print(compile_check(model, policy, take_windows(heldout, 1, window_len, spread=False)[0]))
    print("\n== 4/4 compare")
    result = run_compare(model, tokenizer, text, policy, args, out / "compare.json", out / "layer_errors.png")
    (out / "report.md").write_text(result.report() + "\n")
    print(f"wrote {out / 'report.md'}\n\nquickstart finished in {time.perf_counter() - start:.0f}s")
    return 0


COMMANDS = {"assets": cmd_assets, "calibrate": cmd_calibrate, "compare": cmd_compare, "quickstart": cmd_quickstart}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from dma_compile.assets import AssetError

    try:
        return COMMANDS[args.command](args)
    except (BadInput, AssetError) as e:
        print(f"dma-compile {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ValueError as e:
        # Validation errors from the library name the offending argument.
        print(f"dma-compile {args.command}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
