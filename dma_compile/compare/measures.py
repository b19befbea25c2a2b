"""Model-level measures of a policy: perplexity, greedy agreement, per-layer errors."""

from __future__ import annotations

import inspect
import math

import torch

from dma_compile.calibrate.scoring import LayerScorer
from dma_compile.policy import ModelPolicy


@torch.no_grad()
def perplexity(model, windows: torch.Tensor) -> float:
    """exp(mean next-token NLL) over every predicted position of the windows."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for window in windows:
        ids = window[None].to(device)
        logits = model(ids, use_cache=False).logits[0, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    return math.exp(total / count)


def _kv_cache(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


@torch.no_grad()
def greedy_tokens(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """`new_tokens` greedy continuations of a 1-D prompt (no early stop at EOS)."""
    device = next(model.parameters()).device
    # transformers renamed `past_key_values` to `cache` (5.2x); accept both.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(prompt[None].to(device), use_cache=True)
    token = out.logits[0, -1].argmax()
    tokens = [token]
    for _ in range(new_tokens - 1):
        out = model(token.view(1, 1), use_cache=True, **{cache_arg: _kv_cache(out)})
        token = out.logits[0, -1].argmax()
        tokens.append(token)
    return torch.stack(tokens).cpu()


def agreement(reference: torch.Tensor, tokens: torch.Tensor) -> tuple[int, float]:
    """(tokens before the first divergence, fraction of positions equal)."""
    equal = reference == tokens
    first = int(equal.logical_not().nonzero()[0]) if not bool(equal.all()) else equal.numel()
    return first, float(equal.float().mean())


def spread(name: str, values: list[float]) -> dict:
    """{name: mean, name_sem: standard error of the mean (0 for one value),
    name_per_prompt: the values}: greedy agreement swings from prompt to
    prompt, so the mean alone says little."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return {name: mean, f"{name}_sem": math.sqrt(var / len(values)), f"{name}_per_prompt": values}


def layer_errors(model, window: torch.Tensor, policies: dict[str, ModelPolicy | None], num_layers: int) -> list[dict]:
    """Per layer, each DMA policy's relative L2 error (and worst row) on one window."""
    from dma_compile.capture import capture_windows

    captured = capture_windows(model, window[None])
    rows = []
    for layer in range(num_layers):
        scorer = LayerScorer(captured.pop(layer))
        row = {"layer": layer}
        for name, policy in policies.items():
            if policy is not None:
                row[name] = scorer.errors(policy.for_layer(layer))
        rows.append(row)
        scorer.release()
    return rows
