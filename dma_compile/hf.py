"""transformers integration: `attn_implementation="dma"` for models that are not compiled.

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

(`cache_kwargs` gives the keyword this transformers version takes: `cache=`
in 5.2x, `past_key_values=` before; one keyword or the other also works
directly). The model must use
attn_implementation="dma". Each layer's cache stores tokens as its policy's
`cache_k` / `cache_v` say (default: the FP8 cache, `mxfp8_e4m3` for both);
the prefill runs the DMA prefill op on the prompt's own K/V, and every later
step reads the quantized storage through `torch.ops.dma.decode_attention`
(a padded batch's mask travels as a key-keep vector; steps with any other
mask read the dequantized cache through SDPA instead, logged once). Eager
only so far.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from dma_compile.kv_cache import QuantizedKV
from dma_compile.ops import MAX_HEAD_DIM, check_impl, check_inputs
from dma_compile.policy import AttentionPolicy, ModelPolicy, as_model_policy, default_policy
from dma_compile.reference import decode_keep

logger = logging.getLogger(__name__)

NAME = "dma"
# Keyword arguments some models pass that the DMA op has no equivalent for.
_UNSUPPORTED_KWARGS = ("position_bias", "softcap", "s_aux", "sinks")
# Key under which a DMACache layer hands itself to the attention function:
# in the keyword arguments transformers passes to both (5.2x), or as an
# attribute of the key tensor update() returns (5.1x passes update() none).
_CACHE_KWARG = "dma_cache_layer"
# Tokens a DMACache layer allocates at first, doubling when full.
_INITIAL_CAPACITY = 1024


def num_attention_layers(model_or_config) -> int:
    """The number of attention layers of a transformers model or config (its text config's)."""
    config = getattr(model_or_config, "config", model_or_config)
    count = getattr(getattr(config, "get_text_config", lambda: config)(), "num_hidden_layers", None)
    if not isinstance(count, int):
        raise ValueError("model: its config has no num_hidden_layers, so its attention layers cannot be counted")
    return count


def checked_layers(policy: ModelPolicy | None, model_or_config) -> int:
    """The model's number of attention layers, after checking that `policy`
    (None: nothing to check) was made for that many."""
    layers = num_attention_layers(model_or_config)
    if policy is not None:
        policy.check_layers(layers)
    return layers


def cache_kwargs(model: torch.nn.Module, cache) -> dict:
    """{keyword: cache} for `model(...)` and `model.generate(...)`: transformers
    renamed `past_key_values` to `cache` (5.2x), and a model given the
    keyword it does not know ignores the cache without an error."""
    params = inspect.signature(type(model).forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


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
    cache_layer = kwargs.pop(_CACHE_KWARG, None) or getattr(key, _CACHE_KWARG, None)
    if cache_layer is not None and cache_layer.past_length > 0:
        return cache_layer.decode(module, query, attention_mask, scaling, impl, kwargs), None
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


class KeyPaddingMasks:
    """Turns a decode step's mask into the decode op's key-keep vector, once
    per step: every layer of a model receives the same mask tensor, so the
    check (one host sync) runs for the first layer only."""

    def __init__(self):
        self._last: tuple | None = None

    def key_keep(self, attention_mask: torch.Tensor, lengths: torch.Tensor, t: int) -> torch.Tensor | None:
        """Bool (B, L): the keys the mask's last query row keeps, if the mask
        (B, 1, T, L), boolean or additive, is exactly causal over `lengths`
        with that key padding; None for any other mask."""
        if self._last is not None and self._last[0] is attention_mask:
            return self._last[1]
        keep = attention_mask if attention_mask.dtype == torch.bool else attention_mask != float("-inf")
        key_keep = None
        if keep.dim() == 4 and keep.shape[1] == 1 and keep.shape[2] == t and keep.shape[0] == lengths.shape[0]:
            candidate = keep[:, 0, -1, :]
            if torch.equal(keep[:, 0], decode_keep(lengths, t, keep.shape[-1], candidate)):
                key_keep = candidate.contiguous()
        self._last = (attention_mask, key_keep)
        return key_keep


class DMACacheLayer(CacheLayerMixin):
    """One layer of a DMACache: a growing `QuantizedKV` in `policy`'s cache formats."""

    is_sliding = False

    def __init__(self, policy: AttentionPolicy, masks: KeyPaddingMasks | None = None):
        super().__init__()
        self.policy = policy
        self.masks = masks if masks is not None else KeyPaddingMasks()
        self.store: QuantizedKV | None = None
        self.past_length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, t, d = key_states.shape
        capacity = max(_INITIAL_CAPACITY, 2 * t)
        self.store = QuantizedKV(b, h, d, capacity, self.policy, key_states.dtype, key_states.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new tokens; return them as they are (the prefill attends to
        them, later steps read the store through `decode`)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.past_length = self.store.max_length
        needed = self.past_length + key_states.shape[2]
        if needed > self.store.capacity:
            self.store.grow(max(needed, 2 * self.store.capacity))
        self.store.append(key_states, value_states)
        model_kwargs = kwargs.get("kwargs")
        if isinstance(model_kwargs, dict):
            model_kwargs[_CACHE_KWARG] = self
        else:
            key_states = key_states.view(key_states.shape)
            setattr(key_states, _CACHE_KWARG, self)
        return key_states, value_states

    def decode(self, module, query, attention_mask, scaling, impl, kwargs) -> torch.Tensor:
        """Attention output (B, T, Hq, D) of the newest tokens over this layer's cache.

        A mask that is causal with key padding (a padded batch's) travels to
        the decode op as a key-keep vector; any other mask reads the
        dequantized cache through SDPA, logged once."""
        key_keep = None
        if attention_mask is not None:
            key_keep = self.masks.key_keep(attention_mask, self.store.lengths, query.shape[2])
            if key_keep is None:
                _log_fallback_once("a step whose mask is not causal with key padding reads the dequantized cache")
                k, v = (x.to(query.dtype) for x in self.store.values())
                return sdpa_attention_forward(module, query, k, v, attention_mask, scaling=scaling, **kwargs)[0]
        decode_impl = impl if impl in ("auto", "reference") else "triton"
        return self.store.attend(query, scaling, decode_impl, key_keep).transpose(1, 2).contiguous()

    def get_seq_length(self) -> int:
        return 0 if self.store is None else self.store.max_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if self.store is not None:
            self.store.reset()
        self.past_length = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("DMACache does not support beam search yet")


class DMACache(Cache):
    """A transformers Cache whose layers store K/V quantized (see the module docstring).

    policy: a ModelPolicy, AttentionPolicy, policy string or JSON path, read for
    the cache fields of each layer; None: the device default with the FP8
    cache (cache_k = cache_v = "mxfp8_e4m3").
    """

    def __init__(self, model: torch.nn.Module, policy: ModelPolicy | str | os.PathLike | None = None):
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if getattr(config, "_attn_implementation", None) != NAME:
            raise ValueError(
                f"DMACache needs a model loaded with attn_implementation={NAME!r} (after dma_compile.hf.register()), "
                f"got {getattr(config, '_attn_implementation', None)!r}"
            )
        model_policy = as_model_policy(policy)
        if model_policy is None:
            device = next(model.parameters()).device
            fp8 = default_policy(device).replace(cache_k="mxfp8_e4m3", cache_v="mxfp8_e4m3")
            model_policy = ModelPolicy(default=fp8)
        layers = checked_layers(model_policy, config)
        masks = KeyPaddingMasks()
        super().__init__(layers=[DMACacheLayer(model_policy.for_layer(i), masks) for i in range(layers)])
