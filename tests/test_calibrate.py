"""dma_compile.calibrate (the entry point): calibration on a tiny
random-weight Llama, and the helpers the other calibration and comparison
tests build it from."""

import json
import math
import random

import pytest
import torch

from dma_compile.calibrate import (
    DEFAULT_COST_LEN,
    calibrate,
    calibration_windows,
    candidate_policies,
    model_error,
    policy_cost,
    policy_table,
)
from dma_compile.loading import HELDOUT_FRACTION
from dma_compile.policy import AttentionPolicy, ModelPolicy

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
        assert set(stats["presets"]) == {"paper", "paper_rotated", "hopper", "all_mxfp8", "all_mxfp4"}
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
        assert len(s["evaluated"]) == len(candidate_policies("sm100", head_dim=32)) + 1
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
    from dma_compile.loading import read_text

    found = find_assets()
    if found is None:
        pytest.skip("the embedded model and text are absent: run `dma-compile assets` first")
    policy = calibrate(found.model_dir, read_text(found.text_path), 0.03, "sm100", windows=1, window_len=256,
                       progress=False)
    assert policy.num_layers == 30 and len(policy.layers) == 30
    assert all(s["within_budget"] and s["rel_l2"] <= 0.03 for s in policy.stats["layers"].values())
    assert policy.stats["cost"] < policy_cost(AttentionPolicy.paper(), "sm100")
