"""Calibration: the scorer equals the reference, the cost model, and the
per-layer choice on a tiny random-weight Llama."""

import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

from dma_compile.calibrate import (
    DEFAULT_COST_LEN,
    HELDOUT_FRACTION,
    LayerScorer,
    allocate_model,
    calibrate,
    calibration_windows,
    candidate_policies,
    choose_policy,
    exact_policy,
    format_fraction,
    model_error,
    pareto_front,
    policy_cost,
    policy_table,
    resolve_target,
    split_heldout,
    take_windows,
)
from dma_compile.capture import capture_windows
from dma_compile.policy import AttentionPolicy, ModelPolicy
from dma_compile.reference import dma_attention_reference

WORDS = [f"w{i}" for i in range(300)]


def tiny_text(n_words: int, seed: int) -> str:
    """Random words with a little structure (repeated phrases), so attention is not uniform."""
    rng = random.Random(seed)
    phrases = [" ".join(rng.choices(WORDS, k=rng.randint(3, 8))) for _ in range(40)]
    out, count = [], 0
    while count < n_words:
        phrase = rng.choice(phrases) if rng.random() < 0.6 else " ".join(rng.choices(WORDS, k=5))
        out.append(phrase)
        count += len(phrase.split())
    return " ".join(out)


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", eos_token="[UNK]")


def tiny_model(num_layers: int = 2, seed: int = 0):
    """A random-weight Llama: 6 query heads, 2 KV heads (GQA), head_dim 32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(WORDS) + 1,
        hidden_size=192,
        intermediate_size=256,
        num_hidden_layers=num_layers,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        initializer_range=0.15,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def save_tiny(path, num_layers: int = 2):
    tiny_model(num_layers).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_and_text():
    return tiny_model(), tiny_tokenizer(), tiny_text(3000, seed=1)


def test_scorer_output_equals_reference(seed):
    # Awkward shapes: 300 tokens (not a multiple of the tile), GQA 4/2, shifted K.
    q = (torch.randn(1, 4, 300, 64) * 2).bfloat16()
    k = (torch.randn(1, 2, 300, 64) * 2 + torch.randn(1, 2, 1, 64)).bfloat16()
    v = torch.randn(1, 2, 300, 64).bfloat16()
    scorer = LayerScorer([(q, k, v, None)])
    rng = random.Random(seed)
    policies = rng.sample(candidate_policies("sm100"), 4) + rng.sample(candidate_policies("sm90"), 4)
    for policy in policies + [AttentionPolicy.paper(), AttentionPolicy.hopper()]:
        expected = dma_attention_reference(q, k, v, is_causal=True, policy=policy)
        assert torch.equal(scorer.output(0, policy), expected), policy.to_string()


def test_scorer_errors_against_exact_attention(seed):
    q, k, v = (torch.randn(1, 4, 200, 32).bfloat16() for _ in range(3))
    scorer = LayerScorer([(q, k, v, None), (q[..., :150, :], k[..., :150, :], v[..., :150, :], 0.3)])
    exact = scorer.errors(exact_policy("sm100"))
    assert exact["rel_l2"] < 1e-2 and exact["complete"]
    coarse_policy = AttentionPolicy.preset("all_mxfp4")
    # Early give-up: a lower bound above the limit, then the full value when asked.
    bound = scorer.errors(coarse_policy, give_up_above=exact["rel_l2"])
    assert not bound["complete"] and bound["rel_l2"] > exact["rel_l2"]
    coarse = scorer.errors(coarse_policy)
    assert coarse["complete"] and coarse["rel_l2"] >= bound["rel_l2"]
    assert coarse["rel_l2"] > 10 * exact["rel_l2"]
    assert coarse["worst_row"] >= coarse["rel_l2"] * 0.5
    err_sq = ref_sq = 0.0
    for i, (wq, wk, wv, scale) in enumerate(scorer.windows):
        exact_out = F.scaled_dot_product_attention(wq.float(), wk.float(), wv.float(), is_causal=True, scale=scale)
        exact_out = exact_out.bfloat16().float()
        err_sq += float((scorer.output(i, coarse_policy).float() - exact_out).square().sum())
        ref_sq += float(exact_out.square().sum())
    assert coarse["rel_l2"] == pytest.approx(math.sqrt(err_sq / ref_sq), rel=1e-5)
    assert scorer.errors(coarse_policy, give_up_above=1e-9) is scorer.errors(coarse_policy)


def test_cost_model_known_values():
    # 2048 tokens = 16 tiles: 136 visible tiles, paper has 16 diagonal + 15 sink tiles high.
    paper = AttentionPolicy.paper()
    assert policy_cost(paper, "sm100", 2048) == pytest.approx((31 * 1 + 105 * 0.5 + 136 * 2) / (136 * 4))
    assert format_fraction(paper, 2048) == pytest.approx(105 / 136)
    assert policy_cost(AttentionPolicy.hopper(), "sm90", 2048) == pytest.approx((31 + 105 * 0.5 + 136) / 272)
    # Exact MX numerics on Hopper run at bf16 speed.
    assert policy_cost(paper, "sm90", 2048) == pytest.approx(1.0)
    assert policy_cost(exact_policy("sm100"), "sm100") == pytest.approx(1.0)
    assert policy_cost(paper.replace(pv="fp8"), "sm100") < policy_cost(paper, "sm100")
    assert policy_cost(paper.replace(diag_tiles=4), "sm100") > policy_cost(paper, "sm100")


def test_candidates_are_distinct_and_cover_the_grid():
    for target in ("sm90", "sm100"):
        candidates = candidate_policies(target)
        strings = [p.to_string() for p in candidates]
        assert len(strings) == len(set(strings)) == 3 * 4 * 3 * 2 + 2
        assert {p.pv for p in candidates} == {"input", "fp8"}
        assert {p.diag_tiles for p in candidates} == {1, 2, 4, 8}
    assert all(p.mx_mode == "folded" for p in candidate_policies("sm90"))
    assert resolve_target("sm90") == "sm90"
    with pytest.raises(ValueError, match="target"):
        resolve_target("sm80")


def test_windows_never_touch_the_heldout_part():
    ids = torch.arange(10_000)
    calib, held = split_heldout(ids)
    assert held.numel() == round(10_000 * HELDOUT_FRACTION)
    assert int(calib.max()) < int(held.min())
    windows = take_windows(calib, 5, 700, spread=True)
    assert windows.shape == (5, 700)
    assert int(windows.max()) < int(held.min())
    starts = sorted(int(w[0]) for w in windows)
    assert all(b - a >= 700 for a, b in zip(starts, starts[1:]))
    assert take_windows(held, 3, 5000, spread=False).shape == (1, 1000)


def test_string_windows_come_from_the_calibration_part(model_and_text):
    _, tok, text = model_and_text
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids[0]
    windows = calibration_windows(tok, text, 3, 256)
    cut = ids.numel() - round(ids.numel() * HELDOUT_FRACTION)
    for w in windows:
        found = [s for s in range(ids.numel() - 255) if torch.equal(ids[s : s + 256], w)]
        assert found and found[0] + 256 <= cut


def _per_layer_costs(policy: ModelPolicy) -> list[float]:
    return [policy.stats["layers"][str(i)]["cost"] for i in range(policy.num_layers)]


def test_calibrate_tiny_model(model_and_text, tmp_path):
    model, tok, text = model_and_text
    loose = calibrate(model, text, 1.0, "sm100", tokenizer=tok, windows=2, window_len=300, progress=False)
    cheapest = min(policy_cost(p, "sm100") for p in candidate_policies("sm100"))
    assert loose.num_layers == 2
    assert all(c == pytest.approx(cheapest) for c in _per_layer_costs(loose))

    # A budget between the candidates' errors must force a dearer choice on some layer.
    errors = sorted(e["rel_l2"] for e in loose.stats["layers"]["0"]["evaluated"])
    budget = errors[0] * 0.7
    tight = calibrate(model, text, budget, "sm100", tokenizer=tok, windows=2, window_len=300, progress=False)
    for layer, stats in tight.stats["layers"].items():
        assert stats["within_budget"] is True
        assert stats["rel_l2"] <= budget
        assert tight.layers[int(layer)].to_string() == stats["policy"]
        # The cheapest: nothing cheaper that was scored is within the budget.
        cheaper = [e for e in stats["evaluated"] if e["cost"] < stats["cost"] - 1e-9]
        assert all(e["rel_l2"] > budget for e in cheaper)
        assert set(stats["presets"]) == {"paper", "hopper", "all_mxfp8", "all_mxfp4"}
    assert max(_per_layer_costs(tight)) > cheapest
    assert tight.stats["budget"] == budget and tight.stats["target"] == "sm100"
    assert tight.stats["window_len"] == 300 and tight.stats["windows"] == 2

    path = tmp_path / "policy.json"
    tight.save(path)
    again = ModelPolicy.load(path)
    assert again.layers == tight.layers and again.default == tight.default
    assert again.num_layers == 2
    assert again.stats == json.loads(json.dumps(tight.stats))
    table = policy_table(again)
    assert "worst row" in table.splitlines()[0] and f"budget {budget}" in table


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


@pytest.mark.parametrize("allocation", ["model", "weighted"])
def test_calibrate_model_allocation(model_and_text, allocation):
    model, tok, text = model_and_text
    kwargs = dict(tokenizer=tok, windows=1, window_len=300, progress=False)
    loose = calibrate(model, text, 1.0, "sm100", **kwargs)
    budget = sorted(e["rel_l2"] for e in loose.stats["layers"]["1"]["evaluated"])[0] * 0.9
    per_layer = calibrate(model, text, budget, "sm100", **kwargs)
    pooled = calibrate(model, text, budget, "sm100", allocation=allocation, **kwargs)
    assert per_layer.stats["allocation"] == "layer" and pooled.stats["allocation"] == allocation
    layer_stats = [pooled.stats["layers"][str(i)] for i in range(pooled.num_layers)]
    weights = None
    if allocation == "weighted":
        weights = [s["sensitivity"]["weight"] for s in layer_stats]
        assert sum(weights) / len(weights) == pytest.approx(1.0)
        assert all(s["sensitivity"]["kl"] > 0 for s in layer_stats)
    assert pooled.stats["model_error"] == pytest.approx(model_error(layer_stats, weights))
    assert pooled.stats["model_error"] <= budget and all(s["within_budget"] for s in layer_stats)
    assert pooled.stats["cost"] <= per_layer.stats["cost"] + 1e-12
    # Every candidate and the exact policy scored in full, the choice among them.
    for i, s in enumerate(layer_stats):
        assert len(s["evaluated"]) == len(candidate_policies("sm100")) + 1
        assert all(e["complete"] for e in s["evaluated"])
        assert pooled.layers[i].to_string() == s["policy"]
    assert f"{allocation} allocation" in policy_table(pooled)


def test_bad_allocation_is_rejected(model_and_text):
    model, tok, text = model_and_text
    with pytest.raises(ValueError, match="allocation"):
        calibrate(model, text, 0.1, tokenizer=tok, allocation="global", progress=False)


@pytest.mark.parametrize("budget", [0, -0.1, float("nan"), float("inf"), "0.1", True])
def test_bad_budget_is_rejected(model_and_text, budget):
    model, tok, text = model_and_text
    with pytest.raises(ValueError, match="budget"):
        calibrate(model, text, budget, tokenizer=tok, progress=False)


def test_bad_texts_are_rejected(model_and_text):
    model, tok, _ = model_and_text
    for texts in ("", "   ", [], [""]):
        with pytest.raises(ValueError, match="text"):
            calibrate(model, texts, 0.1, tokenizer=tok, progress=False)
    with pytest.raises(ValueError, match="model directory"):
        calibrate("/nonexistent/model", "some text", 0.1, progress=False)


def test_costs_are_for_the_cost_length(model_and_text):
    model, tok, text = model_and_text
    policy = calibrate(model, text, 1.0, "sm100", tokenizer=tok, windows=1, window_len=200, cost_len=512, progress=False)
    assert policy.stats["cost_len"] == 512
    assert policy.stats["cost"] == pytest.approx(policy_cost(policy.for_layer(0), "sm100", 512))
    assert policy.stats["cost"] != pytest.approx(policy_cost(policy.for_layer(0), "sm100", DEFAULT_COST_LEN))
    assert math.isfinite(policy.stats["mxfp4_fraction"])


@pytest.mark.assets
def test_calibrate_the_embedded_model():
    from dma_compile.assets import find_assets
    from dma_compile.calibrate import read_text

    found = find_assets()
    if found is None:
        pytest.skip("the embedded model and text are absent: run `dma-compile assets` first")
    policy = calibrate(found.model_dir, read_text(found.text_path), 0.03, "sm100", windows=1, window_len=256,
                       progress=False)
    assert policy.num_layers == 30 and len(policy.layers) == 30
    assert all(s["within_budget"] and s["rel_l2"] <= 0.03 for s in policy.stats["layers"].values())
    assert policy.stats["cost"] < policy_cost(AttentionPolicy.paper(), "sm100")
