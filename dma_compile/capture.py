"""Capture each attention layer's Q, K and V from a transformers model.

The model's own code is never touched: an attention implementation named
`dma_capture` is registered with transformers' `AttentionInterface`; it hands
every call's query, key and value (after RoPE, before any GQA expansion:
exactly what SDPA sees) to a callback and then runs stock SDPA, so the model's
outputs are unchanged. `capture_attention` switches a model to it for the
duration of a `with` block.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator

import torch

CAPTURE_IMPLEMENTATION = "dma_capture"

# (layer_index, q, k, v, scale) -> None; set only inside `capture_attention`.
Callback = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, "float | None"], None]
_callback: contextvars.ContextVar[Callback | None] = contextvars.ContextVar("dma_capture_callback", default=None)


def _capturing_attention(module, query, key, value, attention_mask, *args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    callback = _callback.get()
    if callback is not None:
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise ValueError(
                f"model: attention module {type(module).__name__} has no layer_idx, so its calls cannot be "
                "attributed to a layer"
            )
        if attention_mask is not None and attention_mask.dtype == torch.bool and bool(attention_mask.all()):
            attention_mask = None
        if attention_mask is not None:
            raise ValueError(
                "capture: calibration windows must be unpadded causal sequences; this call has an attention mask"
            )
        callback(int(layer), query.detach(), key.detach(), value.detach(), kwargs.get("scaling"))
    return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)


def register() -> str:
    """Register `dma_capture` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CAPTURE_IMPLEMENTATION, _capturing_attention)
    # Masks are built as for SDPA: None for an unpadded causal batch.
    AttentionMaskInterface.register(CAPTURE_IMPLEMENTATION, sdpa_mask)
    return CAPTURE_IMPLEMENTATION


@contextlib.contextmanager
def capture_attention(model, callback: Callback) -> Iterator[None]:
    """Within the block, every attention call of `model` first calls
    `callback(layer_index, q, k, v, scale)`; q is (B, Hq, L, D), k and v are
    (B, Hkv, L, D). The model's previous attention implementation is restored
    afterwards."""
    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE_IMPLEMENTATION)
    token = _callback.set(callback)
    try:
        yield
    finally:
        _callback.reset(token)
        model.set_attn_implementation(previous)


@torch.no_grad()
def capture_windows(model, windows: torch.Tensor, progress: bool = False) -> dict[int, list[tuple]]:
    """Run `model` on each row of `windows` (N, L) and return, per layer, the
    list of (q, k, v, scale) of every window (batch 1 each)."""
    from tqdm.auto import tqdm

    captured: dict[int, list[tuple]] = {}

    def keep(layer, q, k, v, scale):
        captured.setdefault(layer, []).append((q, k, v, scale))

    device = next(model.parameters()).device
    with capture_attention(model, keep):
        for window in tqdm(windows, desc="capture", unit="window", disable=not progress):
            model(window[None].to(device), use_cache=False)
    return captured
