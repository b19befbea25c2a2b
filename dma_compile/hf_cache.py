"""DMACache: a transformers Cache whose layers store K/V quantized (dma_compile.kv_cache).

    out = model.generate(ids, **dma_compile.hf.cache_kwargs(model, dma_compile.hf.DMACache(model)),
                         max_new_tokens=64)

The model must use attn_implementation="dma" (`dma_compile.hf.register()`).
Each layer's cache stores tokens as its policy's `cache_k` / `cache_v` say;
the prefill runs the DMA prefill op on the prompt's own K/V, and every later
step reads the quantized storage through `torch.ops.dma.decode_attention`.
A padded batch's mask (causal with key padding) travels to the decode op as
a key-keep vector; steps with any other mask read the dequantized cache
through SDPA instead, logged once. A growing layer stores a left-padded
prompt without its padding (each row from its first real token), so a row's
sink slots hold its first real tokens, as they would without the padding;
the masks of later steps are translated to that storage (both layouts).

Two layouts:

- growing (default): each layer allocates 1024 tokens and doubles when full;
  eager only (it tracks lengths as Python ints).
- static (`max_cache_len=N`): N tokens per sequence allocated once, written
  at a position held in a tensor, read to its capacity by the decode kernel
  with per-sequence lengths, so the decode step is one fixed graph:
  `torch.compile(model.forward, mode="reduce-overhead")` captures it in a
  CUDA graph. Under torch.compile, a prefill (queries at least the policy's
  `min_q_len`) must start at position 0 (a device-side assertion; chunked
  prefill works eager only), and the masks are trusted to be causal with
  key padding, the prefill's with left padding only (what transformers
  builds for full-attention layers): compiled code cannot check them
  without a host sync.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from dma_compile.hf_config import NAME, checked_layers
from dma_compile.kv_cache import QuantizedKV, left_aligned, tokens_at
from dma_compile.policy import AttentionPolicy, ModelPolicy, as_model_policy, default_policy
from dma_compile.reference import decode_keep, mask_keeps

logger = logging.getLogger(__name__)

# Key under which a DMACache layer hands itself to the attention function:
# in the keyword arguments transformers passes to both (5.2x), or as an
# attribute of the key tensor update() returns (5.1x passes update() none).
CACHE_KWARG = "dma_cache_layer"
# Tokens a growing layer allocates at first, doubling when full.
_INITIAL_CAPACITY = 1024


@functools.lru_cache(maxsize=None)
def _log_fallback_once(reason: str) -> None:
    logger.warning("dma cache: attention runs stock SDPA: %s", reason)


def _repadded(x: torch.Tensor, lengths: torch.Tensor, pads: torch.Tensor, length: int) -> torch.Tensor:
    """x (B, H, L, D), row b's tokens stored from position 0, placed at
    positions pads[b] .. pads[b] + lengths[b] - 1 of (B, H, length, D), zeros elsewhere."""
    pos = torch.arange(length, device=x.device)[None, :] - pads[:, None].to(x.device)
    valid = (pos >= 0) & (pos < lengths[:, None].to(x.device))
    return tokens_at(x, pos.clamp(0, x.shape[2] - 1)) * valid[:, None, :, None]


def _key_keep_unpadded(keep: torch.Tensor, pads: torch.Tensor) -> torch.Tensor:
    """A (B, L) key-keep vector at the positions of storage without the left padding `pads`."""
    return keep.gather(1, left_aligned(pads.to(keep.device), keep.shape[1]))


class KeyPaddingMasks:
    """Turns a decode step's mask into the decode op's key-keep vector, once
    per step: every layer of a model receives the same mask tensor, so the
    check (one host sync) runs for the first layer only."""

    def __init__(self):
        self._last: tuple | None = None
        self._left: tuple | None = None

    def key_keep(
        self, attention_mask: torch.Tensor, lengths: torch.Tensor, t: int, pads: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Bool (B, L): the keys the mask's last query row keeps, if the mask
        (B, 1, T, L), boolean or additive, is exactly causal over `lengths`
        with that key padding; None for any other mask. pads (B,): the left
        padding a growing layer's storage left out (`left_padding`): the
        mask is checked over lengths + pads and the result is in the
        storage's positions (key j of row b is the mask's key j + pads[b])."""
        if self._last is not None and self._last[0] is attention_mask:
            return self._last[1]
        keep = mask_keeps(attention_mask)
        key_keep = None
        padded = lengths if pads is None else lengths + pads.to(lengths.dtype)
        if keep.dim() == 4 and keep.shape[1] == 1 and keep.shape[2] == t and keep.shape[0] == lengths.shape[0]:
            candidate = keep[:, 0, -1, :]
            if torch.equal(keep[:, 0], decode_keep(padded, t, keep.shape[-1], candidate)):
                key_keep = candidate.contiguous() if pads is None else _key_keep_unpadded(candidate, pads)
        self._last = (attention_mask, key_keep)
        return key_keep

    def left_padding(self, attention_mask: torch.Tensor, t: int) -> torch.Tensor | None:
        """(B,) int64: each row's leading masked keys, if the prefill mask
        (B, 1, t, t) is exactly causal with left padding only, some row is
        padded and none is all padding; None otherwise (the storage then
        keeps the padded positions). Once per mask, as `key_keep`."""
        if self._left is not None and self._left[0] is attention_mask:
            return self._left[1]
        keep = mask_keeps(attention_mask)
        pads = None
        if keep.dim() == 4 and keep.shape[1] == 1 and keep.shape[2] == t and keep.shape[3] == t:
            candidate = keep[:, 0, -1, :]
            counts = candidate.sum(dim=1)
            left = t - counts
            lengths = torch.full_like(counts, t)
            if (
                bool((left > 0).any())
                and bool((counts > 0).all())
                and torch.equal(candidate, torch.arange(t, device=keep.device)[None, :] >= left[:, None])
                and torch.equal(keep[:, 0], decode_keep(lengths, t, t, candidate))
            ):
                pads = left.long()
        self._left = (attention_mask, pads)
        return pads


def _hand_over(layer, key_states: torch.Tensor, kwargs: dict) -> torch.Tensor:
    """Let the attention function find `layer` (see CACHE_KWARG); returns the key states to pass on."""
    model_kwargs = kwargs.get("kwargs")
    if isinstance(model_kwargs, dict):
        model_kwargs[CACHE_KWARG] = layer
        return key_states
    key_states = key_states.view(key_states.shape)
    setattr(key_states, CACHE_KWARG, layer)
    return key_states


class _QuantizedLayer(CacheLayerMixin):
    """What both layouts share: the policy, the store, decoding over it."""

    is_sliding = False

    def __init__(self, policy: AttentionPolicy, masks: KeyPaddingMasks):
        super().__init__()
        self.policy = policy
        self.masks = masks
        self.store: QuantizedKV | None = None
        # (B,) left padding the store left out of each row (`prefill_seen`), or None.
        self.pads: torch.Tensor | None = None

    def _key_keep(self, attention_mask: torch.Tensor, t: int) -> torch.Tensor | None:
        return self.masks.key_keep(attention_mask, self.store.lengths, t, self.pads)

    def _stored_values(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The dequantized K and V at the mask's positions (the first `length`)."""
        values = self.store.values()
        if self.pads is None:
            return values
        return tuple(_repadded(x, self.store.lengths, self.pads, length) for x in values)

    def prefill_seen(self, attention_mask: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor):
        """The attention function's word that a prefill ran over key_states
        with attention_mask (sliced to its keys); nothing to do here."""

    def decode(self, module, query, attention_mask, scaling, impl, kwargs) -> torch.Tensor:
        """Attention output (B, T, Hq, D) of the newest tokens over this layer's cache."""
        key_keep = None
        if attention_mask is not None:
            key_keep = self._key_keep(attention_mask, query.shape[2])
            if key_keep is None:
                _log_fallback_once("a step whose mask is not causal with key padding reads the dequantized cache")
                k, v = (x.to(query.dtype) for x in self._stored_values(attention_mask.shape[-1]))
                mask = attention_mask[..., : k.shape[2]]
                return sdpa_attention_forward(module, query, k, v, mask, scaling=scaling, **kwargs)[0]
        decode_impl = impl if impl in ("auto", "reference") else "triton"
        return self.store.attend(query, scaling, decode_impl, key_keep).transpose(1, 2).contiguous()

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("DMACache does not support beam search yet")


class DMACacheLayer(_QuantizedLayer):
    """One layer of a growing DMACache: a `QuantizedKV` that doubles when full."""

    def __init__(self, policy: AttentionPolicy, masks: KeyPaddingMasks | None = None):
        super().__init__(policy, masks if masks is not None else KeyPaddingMasks())
        self.past_length = 0
        # Tokens seen, padding included (the store may leave a prompt's left padding out).
        self.seen = 0

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
        self.seen += key_states.shape[2]
        return _hand_over(self, key_states, kwargs), value_states

    def reads_cache(self, query: torch.Tensor) -> bool:
        """Whether this step attends over the cache (decode, chunked prefill)
        rather than over its own tokens alone (the prefill)."""
        return self.past_length > 0

    def prefill_seen(self, attention_mask: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor):
        """After the first prefill of a left-padded batch, store each row
        from its first real token: its sinks are then its first real tokens,
        as without the padding (the prompt is quantized once more)."""
        t = key_states.shape[2]
        if self.past_length > 0 or self.pads is not None or self.store.max_length != t:
            return
        pads = self.masks.left_padding(attention_mask, t)
        if pads is None:
            return
        front = left_aligned(pads, t)
        self.store.reset()
        self.store.append(tokens_at(key_states, front), tokens_at(value_states, front), num_tokens=t - pads)
        self.pads = pads

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def reset(self) -> None:
        if self.store is not None:
            self.store.reset()
        self.past_length = 0
        self.seen = 0
        self.pads = None


class DMAStaticCacheLayer(_QuantizedLayer):
    """One layer of a static DMACache: `max_cache_len` tokens per sequence,
    written at a position held in a tensor (see the module docstring)."""

    is_compileable = True

    def __init__(self, policy: AttentionPolicy, max_cache_len: int, masks: KeyPaddingMasks | None = None):
        super().__init__(policy, masks if masks is not None else KeyPaddingMasks())
        self.max_cache_len = max_cache_len
        # Tokens written so far, and where the step in progress started.
        self.position = torch.zeros((), dtype=torch.int64)
        self.start = torch.zeros((), dtype=torch.int64)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, d = key_states.shape
        self.store = QuantizedKV(b, h, d, self.max_cache_len, self.policy, key_states.dtype, key_states.device)
        # A static store is read to its capacity; its lengths say where each sequence ends.
        self.store.max_length = self.max_cache_len
        self.position = self.position.to(key_states.device)
        self.start = self.start.to(key_states.device)
        # Static: zeros until a left-padded prefill, updated in place.
        self.pads = torch.zeros(b, dtype=torch.int64, device=key_states.device)
        if not torch.compiler.is_compiling():
            # Fixed addresses: compiled graphs and CUDA graphs update them in place.
            for x in (*self.store.tensors(), self.position, self.start, self.pads):
                torch._dynamo.mark_static_address(x)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new tokens at the current position (less each row's left
        padding, `prefill_seen`); return them as they are."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.start.copy_(self.position)
        self.store.write_at(key_states, value_states, self.position, offsets=self.pads)
        self.position.add_(key_states.shape[2])
        return _hand_over(self, key_states, kwargs), value_states

    def prefill_seen(self, attention_mask: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor):
        """After a prefill from position 0 with left padding, write each row
        from its first real token (as the growing layout stores it). Eager
        code checks that the mask is causal with left padding only; compiled
        code trusts it (no host sync) and counts each row's leading masked
        keys of the last query row."""
        t = key_states.shape[2]
        if torch.compiler.is_compiling():
            keep = mask_keeps(attention_mask)[:, 0, -1, :]
            pads = t - keep.cumsum(dim=1).gt(0).sum(dim=1)
        else:
            if int(self.start) != 0:
                return
            pads = self.masks.left_padding(attention_mask, t)
            if pads is None:
                return
        self.store.write_at(key_states, value_states, self.start, offsets=torch.zeros_like(self.pads), skip=pads)
        self.pads.copy_(pads)

    def reads_cache(self, query: torch.Tensor) -> bool:
        """Decode steps (queries shorter than the policy's `min_q_len`) read
        the cache; so does a longer step that does not start at position 0
        (a chunked prefill), which eager code reads off the position. Compiled
        code cannot branch on it: there such a step fails an assertion on the
        device instead of attending to its own tokens alone."""
        if query.shape[2] < self.policy.min_q_len:
            return True
        if torch.compiler.is_compiling():
            torch._assert_async(self.start == 0, "a compiled prefill into a static DMACache must start at position 0")
            return False
        return int(self.start) > 0

    def _key_keep(self, attention_mask: torch.Tensor, t: int) -> torch.Tensor | None:
        if torch.compiler.is_compiling():
            return _key_keep_unpadded(mask_keeps(attention_mask)[:, 0, -1, :], self.pads)
        return super()._key_keep(attention_mask, t)

    def get_seq_length(self) -> torch.Tensor | int:
        return self.position if self.is_initialized else 0

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        if self.store is not None:
            self.store.lengths.zero_()
            self.pads.zero_()
        self.position.zero_()
        self.start.zero_()


class DMACache(Cache):
    """A transformers Cache whose layers store K/V quantized (see the module docstring).

    policy: a ModelPolicy, AttentionPolicy, policy string or JSON path, read for
    the cache fields of each layer; None: the device default with the FP8
    cache (cache_k = cache_v = "mxfp8_e4m3"). max_cache_len: None for the
    growing layout, or the tokens per sequence of the static one (prompt
    plus new tokens), for torch.compile.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        policy: ModelPolicy | str | os.PathLike | None = None,
        max_cache_len: int | None = None,
    ):
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if getattr(config, "_attn_implementation", None) != NAME:
            raise ValueError(
                f"DMACache needs a model loaded with attn_implementation={NAME!r} (after dma_compile.hf.register()), "
                f"got {getattr(config, '_attn_implementation', None)!r}"
            )
        if max_cache_len is not None and (
            isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1
        ):
            raise ValueError(f"max_cache_len must be None or an int >= 1, got {max_cache_len!r}")
        model_policy = as_model_policy(policy)
        if model_policy is None:
            device = next(model.parameters()).device
            fp8 = default_policy(device).replace(cache_k="mxfp8_e4m3", cache_v="mxfp8_e4m3")
            model_policy = ModelPolicy(default=fp8)
        layers = checked_layers(model_policy, config)
        masks = KeyPaddingMasks()
        if max_cache_len is None:
            built = [DMACacheLayer(model_policy.for_layer(i), masks) for i in range(layers)]
        else:
            built = [DMAStaticCacheLayer(model_policy.for_layer(i), max_cache_len, masks) for i in range(layers)]
        super().__init__(layers=built)
