"""Reporting of calibration: a policy's short name and the per-layer policy table."""

from __future__ import annotations

from dma_compile.policy import AttentionPolicy, ModelPolicy


def describe(policy: AttentionPolicy) -> str:
    """Short human form: hi/lo, diag, sink, pv, and the rotation and balancing if any."""
    short = {"none": "bf16", "mxfp8_e4m3": "mxfp8", "mxfp8_e5m2": "mxfp8e5", "mxfp4_e2m1": "mxfp4"}
    rotation = "" if policy.rotate == "none" else f", {policy.rotate.replace('_', ' ')}"
    if policy.balance_qk:
        rotation += ", balanced"
    if policy.hi == policy.lo:
        return f"{short[policy.hi]} all, pv {policy.pv}{rotation}"
    return f"{short[policy.hi]}/{short[policy.lo]} d{policy.diag_tiles} s{policy.sink_tiles}, pv {policy.pv}{rotation}"


def policy_table(policy: ModelPolicy) -> str:
    """A tabulate table of a calibrated policy: one row per layer."""
    from tabulate import tabulate

    stats = policy.stats or {}
    layer_stats = stats.get("layers", {})
    rows = []
    for layer in sorted(layer_stats, key=int):
        s = layer_stats[layer]
        pol = AttentionPolicy.from_string(s["policy"])
        rows.append(
            [
                int(layer),
                describe(pol),
                f"{s['rel_l2']:.4f}",
                f"{s['worst_row']:.3f}",
                f"{s['presets']['paper']['rel_l2']:.4f}",
                f"{s['cost']:.3f}",
                f"{100 * s['mxfp4_fraction']:.0f}%",
                "yes" if s["within_budget"] else "NO",
                len(s["evaluated"]),
            ]
        )
    headers = ["layer", "policy", "rel L2", "worst row", "paper rel L2", "cost", "mxfp4 tiles", "in budget", "scored"]
    table = tabulate(rows, headers=headers, tablefmt="github")
    if stats:
        table += (
            f"\n\ntarget {stats['target']}, budget {stats['budget']} ({stats['budget_unit']}); "
            f"{stats['windows']} x {stats['window_len']} calibration tokens; "
            f"model cost {stats['cost']:.3f} ({stats['cost_unit']}), "
            f"MXFP4 tiles {100 * stats['mxfp4_fraction']:.1f}%"
        )
        if stats.get("allocation") in ("model", "weighted"):
            table += (f"; {stats['allocation']} allocation: root mean square of the layers' "
                      f"{'sensitivity-weighted ' if stats['allocation'] == 'weighted' else ''}errors "
                      f"{stats['model_error']:.4f}")
    return table
