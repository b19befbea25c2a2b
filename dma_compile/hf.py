"""transformers integration: `attn_implementation="dma"` and the quantized KV cache.

    import dma_compile.hf
    dma_compile.hf.register(policy)          # once; policy as for dma_backend
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="dma")

The attention function mirrors transformers' `sdpa_attention_forward` (same
masks, the same causal rule) but calls `torch.ops.dma.attention` with the
policy of the module's `layer_idx`, on K/V before any GQA expansion. Calls the
op cannot serve run transformers' SDPA path instead, with the reason logged
once; so do decode steps (queries shorter than the policy's `min_q_len`, with
impl="auto"), which the op would route to stock SDPA, without passing through it.

Generation through the quantized KV cache (dma_compile.kv_cache), one line:

    out = model.generate(ids, **dma_compile.hf.cache_kwargs(model, dma_compile.hf.DMACache(model)),
                         max_new_tokens=64)

and under torch.compile, on a static cache of prompt + new tokens:

    model.forward = torch.compile(model.forward, mode="reduce-overhead")
    cache = dma_compile.hf.DMACache(model, max_cache_len=ids.shape[1] + 64)
    out = model.generate(ids, **dma_compile.hf.cache_kwargs(model, cache), max_new_tokens=64)

(`cache_kwargs` gives the keyword this transformers version takes: `cache=`
in 5.2x, `past_key_values=` before.) The model must use
attn_implementation="dma"; dma_compile.hf_cache describes the cache.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from dma_compile.hf_cache import CACHE_KWARG, DMACache, DMACacheLayer, DMAStaticCacheLayer, KeyPaddingMasks
from dma_compile.hf_config import NAME, cache_kwargs, checked_layers, num_attention_layers
from dma_compile.ops import MAX_HEAD_DIM, check_impl, check_inputs
from dma_compile.policy import ModelPolicy, as_model_policy, default_policy

logger = logging.getLogger(__name__)

__all__ = [
    "DMACache", "DMACacheLayer", "DMAStaticCacheLayer", "KeyPaddingMasks", "NAME", "cache_kwargs",
    "checked_layers", "num_attention_layers", "register", "running_policy",
]

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
    cache_layer = kwargs.pop(CACHE_KWARG, None) or getattr(key, CACHE_KWARG, None)
    if cache_layer is not None:
        if cache_layer.reads_cache(query):
            return cache_layer.decode(module, query, attention_mask, scaling, impl, kwargs), None
        if attention_mask is not None:
            # A static layer's mask spans its capacity; the prefill's keys are its first positions.
            attention_mask = attention_mask[..., : key.shape[2]]
            cache_layer.prefill_seen(attention_mask, key, value)
    layer = getattr(module, "layer_idx", None)
    if model_policy is None:
        policy = default_policy(query.device)
    elif model_policy.num_layers is not None and layer is not None and layer >= model_policy.num_layers:
        raise ValueError(f"policy was calibrated for {model_policy.num_layers} layers, this model has layer {layer}")
    else:
        policy = model_policy.for_layer(layer)
    q_length = query.shape[2]
    if impl == "auto" and q_length < policy.min_q_len:
        # Decode steps: the op would route them to stock SDPA; going there
        # directly spares each step the op's checks and dispatch.
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
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


@contextlib.contextmanager
def running_policy(model, policy: ModelPolicy | None):
    """Within the block `model` runs its attention under `policy` through
    dma_compile.hf's "dma" attention implementation (None: stock SDPA)."""
    if policy is None:
        yield
        return
    name = register(policy)
    previous = model.config._attn_implementation
    model.set_attn_implementation(name if isinstance(name, str) else "dma")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


