"""Preallocated, quantized KV-cache storage of one attention layer.

A `QuantizedKV` holds a batch of sequences of up to `capacity` tokens each,
as `AttentionPolicy` says (cache_k, cache_v, sink_tiles * tile sink tokens,
recent_tokens): every appended token is written once in its cache format
(dma_compile.cache_formats), and the sinks and a ring of the most recent
tokens are written in the input dtype too. When a token leaves the recent
window nothing moves: its quantized copy is already there, and the decode
kernel simply stops reading the ring slot for it. With both formats "none"
there is no separate input-dtype part.

Appending quantizes through `torch.ops.dma.encode_cache_tokens` (formats.py's
rounding: the Triton quantization passes on CUDA). Sequences may have
different lengths: `append(..., num_tokens=)`.

A policy that rotates and quantizes K (`AttentionPolicy.rotates_cache`)
stores every key rotated (`ops_decode.rotate_tokens`, rounded to the input
dtype, its input-dtype copy too) and rotates each query once in `attend`:
scores are unchanged and the decode kernel needs nothing new. `values()`
returns K in the model's basis.
"""

from __future__ import annotations

import torch

from dma_compile import cache_formats
from dma_compile.ops_decode import decode_attention, encode_cache_tokens, rotate_tokens
from dma_compile.policy import AttentionPolicy, as_policy
from dma_compile.rotation import check_head_dim, unrotate


def _indexed(device: torch.device) -> torch.device:
    """device with its index: torch.device("cuda") as the current CUDA device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def left_aligned(skip: torch.Tensor, length: int) -> torch.Tensor:
    """(B, length) indices along a row of `length` that bring row b's entries
    from skip[b] on to the front (the last skip[b] repeat its last entry)."""
    return (torch.arange(length, device=skip.device)[None, :] + skip[:, None]).clamp(max=length - 1)


def tokens_at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D) at the per-row token indices index (B, n): (B, H, n, D)."""
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


class QuantizedKV:
    """KV cache of one layer: (batch, kv_heads, capacity, head_dim) in `policy`'s
    formats (payloads laid out as `cache_formats` says: V in e4m3 in key blocks)."""

    def __init__(
        self,
        batch: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        policy: AttentionPolicy | str | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ):
        self.policy = as_policy(policy) if policy is not None else AttentionPolicy()
        self.batch, self.kv_heads = _positive_int("batch", batch), _positive_int("kv_heads", kv_heads)
        self.head_dim, self.capacity = _positive_int("head_dim", head_dim), _positive_int("capacity", capacity)
        self.rotate = self.policy.rotate if self.policy.rotates_cache else "none"
        check_head_dim(head_dim, self.rotate, "head_dim")
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
        # "cuda" and "cuda:0" must compare equal to the tensors appended later.
        self.dtype, self.device = dtype, _indexed(torch.device(device))
        quantized = (self.policy.cache_k, self.policy.cache_v) != ("none", "none")
        self.sink = self.policy.sink_tiles * self.policy.tile if quantized else 0
        self.recent = self.policy.recent_tokens if quantized else 0
        self.k_payload, self.k_scales = self._alloc(self.policy.cache_k, "k")
        self.v_payload, self.v_scales = self._alloc(self.policy.cache_v, "v")
        slots = self.sink + self.recent
        shape = (batch, kv_heads, slots, head_dim)
        self.hi_k = torch.zeros(shape, dtype=dtype, device=self.device) if slots else None
        self.hi_v = torch.zeros(shape, dtype=dtype, device=self.device) if slots else None
        self.lengths = torch.zeros(batch, dtype=torch.int32, device=self.device)
        self.max_length = 0

    def _alloc(self, fmt: str, role: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        lead = (self.batch, self.kv_heads)
        stored = cache_formats.payload_store_shape(fmt, role, self.head_dim, self.capacity)
        payload = torch.zeros(*lead, *stored, dtype=self.dtype if fmt == "none" else torch.uint8, device=self.device)
        scales = cache_formats.scale_store_shape(fmt, self.head_dim, self.capacity)
        if scales is None:
            return payload, None
        return payload, torch.zeros(*lead, *scales, dtype=torch.uint8, device=self.device)

    def nbytes(self) -> int:
        """Bytes allocated, scales and the input-dtype part included."""
        tensors = (self.k_payload, self.k_scales, self.v_payload, self.v_scales, self.hi_k, self.hi_v)
        return sum(x.numel() * x.element_size() for x in tensors if x is not None)

    def _check(self, name: str, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} must be a (batch, kv_heads, tokens, head_dim) tensor")
        expected = (self.batch, self.kv_heads, self.head_dim)
        if (x.shape[0], x.shape[1], x.shape[3]) != expected:
            raise ValueError(f"{name}: (batch, kv_heads, head_dim) must be {expected}, got {tuple(x.shape)}")
        if x.dtype != self.dtype or _indexed(x.device) != self.device:
            raise ValueError(f"{name} must be {self.dtype} on {self.device}, got {x.dtype} on {x.device}")

    def _checked_keys(self, k: torch.Tensor, v: torch.Tensor, impl: str) -> torch.Tensor:
        """k as the cache stores it (rotated when the cache rotates), after checking k and v."""
        self._check("k", k)
        self._check("v", v)
        if k.shape != v.shape:
            raise ValueError(f"v: shape must match k's {tuple(k.shape)}, got {tuple(v.shape)}")
        return rotate_tokens(k, self.rotate, impl)

    def append(
        self, k: torch.Tensor, v: torch.Tensor, num_tokens: torch.Tensor | None = None, impl: str = "auto"
    ) -> None:
        """Write k, v (batch, kv_heads, T, head_dim) after each sequence's tokens.

        num_tokens (batch,): how many of the T tokens each sequence takes (the
        first ones); all T when None. impl: how tokens are quantized
        (`ops_decode.encode_cache_tokens`). With num_tokens None and T within
        the recent window (decode steps) nothing waits for the GPU.
        """
        k = self._checked_keys(k, v, impl)
        t = k.shape[2]
        step = torch.arange(t, device=self.device)
        if num_tokens is None and (self.hi_k is None or t <= self.recent):
            count = None
            new_max = self.max_length + t
            bi = torch.arange(self.batch, device=self.device)[:, None].expand(self.batch, t)
            ti = step[None, :].expand(self.batch, t)
        else:
            count = torch.full((self.batch,), t, device=self.device) if num_tokens is None else num_tokens.to(self.device)
            if count.shape != (self.batch,) or bool(((count < 0) | (count > t)).any()):
                raise ValueError(f"num_tokens must be (batch,) = ({self.batch},) values in 0..{t}")
            new_max = int((self.lengths + count).max())
            bi, ti = (step[None, :] < count[:, None]).nonzero(as_tuple=True)
        if new_max > self.capacity:
            raise ValueError(f"the cache holds {self.capacity} tokens per sequence; appending would need {new_max}")
        p = self.lengths[bi].long() + ti
        for x, fmt, payload, scales in (
            (k, self.policy.cache_k, self.k_payload, self.k_scales),
            (v, self.policy.cache_v, self.v_payload, self.v_scales),
        ):
            enc, sc = encode_cache_tokens(x[bi, :, ti], fmt, self.policy.scale_rule, impl)
            cache_formats.write_tokens(payload, enc, p, bi)
            if sc is not None:
                scales[bi, :, p] = sc
        if self.hi_k is not None:
            if count is not None:
                # The sinks, and the last `recent` new tokens (older ones would share ring slots).
                keep = (p < self.sink) | (ti >= count[bi] - self.recent)
                bi, ti, p = bi[keep], ti[keep], p[keep]
            slot = cache_formats.high_slots(p, self.sink, self.recent)
            self.hi_k[bi, :, slot] = k[bi, :, ti]
            self.hi_v[bi, :, slot] = v[bi, :, ti]
        self.lengths += t if count is None else count.to(torch.int32)
        self.max_length = max(self.max_length, new_max)

    def write_at(
        self, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, impl: str = "auto",
        offsets: torch.Tensor | None = None, skip: torch.Tensor | None = None,
    ) -> None:
        """Write k, v (batch, kv_heads, T, head_dim) at positions start .. start
        + T - 1 of every sequence and set every length to start + T; start is
        a 0-d integer tensor on the cache's device.

        offsets (batch,): each row's positions are start - offsets[row] on
        (the padding left out of it so far); skip (batch,): the first
        skip[row] of the T tokens are left out (padding): the kept ones move
        to the front, and the rest, written past the row's new length, is
        never read. Lengths then become start - offsets + T - skip.

        Tensor operations only, no host sync and no Python state (max_length
        is left as it is), so a static cache's step can run inside a compiled
        graph or a CUDA graph. Positions past the capacity are not checked."""
        k = self._checked_keys(k, v, impl)
        t, dev = k.shape[2], self.device
        zeros = torch.zeros(self.batch, dtype=torch.long, device=dev)
        kept = t - (zeros if skip is None else skip.to(dev, torch.long))
        if skip is not None:
            front = left_aligned(skip.to(dev, torch.long), t)
            k, v = tokens_at(k, front), tokens_at(v, front)
        base = start - (zeros if offsets is None else offsets.to(dev, torch.long))
        rows = torch.arange(self.batch, device=dev)[:, None]
        # Every written token's position and row, flattened in (row, token) order.
        p = (base[:, None] + torch.arange(t, device=dev)[None, :]).reshape(-1)
        bi = rows.expand(self.batch, t).reshape(-1)
        for x, fmt, payload, scales in (
            (k, self.policy.cache_k, self.k_payload, self.k_scales),
            (v, self.policy.cache_v, self.v_payload, self.v_scales),
        ):
            enc, sc = encode_cache_tokens(x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]), fmt,
                                          self.policy.scale_rule, impl)
            cache_formats.write_tokens(payload, enc, p, bi)
            if sc is not None:
                scales[bi, :, p] = sc
        if self.hi_k is not None:
            for x, hi in ((k, self.hi_k), (v, self.hi_v)):
                if t > self.recent and self.sink:
                    # Sink slot s of row r takes the row's kept token s - base[r], if
                    # there is one (a shorter step's tokens all go through the ring below).
                    token_index = torch.arange(self.sink, device=dev)[None, :] - base[:, None]
                    mine = (token_index >= 0) & (token_index < kept[:, None])
                    token = tokens_at(x, token_index.clamp(0, t - 1))
                    hi[:, :, : self.sink] = torch.where(mine[:, None, :, None], token, hi[:, :, : self.sink])
                n = min(t, self.recent)
                if n:
                    # Each row's last n kept tokens, the recent window's new state.
                    # Where a row kept fewer, the extra entries repeat its last
                    # kept one (same slot, same value: no two writes to one slot
                    # differ), or, keeping none, write a slot's own value back.
                    last = kept[:, None] - n + torch.arange(n, device=dev)[None, :]
                    last = torch.where(last >= 0, last, kept[:, None] - 1)
                    slot = cache_formats.high_slots(base[:, None] + last, self.sink, self.recent).clamp(min=0)
                    new = x[rows, :, last.clamp(min=0)]
                    old = hi[rows, :, slot]
                    hi[rows, :, slot] = torch.where((last >= 0)[:, :, None, None], new, old)
        self.lengths.copy_((base + kept).to(torch.int32))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor the cache holds (payloads, scales, the input-dtype part, lengths)."""
        held = (self.k_payload, self.k_scales, self.v_payload, self.v_scales, self.hi_k, self.hi_v, self.lengths)
        return tuple(x for x in held if x is not None)

    def grow(self, capacity: int) -> None:
        """Reallocate to hold `capacity` tokens per sequence, keeping the contents."""
        if _positive_int("capacity", capacity) < self.max_length:
            raise ValueError(f"capacity must be >= the cached length {self.max_length}, got {capacity}")
        old = {name: getattr(self, name) for name in ("k_payload", "k_scales", "v_payload", "v_scales")}
        self.capacity = capacity
        self.k_payload, self.k_scales = self._alloc(self.policy.cache_k, "k")
        self.v_payload, self.v_scales = self._alloc(self.policy.cache_v, "v")
        n = self.max_length
        for name, x in old.items():
            if x is not None:
                rows = cache_formats.stored_rows(x, n)
                getattr(self, name)[:, :, :rows] = x[:, :, :rows]

    def values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as the cache holds them, float32 (batch, kv_heads, max_length,
        head_dim); K rotated back to the model's basis when the cache rotates."""
        common = (self.lengths, self.max_length, self.sink, self.recent)
        k = cache_formats.stored_values(self.k_payload, self.k_scales, self.hi_k, *common, self.policy.cache_k)
        v = cache_formats.stored_values(self.v_payload, self.v_scales, self.hi_v, *common, self.policy.cache_v)
        return unrotate(k, self.rotate), v

    def attend(
        self, q: torch.Tensor, scale: float | None = None, impl: str = "auto", key_keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Attention of q (batch, heads, T, head_dim), the T tokens appended last,
        over the cache, through `torch.ops.dma.decode_attention` (q rotated
        first when the cache rotates); key_keep (batch, >= max_length) bool
        leaves out the positions it marks False (`ops_decode.decode_attention`)."""
        if isinstance(q, torch.Tensor) and q.dim() == 4 and self.max_length < q.shape[2]:
            raise ValueError(f"q: {q.shape[2]} query tokens but the cache holds at most {self.max_length}")
        if isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[-1] == self.head_dim:
            q = rotate_tokens(q, self.rotate, impl)
        return decode_attention(
            q, self.k_payload, self.k_scales, self.v_payload, self.v_scales, self.hi_k, self.hi_v,
            self.lengths, self.max_length, self.sink, self.recent, self.policy, scale, impl, key_keep,
        )

    def reset(self) -> None:
        self.lengths.zero_()
        self.max_length = 0
