"""The calibration entry point: `calibrate(model, texts, budget)` -> ModelPolicy.

The model runs (stock SDPA) on calibration windows of a text while
`dma_compile.capture` records every layer's Q, K, V; each layer's candidates
are scored (`scoring`), priced (`cost`) and one is chosen per layer or for the
model as a whole (`allocation`). The statistics behind every choice go into
the result's `stats`.
"""

from __future__ import annotations

import math

import torch

from dma_compile.calibrate.allocation import (
    LayerChoice,
    allocate_model,
    choose_policy,
    layer_sensitivity,
    meets_budget,
    model_error,
    pareto_front,
    score_candidates,
)
from dma_compile.calibrate.cost import (
    DEFAULT_COST_LEN,
    RATES,
    base_policy,
    format_fraction,
    measure_rates,
    model_cost,
    model_format_fraction,
    resolve_target,
)
from dma_compile.calibrate.scoring import LayerScorer
from dma_compile.loading import load_model, model_tokenizer, split_heldout, take_windows, tokenize
from dma_compile.policy import AttentionPolicy, ModelPolicy, reference_policies

# (windows, tokens per window): the reference on a CPU is slow, a GPU is not.
CPU_WINDOWS = (2, 512)
GPU_WINDOWS = (4, 2048)
# "layer": each layer within the budget on its own; "model": the root mean
# square of the layers' errors within it (`allocate_model`); "weighted": the
# same with each layer's squared error weighted by its `layer_sensitivity`.
ALLOCATIONS = ("layer", "model", "weighted")
ERROR_UNIT = "relative L2 error of the layer's attention output vs exact attention"


def default_windows(device: torch.device) -> tuple[int, int]:
    """(windows, tokens per window) calibration uses on `device` by default."""
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


def _check_budget(budget) -> None:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not budget > 0 or math.isinf(budget):
        raise ValueError(f"budget must be a positive number (relative L2 error, e.g. 0.02), got {budget!r}")


def _model_rates(model, cost_len: int, target: str) -> dict:
    """The per-tile rates measured through the kernels at the model's attention shape."""
    if next(model.parameters()).device.type != "cuda":
        raise ValueError("measure=True needs the model on a CUDA GPU")
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return measure_rates(cfg.num_attention_heads, cfg.num_key_value_heads, head_dim, cost_len, base_policy(target))


def _score_layers(captured: dict, num_layers: int, budget: float, target: str, cost_len: int, rates: dict | None,
                  allocation: str, progress: bool) -> tuple[list[list[dict]], list[dict], list[LayerChoice]]:
    """Per layer: the candidates scored, the reference presets' errors and,
    for the per-layer allocation, its choice. Each layer's windows are
    released once scored."""
    from tqdm.auto import tqdm

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
        presets.append({name: scorer.errors(p) for name, p in reference_policies().items()})
        scorer.release()
    return evaluated, presets, per_layer


def _allocate(model, ids: torch.Tensor, budget: float, allocation: str, evaluated: list[list[dict]],
              presets: list[dict], per_layer: list[LayerChoice]) -> tuple[list[dict], list[bool], list[dict], dict]:
    """(one pick per layer, whether each is within the budget, each layer's
    sensitivity ({} unless weighted), model-level statistics)."""
    num_layers = len(evaluated)
    if allocation == "layer":
        picks = [{"policy": c.policy.to_string(), "cost": c.cost, "rel_l2": c.rel_l2, "worst_row": c.worst_row}
                 for c in per_layer]
        return picks, [c.within_budget for c in per_layer], [{} for _ in range(num_layers)], {}
    model_stats: dict = {}
    sensitivity: list[dict] = [{} for _ in range(num_layers)]
    weights = None
    if allocation == "weighted":
        probe = AttentionPolicy.paper()
        sensitivity = layer_sensitivity(model, ids[0], probe, [p["paper"]["rel_l2"] for p in presets])
        weights = [s["weight"] for s in sensitivity]
        model_stats["sensitivity_probe"] = probe.to_string()
    picks, price = allocate_model([pareto_front(e) for e in evaluated], budget, weights)
    # Per layer "within budget" means the model-level budget is met.
    within = [meets_budget(picks, budget, weights)] * num_layers
    model_stats.update(price=price, model_error=model_error(picks, weights))
    return picks, within, sensitivity, model_stats


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
    from dma_compile.capture import capture_windows
    from dma_compile.hf import num_attention_layers

    _check_budget(budget)
    if allocation not in ALLOCATIONS:
        raise ValueError(f"allocation must be one of {list(ALLOCATIONS)}, got {allocation!r}")
    target = resolve_target(target)
    model, loaded_tokenizer = load_model(model)
    tokenizer = tokenizer or loaded_tokenizer
    default_count, default_len = default_windows(next(model.parameters()).device)
    if not isinstance(texts, torch.Tensor):
        tokenizer = model_tokenizer(model, tokenizer)
    ids = calibration_windows(tokenizer, texts, windows or default_count, window_len or default_len)
    num_layers = num_attention_layers(model)
    rates = _model_rates(model, cost_len, target) if measure else None

    captured = capture_windows(model, ids, progress=progress)
    missing = [i for i in range(num_layers) if i not in captured]
    if missing:
        raise ValueError(f"model: attention layers {missing} were not called during the forward pass")
    evaluated, presets, per_layer = _score_layers(captured, num_layers, budget, target, cost_len, rates, allocation,
                                                  progress)
    picks, within, sensitivity, model_stats = _allocate(model, ids, budget, allocation, evaluated, presets, per_layer)

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
