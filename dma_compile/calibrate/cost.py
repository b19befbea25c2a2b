"""The candidates calibration chooses from, and what each costs.

Cost: the attention time of a causal sequence of `cost_len` tokens relative to
SDPA in bf16, from the number of non-masked score tiles in each format times
the target GPU's relative rate per tile (`RATES`), for QK^T and for P·V. With
`measure=True` on a GPU the rates are measured through the kernels instead
(`measure_rates`).
"""

from __future__ import annotations

import functools
import itertools

import torch

from dma_compile.policy import PRESETS, PV_MODES, AttentionPolicy, ModelPolicy
from dma_compile.reference import key_tile_is_high
from dma_compile.rotation import is_power_of_two

TARGETS = ("sm90", "sm100")

# Relative time per 128x128 score tile (bf16 QK^T on the target = its own
# scale). sm100: MXFP8 runs at twice bf16's rate and MXFP4 at four times.
# sm90: fp8 tensor cores at twice bf16's rate; MXFP4 is no faster than fp8
# there, and "exact" MX numerics dequantize to bf16 (`mx_mode` below).
RATES = {
    "sm100": {
        "qk": {"none": 2.0, "mxfp8_e4m3": 1.0, "mxfp8_e5m2": 1.0, "mxfp4_e2m1": 0.5},
        "pv": {"input": 2.0, "fp8": 1.0},
    },
    "sm90": {
        "qk": {"none": 1.0, "mxfp8_e4m3": 0.5, "mxfp8_e5m2": 0.5, "mxfp4_e2m1": 0.5},
        "pv": {"input": 1.0, "fp8": 0.5},
    },
}

HI_FORMATS = ("none", "mxfp8_e4m3")
LO_FORMATS = ("mxfp8_e4m3", "mxfp4_e2m1")
DIAG_TILES = (1, 2, 4, 8)
SINK_TILES = (0, 1, 2)
# Rotation spreads outlier channels over MX blocks; it pays where the low
# format is MXFP4 (BENCHMARKS.md, rotation), so only those candidates get a
# rotated twin. Its cost (a step of the quantization pass) is not a tile cost.
# Twins that also balance Q and K calibrated to a worse model at the same
# budget (BENCHMARKS.md, 2026-12-06): the layers' errors fell, the budget went
# to cheaper tiles, and perplexity rose.
ROTATED_LOW_FORMATS = ("mxfp4_e2m1",)
ROTATION = "signed_hadamard"
TWIN = {"rotate": ROTATION}
DEFAULT_COST_LEN = 2048


def resolve_target(target: str = "auto") -> str:
    """"sm90" or "sm100"; "auto" picks the present GPU's (sm100 without one,
    matching the paper default used on CPU)."""
    if target in TARGETS:
        return target
    if target != "auto":
        raise ValueError(f"target must be one of {['auto', *TARGETS]}, got {target!r}")
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9:
        return "sm90"
    return "sm100"


def base_policy(target: str) -> AttentionPolicy:
    """The policy candidates vary from: Hopper's (folded MX on fp8 tensor
    cores) for sm90, the paper's (exact MX) for sm100."""
    return AttentionPolicy.hopper() if resolve_target(target) == "sm90" else AttentionPolicy.paper()


def candidate_policies(target: str = "auto", head_dim: int | None = None) -> list[AttentionPolicy]:
    """Every distinct candidate: hi in HI_FORMATS, lo in LO_FORMATS, diag in
    DIAG_TILES, sink in SINK_TILES, pv in PV_MODES (a policy whose hi and lo
    are one format has no use for diag and sink and appears once); with a
    power-of-two `head_dim`, each candidate whose lo is in ROTATED_LOW_FORMATS
    also with TWIN (rotated by ROTATION)."""
    base = base_policy(target)
    twins = ({}, TWIN) if head_dim is not None and is_power_of_two(head_dim) else ({},)
    seen: dict[str, AttentionPolicy] = {}
    for hi, lo, diag, sink, pv in itertools.product(HI_FORMATS, LO_FORMATS, DIAG_TILES, SINK_TILES, PV_MODES):
        if hi == lo:
            diag, sink = 1, 0
        for twin in twins if lo in ROTATED_LOW_FORMATS else ({},):
            policy = base.replace(hi=hi, lo=lo, diag_tiles=diag, sink_tiles=sink, pv=pv, **twin)
            seen.setdefault(policy.to_string(), policy)
    return list(seen.values())


def exact_policy(target: str = "auto") -> AttentionPolicy:
    """The last resort when no candidate meets the budget: the input dtype everywhere."""
    return base_policy(target).replace(**PRESETS["exact"])


@functools.lru_cache(maxsize=4096)
def _tile_counts(tile: int, diag_tiles: int, sink_tiles: int, seq_len: int) -> tuple[int, int]:
    """(high, all) non-masked score tiles of a causal `seq_len` sequence."""
    policy = AttentionPolicy(tile=tile, diag_tiles=diag_tiles, sink_tiles=sink_tiles)
    high = key_tile_is_high(seq_len, seq_len, policy, is_causal=True)
    visible = torch.ones_like(high).tril()
    return int((high & visible).sum()), int(visible.sum())


def tile_formats(policy: AttentionPolicy, seq_len: int) -> dict[str, int]:
    """Number of non-masked score tiles of a causal `seq_len` sequence per QK^T format."""
    n_high, n_all = _tile_counts(policy.tile, policy.diag_tiles, policy.sink_tiles, seq_len)
    counts = {policy.hi: n_high}
    counts[policy.lo] = counts.get(policy.lo, 0) + n_all - n_high
    return counts


def format_fraction(policy: AttentionPolicy, seq_len: int, fmt: str = "mxfp4_e2m1") -> float:
    """The share of a causal `seq_len` sequence's non-masked score tiles that run in `fmt`."""
    counts = tile_formats(policy, seq_len)
    return counts.get(fmt, 0) / sum(counts.values())


def policy_cost(policy: AttentionPolicy, target: str, seq_len: int = DEFAULT_COST_LEN, rates: dict | None = None) -> float:
    """Attention time relative to bf16 SDPA under the target's rates."""
    target = resolve_target(target)
    rates = rates or RATES[target]
    counts = tile_formats(policy, seq_len)
    n_tiles = sum(counts.values())

    def qk_rate(fmt: str) -> float:
        if target == "sm90" and fmt != "none" and policy.mx_mode == "exact":
            return rates["qk"]["none"]
        return rates["qk"][fmt]

    time = sum(qk_rate(fmt) * n for fmt, n in counts.items()) + rates["pv"][policy.pv] * n_tiles
    return time / ((rates["qk"]["none"] + rates["pv"]["input"]) * n_tiles)


def model_cost(policy: ModelPolicy, num_layers: int, target: str, seq_len: int = DEFAULT_COST_LEN) -> float:
    """Mean per-layer cost (the layers of the models here have one shape)."""
    return sum(policy_cost(policy.for_layer(i), target, seq_len) for i in range(num_layers)) / num_layers


def model_format_fraction(
    policy: ModelPolicy, num_layers: int, seq_len: int = DEFAULT_COST_LEN, fmt: str = "mxfp4_e2m1"
) -> float:
    """`format_fraction` averaged over the layers."""
    return sum(format_fraction(policy.for_layer(i), seq_len, fmt) for i in range(num_layers)) / num_layers


def measure_rates(heads: int, kv_heads: int, head_dim: int, seq_len: int, base: AttentionPolicy) -> dict:
    """Per-tile rates measured through the kernels on the present GPU: one
    single-format policy per QK^T format and P·V mode, timed causal."""
    from dma_compile.ops import dma_attention
    from dma_compile.timing import cuda_time_ms

    dev = torch.device("cuda")
    q = torch.randn(1, heads, seq_len, head_dim, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, kv_heads, seq_len, head_dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)

    def timed(policy: AttentionPolicy) -> float:
        return cuda_time_ms(lambda: dma_attention(q, k, v, is_causal=True, policy=policy))

    # Time per tile = QK rate + P·V rate. Uniform-format runs give their sums;
    # QK^T and P·V have equal FLOPs, so the bf16/bf16 run is split in halves.
    none_time = timed(base.replace(hi="none", lo="none", pv="input"))
    qk = {"none": none_time / 2}
    for fmt in ("mxfp8_e4m3", "mxfp4_e2m1"):
        qk[fmt] = timed(base.replace(hi=fmt, lo=fmt, pv="input")) - none_time / 2
    qk["mxfp8_e5m2"] = qk["mxfp8_e4m3"]
    pv_fp8 = timed(base.replace(hi="none", lo="none", pv="fp8")) - none_time / 2
    unit = qk["none"]
    return {"qk": {f: max(t, 1e-6) / unit for f, t in qk.items()}, "pv": {"input": 1.0, "fp8": max(pv_fp8, 1e-6) / unit}}
