"""transformers integration: `attn_implementation="dma"` for models that are not compiled.

    import dma_compile.hf
    dma_compile.hf.register(policy)          # once; policy as for dma_backend
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="dma")

The attention function mirrors transformers' `sdpa_attention_forward` (same
masks, the same causal rule) but calls `torch.ops.dma.attention` with the
policy of the module's `layer_idx`, on K/V before any GQA expansion. Calls the
op cannot serve run transformers' SDPA path instead, with the reason logged
once.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from dma_compile.ops import check_impl, check_inputs
from dma_compile.policy import ModelPolicy, as_model_policy, default_policy

logger = logging.getLogger(__name__)

NAME = "dma"
MAX_HEAD_DIM = 256
# Keyword arguments some models pass that the DMA op has no equivalent for.
_UNSUPPORTED_KWARGS = ("position_bias", "softcap", "s_aux", "sinks")


@functools.lru_cache(maxsize=None)
def _log_fallback_once(reason: str) -> None:
    logger.warning("dma: attention runs stock SDPA: %s", reason)


def _fallback_reason(query, key, value, attention_mask, dropout, is_causal, policy, impl, kwargs) -> str | None:
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            return f"{name} is not supported"
    if dropout > 0:
        return "dropout > 0 (DMA has no dropout)"
    head_dim = max(query.shape[-1], value.shape[-1])
    if head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} > {MAX_HEAD_DIM}"
    try:
        check_inputs(query, key, value, attention_mask, is_causal, None, policy, impl)
    except ValueError as e:
        return str(e)
    return None


def _attention_forward(
    model_policy: ModelPolicy | None,
    impl: str,
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    layer = getattr(module, "layer_idx", None)
    if model_policy is None:
        policy = default_policy(query.device)
    elif model_policy.num_layers is not None and layer is not None and layer >= model_policy.num_layers:
        raise ValueError(f"policy was calibrated for {model_policy.num_layers} layers, this model has layer {layer}")
    else:
        policy = model_policy.for_layer(layer)
    q_length = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_length > 1 and attention_mask is None and causal)
    reason = _fallback_reason(query, key, value, attention_mask, dropout, causal, policy, impl, kwargs)
    if reason is not None:
        _log_fallback_once(reason)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    if causal and key.shape[2] > q_length:
        # Prefill into an empty static cache: the keys past the queries are all masked.
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    scale = None if scaling is None else float(scaling)
    out = torch.ops.dma.attention(query, key, value, attention_mask, causal, scale, policy.to_string(), impl)
    return out.transpose(1, 2).contiguous(), None


def register(policy: ModelPolicy | str | os.PathLike | None = None, impl: str = "auto") -> str:
    """Register (or re-register) attn_implementation="dma" with transformers.

    policy: a ModelPolicy (per layer, by the attention module's `layer_idx`),
    an AttentionPolicy, a policy string or JSON path, or None (each call's
    device default). impl: the op's impl ("auto" picks the kernel per GPU).
    Returns the implementation name to pass as `attn_implementation`.
    """
    check_impl(impl)
    forward = functools.partial(_attention_forward, as_model_policy(policy), impl)
    AttentionInterface.register(NAME, forward)
    # Same boolean masks as SDPA (None when is_causal can stand in for them).
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
