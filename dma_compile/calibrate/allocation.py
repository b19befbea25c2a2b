"""Allocation: which scored candidate each layer takes within the error budget.

Per layer (`choose_policy`, allocation "layer"): candidates are scored in
order of increasing cost and the search stops at the first cost level holding
a candidate within the budget, so the choice is the cheapest (ties: the
lowest error) and a tighter budget never picks a cheaper policy.

Model-level (`allocate_model`, allocations "model" and "weighted"): every
candidate is scored in full and one budget is spent on the root mean square
of the layers' errors, so layers that quantize well take more low-precision
tiles than sensitive ones; "weighted" first weights each layer's squared
error by its measured effect on the logits (`layer_sensitivity`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from dma_compile.calibrate.cost import DEFAULT_COST_LEN, candidate_policies, exact_policy, policy_cost
from dma_compile.calibrate.scoring import LayerScorer
from dma_compile.policy import AttentionPolicy, ModelPolicy


@dataclass
class LayerChoice:
    """One layer's per-layer choice, and every candidate scored on the way to it."""

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
    priced = [(policy_cost(p, target, cost_len, rates), p) for p in candidate_policies(target, scorer.head_dim)]
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


def score_candidates(
    scorer: LayerScorer, target: str, cost_len: int = DEFAULT_COST_LEN, rates: dict | None = None
) -> list[dict]:
    """Every candidate and the exact policy, each scored in full, cheapest
    first. The model-level allocation trades error between layers, so unlike
    `choose_policy` it needs every layer's whole (cost, error) table."""
    policies = [*candidate_policies(target, scorer.head_dim), exact_policy(target)]
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


def meets_budget(chosen: Sequence[dict], budget: float, weights: Sequence[float] | None) -> bool:
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
    if not meets_budget(most_accurate, budget, weights):
        return most_accurate, math.inf
    lo, hi = -12.0, 12.0  # log10 of the price: costs are O(1), squared errors O(1e-6) and up
    while hi - lo > 1e-6:
        mid = (lo + hi) / 2
        if meets_budget(_lagrangian_choice(fronts, weights, 10**mid), budget, weights):
            hi = mid
        else:
            lo = mid
    price = 10**hi
    start = _lagrangian_choice(fronts, weights, price)
    chosen = _fill_slack(fronts, start if meets_budget(start, budget, weights) else most_accurate, budget, weights)
    per_layer = [_cheapest_within(front, budget) for front in fronts]
    if meets_budget(per_layer, budget, weights):
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
