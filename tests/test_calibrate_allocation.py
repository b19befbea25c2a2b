"""dma_compile.calibrate.allocation: the per-layer choice and the model-level allocations."""

import math
import random

import pytest

from dma_compile.calibrate import LayerScorer, allocate_model, calibration_windows, choose_policy, model_error, pareto_front
from dma_compile.capture import capture_windows
from test_calibrate import tiny_model, tiny_text, tiny_tokenizer


@pytest.fixture(scope="module")
def model_and_text():
    return tiny_model(), tiny_tokenizer(), tiny_text(3000, seed=1)


def test_tighter_budget_never_picks_a_cheaper_policy(model_and_text):
    model, tok, text = model_and_text
    captured = capture_windows(model, calibration_windows(tok, text, 2, 260))
    for layer, windows in captured.items():
        scorer = LayerScorer(windows)  # memoizes errors, so each budget costs little
        costs = [choose_policy(scorer, b, "sm90").cost for b in (1.0, 0.05, 0.02, 0.01, 0.005, 0.001, 1e-6)]
        assert costs == sorted(costs), f"layer {layer}: {costs}"
        assert costs[-1] > costs[0]


def _random_fronts(rng: random.Random, layers: int, options: int) -> list[list[dict]]:
    """Random per-layer tables: cheaper options carry larger, layer-dependent errors."""
    fronts = []
    for _ in range(layers):
        scale = rng.uniform(0.2, 5.0)
        entries = [{"policy": f"p{i}", "cost": rng.uniform(0.3, 1.0), "rel_l2": 0.0} for i in range(options)]
        for e in entries:
            e["rel_l2"] = scale * (1.05 - e["cost"]) ** rng.uniform(1, 3) * rng.uniform(0.5, 1.5) / 10
        fronts.append(pareto_front(entries))
    return fronts


def _per_layer_pick(front: list[dict], budget: float) -> dict:
    return next(e for e in front if e["rel_l2"] <= budget)


def test_pareto_front_keeps_only_undominated_entries():
    points = [(1, 0.0), (0.5, 0.1), (0.5, 0.05), (0.7, 0.2), (0.3, 0.3), (0.8, 0.01)]
    entries = [{"cost": c, "rel_l2": e} for c, e in points]
    front = pareto_front(entries)
    assert [(e["cost"], e["rel_l2"]) for e in front] == [(0.3, 0.3), (0.5, 0.05), (0.8, 0.01), (1, 0.0)]


def test_model_allocation_within_budget_and_never_dearer_than_per_layer(seed):
    rng = random.Random(seed)
    for _ in range(40):
        fronts = _random_fronts(rng, rng.randint(1, 12), rng.randint(1, 10))
        budget = rng.uniform(0.0, 0.2)
        weights = None
        if rng.random() < 0.5:  # sensitivity weights, as layer_sensitivity scales them: mean 1
            raw = [rng.uniform(0.05, 5.0) for _ in fronts]
            weights = [w * len(raw) / sum(raw) for w in raw]
        chosen, price = allocate_model(fronts, budget, weights)
        assert all(c in front for c, front in zip(chosen, fronts))
        if price == math.inf:
            assert chosen == [front[-1] for front in fronts] and model_error(chosen, weights) > budget
            continue
        assert model_error(chosen, weights) <= budget * (1 + 1e-12)
        if all(front[-1]["rel_l2"] <= budget for front in fronts):
            per_layer = [_per_layer_pick(front, budget) for front in fronts]
            assert sum(c["cost"] for c in chosen) <= sum(p["cost"] for p in per_layer) + 1e-12


def test_model_allocation_spends_the_budget_where_it_is_cheap():
    # Layer 0 loses little by going cheap, layer 1 a lot: the model-level
    # allocation takes layer 0 below a per-layer budget it would not meet alone.
    robust = [{"policy": "a", "cost": 1.0, "rel_l2": 0.01}, {"policy": "b", "cost": 0.5, "rel_l2": 0.06}]
    sensitive = [{"policy": "a", "cost": 1.0, "rel_l2": 0.01}, {"policy": "b", "cost": 0.9, "rel_l2": 0.3}]
    chosen, _ = allocate_model([pareto_front(robust), pareto_front(sensitive)], 0.05)
    assert [c["cost"] for c in chosen] == [0.5, 1.0]
    assert model_error(chosen) == pytest.approx(math.sqrt((0.06**2 + 0.01**2) / 2))


def test_allocation_weights_are_checked():
    fronts = [pareto_front([{"policy": "a", "cost": 1.0, "rel_l2": 0.01}])] * 2
    for weights in ([1.0], [1.0, -1.0], [1.0, float("nan")]):
        with pytest.raises(ValueError, match="weights"):
            allocate_model(fronts, 0.1, weights)
