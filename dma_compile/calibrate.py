"""Calibration: choose each attention layer's DMA policy from its own Q, K, V.

The model runs (stock SDPA) on calibration windows of a text while
`dma_compile.capture` records every layer's Q, K, V. For each layer, candidate
policies (high format, low format, diagonal and sink tiles, P·V precision) are
scored by the error of that layer's attention output under the policy (the
reference semantics, causal) against exact attention, and the cheapest
candidate within the budget is kept.

Budget unit: the relative L2 error of a layer's attention output,
||O_dma - O_exact||_2 / ||O_exact||_2 over all heads, rows and channels of the
calibration windows (0.02 = 2 %). The worst row's relative error is recorded
beside it.

Cost: the attention time of a causal sequence of `cost_len` tokens relative to
SDPA in bf16, from the number of non-masked score tiles in each format times
the target GPU's relative rate per tile (`RATES`), for QK^T and for P·V. With
`measure=True` on a GPU the rates are measured through the kernels instead.

Candidates are scored in order of increasing cost and the search stops at the
first cost level holding a candidate within the budget, so the choice is the
cheapest (ties: the lowest error) and a tighter budget never picks a cheaper
policy. Each window's score matrices are computed once per format and
combined per candidate; `LayerScorer` is tested to give exactly the
reference's output.

That is the per-layer allocation (`allocation="layer"`). The model-level
ones ("model", "weighted") score every candidate in full and spend one budget
on the root mean square of the layers' errors (`allocate_model`), so layers
that quantize well take more low-precision tiles than sensitive ones;
"weighted" first weights each layer's squared error by its measured effect
on the logits (`layer_sensitivity`).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F

from dma_compile.policy import AttentionPolicy, ModelPolicy
from dma_compile.reference import P_FP8_SCALE, fp8_value_scale, key_mean, key_tile_is_high, quantize_operand

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
PV_MODES = ("input", "fp8")

# Calibration windows come from the first part of a text, evaluation windows
# from this last fraction of its tokens, so the two never overlap.
HELDOUT_FRACTION = 0.1
DEFAULT_COST_LEN = 2048
# (windows, tokens per window): the reference on a CPU is slow, a GPU is not.
CPU_WINDOWS = (2, 512)
GPU_WINDOWS = (4, 2048)
# "layer": each layer within the budget on its own; "model": the root mean
# square of the layers' errors within it (`allocate_model`); "weighted": the
# same with each layer's squared error weighted by its `layer_sensitivity`.
ALLOCATIONS = ("layer", "model", "weighted")
ERROR_UNIT = "relative L2 error of the layer's attention output vs exact attention"


# ---------------------------------------------------------------- targets and costs


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


def model_format_fraction(policy: ModelPolicy, num_layers: int, seq_len: int = DEFAULT_COST_LEN, fmt: str = "mxfp4_e2m1") -> float:
    return sum(format_fraction(policy.for_layer(i), seq_len, fmt) for i in range(num_layers)) / num_layers


def measure_rates(heads: int, kv_heads: int, head_dim: int, seq_len: int, base: AttentionPolicy) -> dict:
    """Per-tile rates measured through the kernels on the present GPU: one
    single-format policy per QK^T format and P·V mode, timed causal."""
    from dma_compile.ops import dma_attention

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


def _syncs_with_host(fn) -> bool:
    """Whether fn() synchronizes the host with the GPU (an `.item()`, a copy to
    the CPU), which a CUDA graph cannot capture. Found by running it under
    PyTorch's sync debug mode rather than by a failed capture: a failed
    capture leaves the device's random generator in capture mode, and every
    later random op in the process then fails."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return False


def cuda_time_ms(fn, repeats: int = 20, graph: bool = True) -> float:
    """Median CUDA time of `fn()` in milliseconds, after three warm-up calls.

    graph: time replays of `fn` captured in a CUDA graph, i.e. the GPU's time
    alone. A small attention call spends longer in the host's launches (about
    0.35 ms for the sm90 path's four or five) than on the GPU, so direct timing would
    rank policies by their launch counts. A `fn` that synchronizes with the
    host cannot be captured and is timed directly; graph=False times direct
    calls, host work included.
    """
    # Warm-up (compiles, autotunes, allocates) off the default stream where a capture follows, as capture needs.
    warm_stream = torch.cuda.Stream() if graph else torch.cuda.current_stream()
    warm_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm_stream):
        for _ in range(2):
            fn()
        # The third warm-up call, checked for host synchronization where a capture would follow.
        capture = graph and not _syncs_with_host(fn)
        if not graph:
            fn()
    torch.cuda.current_stream().wait_stream(warm_stream)
    torch.cuda.synchronize()
    run = fn
    if capture:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        run = captured.replay
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


# ---------------------------------------------------------------- candidates


def candidate_policies(target: str = "auto") -> list[AttentionPolicy]:
    """Every distinct candidate: hi in HI_FORMATS, lo in LO_FORMATS, diag in
    DIAG_TILES, sink in SINK_TILES, pv in PV_MODES (a policy whose hi and lo
    are one format has no use for diag and sink and appears once)."""
    base = base_policy(target)
    seen: dict[str, AttentionPolicy] = {}
    for hi, lo, diag, sink, pv in itertools.product(HI_FORMATS, LO_FORMATS, DIAG_TILES, SINK_TILES, PV_MODES):
        if hi == lo:
            diag, sink = 1, 0
        policy = base.replace(hi=hi, lo=lo, diag_tiles=diag, sink_tiles=sink, pv=pv)
        seen.setdefault(policy.to_string(), policy)
    return list(seen.values())


def exact_policy(target: str = "auto") -> AttentionPolicy:
    """The last resort when no candidate meets the budget: the input dtype everywhere."""
    return base_policy(target).replace(hi="none", lo="none", pv="input", smooth_k=False)


def describe(policy: AttentionPolicy) -> str:
    """Short human form: hi/lo, diag, sink, pv."""
    short = {"none": "bf16", "mxfp8_e4m3": "mxfp8", "mxfp8_e5m2": "mxfp8e5", "mxfp4_e2m1": "mxfp4"}
    if policy.hi == policy.lo:
        return f"{short[policy.hi]} all, pv {policy.pv}"
    return f"{short[policy.hi]}/{short[policy.lo]} d{policy.diag_tiles} s{policy.sink_tiles}, pv {policy.pv}"


# ---------------------------------------------------------------- scoring


class LayerScorer:
    """Errors of one layer's DMA output against exact attention, over the
    captured windows. The score matrix of each QK^T format is computed once
    per window and reused by every candidate."""

    def __init__(self, windows: Sequence[tuple]):
        if not windows:
            raise ValueError("LayerScorer needs at least one captured window")
        self.windows = [(q, k, v, scale) for q, k, v, scale in windows]
        self._exact = [self._exact_output(*w) for w in self.windows]
        self._ref_sq = max(sum(float(e.square().sum()) for e in self._exact), 1e-30)
        self._scores: dict[tuple, torch.Tensor] = {}
        self._value_cache: dict[tuple, tuple] = {}
        self._masks: dict[tuple, torch.Tensor] = {}
        self._errors: dict[str, dict] = {}

    @staticmethod
    def _exact_output(q, k, v, scale):
        out = F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        return out.to(q.dtype).float()

    def _format_scores(self, index: int, fmt: str, policy: AttentionPolicy) -> torch.Tensor:
        key = (index, fmt, policy.scale_rule, policy.mx_mode, policy.smooth_k)
        if key not in self._scores:
            q, k, _, scale = self.windows[index]
            scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
            kc = k.float()
            if policy.smooth_k:
                kc = kc - key_mean(k)
            qf = quantize_operand(q.float(), fmt, policy, q.dtype)
            kf = quantize_operand(kc, fmt, policy, k.dtype).repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
            # Masked once here rather than per candidate (the reference selects -inf there: the same values).
            lq, lk = scores.shape[-2:]
            future = torch.ones(lq, lk, dtype=torch.bool, device=scores.device).triu(1)
            self._scores[key] = scores.masked_fill_(future, float("-inf"))
        return self._scores[key]

    def _values(self, index: int, pv: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """V as P·V consumes it, expanded to the query heads, and its fp8 scale."""
        key = (index, pv)
        if key not in self._value_cache:
            q, _, v, _ = self.windows[index]
            group = q.shape[1] // v.shape[1]
            if pv == "fp8":
                v_scale = fp8_value_scale(v)
                v8 = (v.float() / v_scale).to(torch.float8_e4m3fn).float()
                self._value_cache[key] = (v8.repeat_interleave(group, dim=1), v_scale.repeat_interleave(group, dim=1))
            else:
                self._value_cache[key] = (v.float().repeat_interleave(group, dim=1), None)
        return self._value_cache[key]

    def _high_mask(self, lq: int, lk: int, policy: AttentionPolicy, device) -> torch.Tensor:
        """Bool (lq, lk): True where a score runs in the high format."""
        key = (lq, lk, policy.tile, policy.diag_tiles, policy.sink_tiles)
        if key not in self._masks:
            high = key_tile_is_high(lq, lk, policy, is_causal=True).to(device)
            self._masks[key] = high.repeat_interleave(policy.tile, 0)[:lq].repeat_interleave(policy.tile, 1)[:, :lk]
        return self._masks[key]

    def _row_tiles(self, index: int, policy: AttentionPolicy):
        """Yield (r0, r1, output rows r0..r1-1) of the policy's causal attention
        for window `index`, one query tile at a time over the keys it can see:
        the reference's math (masked keys contribute exact zeros, so at most
        the summation order differs)."""
        q, _, v, _ = self.windows[index]
        lq, lk = q.shape[-2], v.shape[-2]
        s_hi = self._format_scores(index, policy.hi, policy)
        s_lo = None
        if policy.lo != policy.hi:
            s_lo = self._format_scores(index, policy.lo, policy)
            high = self._high_mask(lq, lk, policy, q.device)
        values, v_scale = self._values(index, policy.pv)
        for r0 in range(0, lq, policy.tile):
            r1 = min(r0 + policy.tile, lq)
            # Causal, top-left: rows r0..r1-1 see keys 0..r1-1 at most.
            seen = min(r1, lk)
            scores = s_hi[..., r0:r1, :seen]
            if s_lo is None:
                scores = scores.clone()
            else:
                scores = torch.where(high[r0:r1, :seen], scores, s_lo[..., r0:r1, :seen])
            # P over all lk keys (zeros past `seen`), as the reference sums it:
            # a shorter sum may round its last bit differently.
            p = scores.new_zeros(*scores.shape[:-1], lk)
            p[..., :seen] = scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()
            row_sum = p.sum(dim=-1, keepdim=True)
            if policy.pv == "fp8":
                # e4m3 rounding of P*256 <= 256 is in range, where the cast is exact RNE.
                p8 = (p * P_FP8_SCALE).to(torch.float8_e4m3fn).float()
                tile_out = torch.matmul(p8, values) * (v_scale / P_FP8_SCALE)
            else:
                tile_out = torch.matmul(p.to(v.dtype).float(), values)
            yield r0, r1, (tile_out / row_sum).to(q.dtype)

    def output(self, index: int, policy: AttentionPolicy) -> torch.Tensor:
        """The policy's causal attention output for window `index` (the reference's)."""
        return torch.cat([rows for _, _, rows in self._row_tiles(index, policy)], dim=-2)

    def errors(self, policy: AttentionPolicy, give_up_above: float | None = None) -> dict:
        """{"rel_l2", "worst_row", "complete"} of the policy over all windows.

        With `give_up_above`, scoring stops as soon as the error is known to
        exceed it (the squared error only grows row by row, against the
        squared norm of all exact outputs); "rel_l2" is then a lower bound and
        "complete" False. Results are memoized; a lower bound is recomputed
        only when it no longer settles the question asked.
        """
        key = policy.to_string()
        known = self._errors.get(key)
        if known is not None and (known["complete"] or (give_up_above is not None and known["rel_l2"] > give_up_above)):
            return known
        limit_sq = math.inf if give_up_above is None else (give_up_above**2) * self._ref_sq
        err_sq = worst = 0.0
        complete = True
        for index, exact in enumerate(self._exact):
            for r0, r1, rows in self._row_tiles(index, policy):
                ref = exact[..., r0:r1, :]
                diff = rows.float() - ref
                row_err = diff.norm(dim=-1)
                err_sq += float(row_err.square().sum())
                row_ref = ref.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
                worst = max(worst, float((row_err / row_ref).max()))
                if err_sq > limit_sq:
                    complete = False
                    break
            if not complete:
                break
        self._errors[key] = {"rel_l2": math.sqrt(err_sq / self._ref_sq), "worst_row": worst, "complete": complete}
        return self._errors[key]

    def release(self) -> None:
        self._scores.clear()
        self._value_cache.clear()
        self._masks.clear()


@dataclass
class LayerChoice:
    policy: AttentionPolicy
    cost: float
    rel_l2: float
    worst_row: float
    within_budget: bool
    evaluated: list[dict]


def choose_policy(
    scorer: LayerScorer, budget: float, target: str, cost_len: int = DEFAULT_COST_LEN, rates: dict | None = None
) -> LayerChoice:
    """The cheapest candidate whose relative L2 error is within `budget`
    (ties: the lowest error), the exact policy if none is."""
    priced = [(policy_cost(p, target, cost_len, rates), p) for p in candidate_policies(target)]
    priced.sort(key=lambda cp: cp[0])
    fallback = exact_policy(target)
    priced.append((policy_cost(fallback, target, cost_len, rates), fallback))
    evaluated: list[dict] = []
    for cost, group in itertools.groupby(priced, key=lambda cp: round(cp[0], 9)):
        scored = []
        for _, policy in group:
            err = scorer.errors(policy, give_up_above=budget)
            scored.append((err["rel_l2"], policy, err))
            evaluated.append({"policy": policy.to_string(), "cost": cost, **err})
        within = [s for s in scored if s[2]["complete"] and s[0] <= budget]
        if within:
            rel, policy, err = min(within, key=lambda s: s[0])
            return LayerChoice(policy, cost, rel, err["worst_row"], True, evaluated)
    # Nothing met the budget, not even the exact policy (the last group): keep it, scored in full.
    err = scorer.errors(fallback)
    return LayerChoice(fallback, cost, err["rel_l2"], err["worst_row"], False, evaluated)


# ---------------------------------------------------------------- model-level allocation


def score_candidates(
    scorer: LayerScorer, target: str, cost_len: int = DEFAULT_COST_LEN, rates: dict | None = None
) -> list[dict]:
    """Every candidate and the exact policy, each scored in full, cheapest
    first. The model-level allocation trades error between layers, so unlike
    `choose_policy` it needs every layer's whole (cost, error) table."""
    policies = [*candidate_policies(target), exact_policy(target)]
    scored = [{"policy": p.to_string(), "cost": policy_cost(p, target, cost_len, rates), **scorer.errors(p)}
              for p in policies]
    return sorted(scored, key=lambda e: (e["cost"], e["rel_l2"]))


def pareto_front(evaluated: Sequence[dict]) -> list[dict]:
    """The entries no other entry beats on both cost and error, cheapest
    first (so errors strictly decrease along it): a layer's only sensible
    choices."""
    front: list[dict] = []
    for entry in sorted(evaluated, key=lambda e: (e["cost"], e["rel_l2"])):
        if not front or entry["rel_l2"] < front[-1]["rel_l2"]:
            front.append(entry)
    return front


def model_error(chosen: Sequence[dict], weights: Sequence[float] | None = None) -> float:
    """The root mean square of the layers' relative L2 errors, each squared
    error times its layer's weight (`layer_sensitivity`; default 1): the
    model-level error measure. Squares, because independent perturbations of
    the residual stream add in power and the KL divergence of the logits is
    quadratic in a small perturbation, so one layer at error 2e hurts about as
    much as four at e. With weights of mean 1, a per-layer budget b keeps it
    <= b, so the per-layer choice is always feasible for the model-level
    allocation at the same budget."""
    return math.sqrt(_penalty(chosen, weights) / len(chosen))


def _penalty(chosen: Sequence[dict], weights: Sequence[float] | None) -> float:
    weights = weights or [1.0] * len(chosen)
    return sum(w * e["rel_l2"] ** 2 for w, e in zip(weights, chosen))


def _meets(chosen: Sequence[dict], budget: float, weights: Sequence[float] | None) -> bool:
    """model_error(chosen, weights) <= budget, in the squared form `_fill_slack` counts slack in."""
    return _penalty(chosen, weights) <= budget**2 * len(chosen)


def _cheapest_within(front: Sequence[dict], budget: float) -> dict:
    """The per-layer choice on one front; its most accurate entry if none is within `budget`."""
    return next((e for e in front if e["rel_l2"] <= budget), front[-1])


def _lagrangian_choice(fronts: Sequence[Sequence[dict]], weights: Sequence[float], price: float) -> list[dict]:
    """Per layer, the entry minimising cost + price * weight * squared error (ties: the lower error)."""
    return [
        min(front, key=lambda e: (e["cost"] + price * w * e["rel_l2"] ** 2, e["rel_l2"]))
        for front, w in zip(fronts, weights)
    ]


def _fill_slack(
    fronts: Sequence[Sequence[dict]], chosen: list[dict], budget: float, weights: Sequence[float]
) -> list[dict]:
    """Spend the error the Lagrangian choice leaves unused: repeatedly move
    one layer to a cheaper entry of its front, taking the largest cost saving
    per unit of weighted squared error added among the moves that keep
    `model_error <= budget`. (Equal slopes reach only the convex hull of the
    fronts; the best discrete choice may sit between its points.)"""
    chosen = list(chosen)
    allowed = budget**2 * len(chosen)
    while True:
        slack = allowed - _penalty(chosen, weights)
        moves = []
        for layer, (front, now, w) in enumerate(zip(fronts, chosen, weights)):
            for e in front:
                added = w * (e["rel_l2"] ** 2 - now["rel_l2"] ** 2)
                if e["cost"] < now["cost"] and added <= slack:
                    moves.append(((now["cost"] - e["cost"]) / max(added, 1e-30), layer, e))
        if not moves:
            return chosen
        _, layer, entry = max(moves, key=lambda m: m[0])
        chosen[layer] = entry


def allocate_model(
    fronts: Sequence[Sequence[dict]], budget: float, weights: Sequence[float] | None = None
) -> tuple[list[dict], float]:
    """One entry per layer (from each layer's `pareto_front`) minimising the
    total cost subject to `model_error(chosen, weights) <= budget`; returns
    (chosen, price).

    Equal-slope (Lagrangian) selection: each layer takes the entry minimising
    cost + price * weight * error^2, and the price is bisected (log scale) to
    the lowest one meeting the budget; the unused error is then spent by
    `_fill_slack`. The per-layer choice at the same budget, when feasible, is
    filled the same way and kept if cheaper, so this is never dearer than
    it. If even the most accurate entries miss the budget they are returned
    (price inf).
    """
    weights = list(weights) if weights is not None else [1.0] * len(fronts)
    if len(weights) != len(fronts) or not all(w >= 0 and math.isfinite(w) for w in weights):
        raise ValueError(f"weights: expected {len(fronts)} finite non-negative numbers, got {weights!r}")
    most_accurate = [front[-1] for front in fronts]
    if not _meets(most_accurate, budget, weights):
        return most_accurate, math.inf
    lo, hi = -12.0, 12.0  # log10 of the price: costs are O(1), squared errors O(1e-6) and up
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        if _meets(_lagrangian_choice(fronts, weights, 10**mid), budget, weights):
            hi = mid
        else:
            lo = mid
    price = 10**hi
    start = _lagrangian_choice(fronts, weights, price)
    chosen = _fill_slack(fronts, start if _meets(start, budget, weights) else most_accurate, budget, weights)
    per_layer = [_cheapest_within(front, budget) for front in fronts]
    if _meets(per_layer, budget, weights):
        per_layer = _fill_slack(fronts, per_layer, budget, weights)
        if sum(e["cost"] for e in per_layer) < sum(e["cost"] for e in chosen):
            chosen = per_layer
    return chosen, price


def layer_sensitivity(model, window: torch.Tensor, probe: AttentionPolicy, probe_errors: Sequence[float]) -> list[dict]:
    """Per layer, {"kl", "weight"}: the mean KL divergence of the next-token
    distribution on `window` from SDPA's when only that layer runs `probe`,
    and that KL per unit of the layer's squared probe error (`probe_errors`,
    its relative L2 error), scaled to mean 1 over the layers.

    The relative L2 error of a layer's output says how far it moves, not how
    much the model minds: on SmolLM2-135M the same error costs the first
    layers about 30 times as much KL as the last ones. One forward pass per
    layer buys that correction for the "weighted" allocation.
    """
    from dma_compile.hf import running_policy

    ids = window[None].to(next(model.parameters()).device)
    # min_q_len above the window's length: every other layer runs stock SDPA.
    sdpa_elsewhere = probe.replace(min_q_len=ids.shape[1] + 1)
    with torch.no_grad():
        reference = torch.log_softmax(model(ids, use_cache=False).logits[0].float(), dim=-1)
        kls = []
        for layer, error in enumerate(probe_errors):
            policy = ModelPolicy(sdpa_elsewhere, layers={layer: probe}, num_layers=len(probe_errors))
            with running_policy(model, policy):
                logp = torch.log_softmax(model(ids, use_cache=False).logits[0].float(), dim=-1)
            kls.append(float((reference.exp() * (reference - logp)).sum(dim=-1).mean()))
    per_error = [kl / max(error, 1e-12) ** 2 for kl, error in zip(kls, probe_errors)]
    mean = sum(per_error) / len(per_error)
    return [{"kl": kl, "weight": w / mean if mean > 0 else 1.0} for kl, w in zip(kls, per_error)]


# ---------------------------------------------------------------- text and windows


def read_text(path: str | os.PathLike) -> str:
    """A text file's content, with one-line errors for missing, unreadable or empty files."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(f"text file {path!r} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"text file {path!r} is a directory") from None
    except UnicodeDecodeError:
        raise ValueError(f"text file {path!r} is not UTF-8 text") from None
    except OSError as e:
        raise ValueError(f"text file {path!r} cannot be read: {e.strerror}") from None
    if not text.strip():
        raise ValueError(f"text file {path!r} is empty")
    return text


def split_heldout(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(calibration part, held-out part) of a 1-D token sequence."""
    n = ids.numel()
    if n < 4:
        raise ValueError(f"text: needs at least 4 tokens to split off a held-out part, got {n}")
    heldout = max(2, round(n * HELDOUT_FRACTION))
    return ids[: n - heldout], ids[n - heldout :]


def take_windows(ids: torch.Tensor, count: int, length: int, spread: bool) -> torch.Tensor:
    """Up to `count` non-overlapping windows of `length` tokens, (N, L): spread
    evenly over `ids`, or consecutive from its start. A part shorter than one
    window gives one window of the whole part."""
    if count < 1 or length < 2:
        raise ValueError(f"windows must be >= 1 and window length >= 2, got {count} and {length}")
    length = min(length, ids.numel())
    count = max(1, min(count, ids.numel() // length))
    if spread and count > 1:
        starts = torch.linspace(0, ids.numel() - length, count).round().long().tolist()
    else:
        starts = [i * length for i in range(count)]
    return torch.stack([ids[s : s + length] for s in starts])


def tokenize(tokenizer, text: str) -> torch.Tensor:
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    if ids.numel() == 0:
        raise ValueError("text: tokenizes to no tokens")
    return ids


def default_windows(device: torch.device) -> tuple[int, int]:
    return GPU_WINDOWS if device.type == "cuda" else CPU_WINDOWS


def calibration_windows(tokenizer, texts, windows: int, window_len: int) -> torch.Tensor:
    """Token windows (N, L) to calibrate on.

    texts: one string (windows spread over its calibration part, i.e. all but
    the held-out last HELDOUT_FRACTION), a sequence of strings (one window
    each, truncated to `window_len`, at most `windows`), or a LongTensor of
    token ids (N, L) used as is.
    """
    if isinstance(texts, torch.Tensor):
        if texts.dim() != 2 or texts.dtype != torch.long or texts.shape[1] < 2:
            raise ValueError(f"texts: a token tensor must be (N, L>=2) int64, got {tuple(texts.shape)} {texts.dtype}")
        return texts
    if isinstance(texts, str):
        if not texts.strip():
            raise ValueError("texts: the calibration text is empty")
        calib, _ = split_heldout(tokenize(tokenizer, texts))
        return take_windows(calib, windows, window_len, spread=True)
    texts = list(texts)
    if not texts or not all(isinstance(t, str) and t.strip() for t in texts):
        raise ValueError("texts: expected a string, a non-empty list of non-empty strings, or a token tensor")
    rows = [tokenize(tokenizer, t)[:window_len] for t in texts[:windows]]
    shortest = min(r.numel() for r in rows)
    if shortest < 2:
        raise ValueError("texts: every calibration string needs at least 2 tokens")
    return torch.stack([r[:shortest] for r in rows])


# ---------------------------------------------------------------- models


def load_model(model, dtype: torch.dtype | None = None, device: str | torch.device | None = None):
    """(model, tokenizer) from a model directory, or (model, None) for a
    model object. Loads in bf16, on the GPU when there is one."""
    if not isinstance(model, (str, os.PathLike)):
        return model, None
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = os.fspath(model)
    if not os.path.isdir(path):
        raise ValueError(f"model directory {path!r} does not exist")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model directory {path!r} has no config.json (not a transformers checkpoint)")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.bfloat16, attn_implementation="sdpa")
    except Exception as e:  # transformers raises many kinds for an unreadable checkpoint
        raise ValueError(f"model directory {path!r} cannot be loaded: {str(e).splitlines()[0]}") from None
    return loaded.to(device).eval(), tokenizer


def _model_tokenizer(model, tokenizer):
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    name = getattr(model, "name_or_path", None) or getattr(model.config, "_name_or_path", "")
    if not name or not os.path.isdir(name):
        raise ValueError("tokenizer: pass tokenizer= (the model object does not name a local checkpoint)")
    return AutoTokenizer.from_pretrained(name)


# ---------------------------------------------------------------- calibration


def calibrate(
    model,
    texts,
    budget: float,
    target: str = "auto",
    *,
    tokenizer=None,
    windows: int | None = None,
    window_len: int | None = None,
    cost_len: int = DEFAULT_COST_LEN,
    measure: bool = False,
    allocation: str = "layer",
    progress: bool = True,
) -> ModelPolicy:
    """Per-layer DMA policies for `model` (a transformers causal LM or its
    directory), the cheapest for `target` ("sm90", "sm100", or "auto" for the
    present GPU) within `budget`: with `allocation="layer"` the relative L2
    error allowed for each layer's attention output (e.g. 0.02); with
    "model" the allowed root mean square of those errors over the layers, so
    layers that quantize well take more low-precision tiles and sensitive
    ones fewer (`allocate_model`; slower: every candidate is scored in
    full); with "weighted" each squared error is first weighted by its
    layer's measured `layer_sensitivity` (one more forward pass per layer).
    `texts`: see `calibration_windows`.
    `windows` x `window_len` default to 2 x 512 on CPU and 4 x 2048 on a GPU.
    The statistics behind every choice are in the result's `stats`.
    """
    from tqdm.auto import tqdm

    from dma_compile.capture import capture_windows, num_attention_layers

    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0 or math.isinf(budget):
        raise ValueError(f"budget must be a positive number (relative L2 error, e.g. 0.02), got {budget!r}")
    if allocation not in ALLOCATIONS:
        raise ValueError(f"allocation must be one of {list(ALLOCATIONS)}, got {allocation!r}")
    target = resolve_target(target)
    model, loaded_tokenizer = load_model(model)
    tokenizer = tokenizer or loaded_tokenizer
    device = next(model.parameters()).device
    default_count, default_len = default_windows(device)
    windows = windows or default_count
    window_len = window_len or default_len
    if not isinstance(texts, torch.Tensor):
        tokenizer = _model_tokenizer(model, tokenizer)
    ids = calibration_windows(tokenizer, texts, windows, window_len)
    num_layers = num_attention_layers(model)

    rates = None
    if measure:
        if device.type != "cuda":
            raise ValueError("measure=True needs the model on a CUDA GPU")
        cfg = model.config.get_text_config()
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rates = measure_rates(cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, cost_len, base_policy(target))

    captured = capture_windows(model, ids, progress=progress)
    missing = [i for i in range(num_layers) if i not in captured]
    if missing:
        raise ValueError(f"model: attention layers {missing} were not called during the forward pass")

    evaluated: list[list[dict]] = []
    presets: list[dict] = []
    per_layer: list[LayerChoice] = []
    for layer in tqdm(range(num_layers), desc="calibrate", unit="layer", disable=not progress):
        scorer = LayerScorer(captured.pop(layer))
        if allocation == "layer":
            per_layer.append(choose_policy(scorer, budget, target, cost_len, rates))
            evaluated.append(per_layer[-1].evaluated)
        else:
            evaluated.append(score_candidates(scorer, target, cost_len, rates))
        presets.append({name: scorer.errors(p) for name, p in named_reference_policies().items()})
        scorer.release()

    model_stats: dict = {}
    sensitivity: list[dict] = [{} for _ in range(num_layers)]
    if allocation == "layer":
        picks = [{"policy": c.policy.to_string(), "cost": c.cost, "rel_l2": c.rel_l2, "worst_row": c.worst_row}
                 for c in per_layer]
        within = [c.within_budget for c in per_layer]
    else:
        weights = None
        if allocation == "weighted":
            probe = named_reference_policies()["paper"]
            sensitivity = layer_sensitivity(model, ids[0], probe, [p["paper"]["rel_l2"] for p in presets])
            weights = [s["weight"] for s in sensitivity]
            model_stats["sensitivity_probe"] = probe.to_string()
        picks, price = allocate_model([pareto_front(e) for e in evaluated], budget, weights)
        # Per layer "within budget" means the model-level budget is met.
        within = [_meets(picks, budget, weights)] * num_layers
        model_stats.update(price=price, model_error=model_error(picks, weights))
    layers = {i: AttentionPolicy.from_string(pick["policy"]) for i, pick in enumerate(picks)}
    layer_stats = {
        str(i): {
            "policy": pick["policy"],
            "cost": pick["cost"],
            "mxfp4_fraction": format_fraction(layers[i], cost_len),
            "rel_l2": pick["rel_l2"],
            "worst_row": pick["worst_row"],
            "within_budget": within[i],
            "presets": presets[i],
            **({"sensitivity": sensitivity[i]} if sensitivity[i] else {}),
            "evaluated": evaluated[i],
        }
        for i, pick in enumerate(picks)
    }

    chosen = ModelPolicy(default=base_policy(target), layers=layers, num_layers=num_layers)
    chosen.stats = {
        "target": target,
        "budget": float(budget),
        "budget_unit": ERROR_UNIT,
        "cost_unit": f"attention time relative to bf16 SDPA at {cost_len} tokens, causal",
        "cost_len": cost_len,
        "rates": rates or RATES[target],
        "rates_measured": rates is not None,
        "windows": int(ids.shape[0]),
        "window_len": int(ids.shape[1]),
        "model": str(getattr(model, "name_or_path", "") or ""),
        "cost": model_cost(chosen, num_layers, target, cost_len),
        "mxfp4_fraction": model_format_fraction(chosen, num_layers, cost_len),
        "allocation": allocation,
        **model_stats,
        "layers": layer_stats,
    }
    return chosen


def named_reference_policies() -> dict[str, AttentionPolicy]:
    """The fixed policies every comparison reports beside a calibrated one."""
    return {
        "paper": AttentionPolicy.paper(),
        "hopper": AttentionPolicy.hopper(),
        "all_mxfp8": AttentionPolicy.preset("all_mxfp8"),
        "all_mxfp4": AttentionPolicy.preset("all_mxfp4"),
    }


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
