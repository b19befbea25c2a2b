"""The comparison's tables (tabulate, GitHub style) and its per-layer error plot."""

from __future__ import annotations

import os
from pathlib import Path

from dma_compile.calibrate.cost import DEFAULT_COST_LEN
from dma_compile.calibrate.report import describe
from dma_compile.compare.result import Comparison
from dma_compile.policy import ModelPolicy


def _pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def build_tables(result: Comparison, policies: dict, calibrated: ModelPolicy | None) -> None:
    """Fill `result.tables`: (a) per-layer errors, (b) model-level measures, (c) speed where measured."""
    from tabulate import tabulate

    dma_names = [n for n, p in policies.items() if p is not None]
    stats = ((calibrated.stats or {}) if calibrated is not None else {}).get("layers", {})
    cal_name = next((n for n in dma_names if n.startswith("calibrated")), None)
    rows = []
    for row in result.layers:
        layer = row["layer"]
        line = [layer]
        if cal_name:
            line.append(describe(policies[cal_name].for_layer(layer)))
            s = stats.get(str(layer))
            line.append(f"{s['rel_l2']:.4f}" if s else "-")
        line += [f"{row[n]['rel_l2']:.4f}" for n in dma_names]
        rows.append(line)
    headers = ["layer"] + (["calibrated policy", "calib. rel L2"] if cal_name else []) + dma_names
    window = result.settings
    calib_len = (calibrated.stats or {}).get("window_len") if cal_name else None
    measured = f"held-out window of {window['window_len']} tokens"
    if calib_len:
        calib = calibrated.stats
        measured += f"; calib. rel L2: calibration's own, on {calib['windows']} x {calib_len}-token windows"
    result.tables["layers"] = (
        f"(a) per-layer relative L2 error of the attention output, {measured}\n"
        + tabulate(rows, headers=headers, tablefmt="github")
    )

    sdpa_ppl = result.policies["sdpa"]["perplexity"]
    rows = []
    for name, r in result.policies.items():
        rows.append(
            [
                name,
                f"{r['perplexity']:.4f}",
                _pct(r["perplexity"] / sdpa_ppl - 1),
                f"{r['first_divergence']:.1f} ± {r['first_divergence_sem']:.1f}",
                f"{100 * r['match_rate']:.0f}% ± {100 * r['match_rate_sem']:.0f}%",
                f"{r['cost_sm100']:.3f}",
                f"{r['cost_sm90']:.3f}",
                f"{100 * r['mxfp4_fraction']:.0f}%",
            ]
        )
    headers = ["policy", "perplexity", "vs SDPA", "tokens to 1st divergence", "match rate",
               "cost sm100", "cost sm90", "MXFP4 tiles"]
    result.tables["model"] = (
        f"(b) held-out perplexity ({window['windows']} x {window['window_len']} tokens), greedy agreement with SDPA "
        f"({window['prompts']} prompts of {window['prompt_len']} + {window['new_tokens']} tokens; mean ± standard "
        f"error over the prompts), modelled cost at "
        f"{DEFAULT_COST_LEN} tokens (1 = bf16 SDPA)\n" + tabulate(rows, headers=headers, tablefmt="github")
    )

    if result.speed:
        base = result.speed["sdpa"]
        columns = [("prefill_ms", "eager prefill ms"), ("compiled_prefill_ms", "compiled prefill ms"),
                   ("attention_ms", "attention ms")]
        columns = [c for c in columns if c[0] in base]
        rows = []
        for name, s in result.speed.items():
            row = [name]
            for key, _ in columns:
                row += [f"{s[key]:.3f}", f"{base[key] / s[key]:.2f}x"]
            rows.append(row)
        headers = ["policy"] + [h for _, title in columns for h in (title, "speedup")]
        result.tables["speed"] = (
            f"(c) GPU prefill of {window['window_len']} tokens: eager (host work included), compiled "
            "(torch.compile mode=\"reduce-overhead\": Inductor for SDPA, the dma backend otherwise; CUDA graphs), "
            "and the GPU time of the attention calls summed over layers\n"
            + tabulate(rows, headers=headers, tablefmt="github")
        )


def length_note(calib_len: int, compare_len: int) -> str:
    """Why a policy within its budget at calibration can exceed it here."""
    return (
        f"note: the calibrated policy was calibrated on {calib_len}-token windows and is compared on "
        f"{compare_len}-token ones. Errors grow with length: the sink and diagonal tiles stay in the high format "
        "while the low-format tiles cover more of each row, so a layer within the budget at one length can exceed "
        f"it at a longer one (calibrate with --window-len {compare_len} to compare like with like)"
    )


def plot_layer_errors(result: Comparison, calibrated: ModelPolicy | None, path: str | os.PathLike) -> Path:
    """PNG of each DMA policy's per-layer relative L2 error (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in result.policies if n != "sdpa"]
    layers = [row["layer"] for row in result.layers]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name in names:
        ax.plot(layers, [row[name]["rel_l2"] for row in result.layers], marker="o", markersize=3, label=name)
    stats = (calibrated.stats or {}) if calibrated is not None else {}
    if stats.get("budget"):
        label = f"budget {stats['budget']}"
        if stats.get("window_len"):
            label += f" (calibrated at {stats['window_len']} tokens)"
        ax.axhline(stats["budget"], color="black", linestyle="--", linewidth=1, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("relative L2 error of attention output")
    ax.set_title(f"Per-layer attention error, held-out window of {result.settings['window_len']} tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
