"""How the KV cache stores one token: encoding to, and decoding from, its bytes.

The cache formats of `AttentionPolicy.cache_k` / `cache_v`, per token (one
row of `head_dim` values):

- "none": the input dtype, as given; no scales.
- "mxfp8_e4m3": folded MXFP8 (`formats.fold_mx`): `head_dim` e4m3 bytes and
  one uint8 per token holding the power-of-two exponent A biased by 127; the
  value is `e4m3 * 2^A`. 255 marks a token with NaN or Inf (it reads NaN).
- "mxfp4_e2m1": MX (`formats.quantize_mx`): `head_dim / 2` bytes of packed
  e2m1 codes (even index in the low nibble) and one E8M0 scale per 32.

Decoding is exact in bf16/fp16 (an e4m3 or e2m1 value times a power of two)
except far outside their normal ranges. The decode kernel reads these bytes
directly; this module is the ground truth it is tested against.

Where a store keeps the tokens' payloads: token after token, (B, H, capacity,
bytes), except V in e4m3 from head_dim `KEY_BLOCKS_FROM_HEAD_DIM`, kept in
blocks of `KEY_BLOCK` tokens with each block's channels in rows, (B, H,
blocks, head_dim, KEY_BLOCK). P·V's operand takes pairs of keys per channel:
from token rows the decode kernel gathers them byte by byte, from key blocks
it loads whole vectors but converts their layout through shared memory,
which at smaller head_dims costs more than the gathers it saves
(BENCHMARKS.md, decode). A payload's rank says which layout it has
(`tokens`, `write_tokens`).
"""

from __future__ import annotations

import torch

from dma_compile.formats import BLOCK_SIZE, E8M0_BIAS, E8M0_NAN, MXTensor, fold_mx, quantize_mx

FORMATS = ("none", "mxfp8_e4m3", "mxfp4_e2m1")


def _check(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"cache format must be one of {list(FORMATS)}, got {fmt!r}")


def payload_shape(fmt: str, head_dim: int) -> tuple[int, int]:
    """(payload bytes or elements, scale bytes) per token."""
    _check(fmt)
    if fmt == "none":
        return head_dim, 0
    if head_dim % BLOCK_SIZE:
        raise ValueError(f"head_dim must be a multiple of {BLOCK_SIZE} for cache format {fmt}, got {head_dim}")
    if fmt == "mxfp8_e4m3":
        return head_dim, 1
    return head_dim // 2, head_dim // BLOCK_SIZE


KEY_BLOCK = 32
KEY_BLOCKS_FROM_HEAD_DIM = 128


def in_key_blocks(fmt: str, role: str, head_dim: int) -> bool:
    """Whether a store of `role` ("k" or "v") in `fmt` keeps its payload in key blocks."""
    return role == "v" and fmt == "mxfp8_e4m3" and head_dim >= KEY_BLOCKS_FROM_HEAD_DIM


def payload_store_shape(fmt: str, role: str, head_dim: int, capacity: int) -> tuple[int, ...]:
    """The payload tensor's shape after (batch, heads) for `capacity` tokens."""
    elems, _ = payload_shape(fmt, head_dim)
    if in_key_blocks(fmt, role, head_dim):
        return (-(-capacity // KEY_BLOCK), elems, KEY_BLOCK)
    return (capacity, elems)


def scale_store_shape(fmt: str, head_dim: int, capacity: int) -> tuple[int, ...] | None:
    """The scale tensor's shape after (batch, heads) for `capacity` tokens, or
    None for a format without scales (e4m3: one byte per token)."""
    _, scales = payload_shape(fmt, head_dim)
    if scales == 0:
        return None
    return (capacity,) if fmt == "mxfp8_e4m3" else (capacity, scales)


def stored_rows(payload: torch.Tensor, n: int) -> int:
    """How many leading rows (tokens, or key blocks) of a payload hold its first n tokens."""
    return -(-n // KEY_BLOCK) if payload.dim() == 5 else n


def tokens(payload: torch.Tensor) -> torch.Tensor:
    """A store's payload token after token, (B, H, tokens, bytes): itself, or
    a copy of a key-block store (all its blocks' tokens)."""
    if payload.dim() == 5:
        return payload.transpose(-1, -2).flatten(2, 3)
    return payload


def write_tokens(payload: torch.Tensor, encoded: torch.Tensor, positions: torch.Tensor,
                 batch_index: torch.Tensor | None = None) -> None:
    """Store encoded tokens at `positions` of a payload, in place.

    batch_index None: every sequence, encoded (B, H, len(positions), bytes);
    else token i goes to sequence batch_index[i] at positions[i], encoded (n, H, bytes).
    Tensor operations only (no host sync), so it records into CUDA graphs."""
    if payload.dim() == 5:
        block, slot = positions // KEY_BLOCK, positions % KEY_BLOCK
        if batch_index is None:
            # Advanced indices apart put their dimension first: (tokens, B, H, bytes).
            payload[:, :, block, :, slot] = encoded.permute(2, 0, 1, 3)
        else:
            payload[batch_index, :, block, :, slot] = encoded
    elif batch_index is None:
        payload.index_copy_(2, positions, encoded)
    else:
        payload[batch_index, :, positions] = encoded


def bytes_per_token(fmt: str, head_dim: int, input_dtype: torch.dtype) -> int:
    """Storage bytes of one token of one head, scales included."""
    elems, scales = payload_shape(fmt, head_dim)
    return elems * (input_dtype.itemsize if fmt == "none" else 1) + scales


def encode(x: torch.Tensor, fmt: str, scale_rule: str = "rceil") -> tuple[torch.Tensor, torch.Tensor | None]:
    """(payload, scales) of tokens `x` (..., head_dim); scales is None for "none"."""
    _check(fmt)
    if fmt == "none":
        return x, None
    mx = quantize_mx(x, fmt, scale_rule)
    if fmt == "mxfp4_e2m1":
        return mx.payload, mx.scales
    elem, a = fold_mx(mx)
    bad = (mx.scales == E8M0_NAN).any(dim=-1)
    scales = torch.where(bad, E8M0_NAN, a + E8M0_BIAS).to(torch.uint8)
    return elem.to(torch.float8_e4m3fn).view(torch.uint8), scales


def decode(payload: torch.Tensor, scales: torch.Tensor | None, fmt: str, head_dim: int) -> torch.Tensor:
    """The values stored tokens represent, as float32 (..., head_dim)."""
    _check(fmt)
    if fmt == "none":
        return payload.float()
    if fmt == "mxfp4_e2m1":
        return MXTensor(payload, scales, fmt, torch.Size((*payload.shape[:-1], head_dim))).dequantize()
    exp = scales.to(torch.int32) - E8M0_BIAS
    out = torch.ldexp(payload.view(torch.float8_e4m3fn).float(), exp.unsqueeze(-1).float())
    return torch.where((scales == E8M0_NAN).unsqueeze(-1), float("nan"), out)


def high_slots(positions: torch.Tensor, sink: int, recent: int) -> torch.Tensor:
    """Slot of each position in a store's input-dtype part: the sinks at their
    positions, the recent window a ring after them."""
    if recent == 0:
        return positions
    return torch.where(positions < sink, positions, sink + positions % recent)


def stored_values(
    payload: torch.Tensor,
    scales: torch.Tensor | None,
    high: torch.Tensor | None,
    lengths: torch.Tensor,
    max_length: int,
    sink: int,
    recent: int,
    fmt: str,
) -> torch.Tensor:
    """Float32 (B, H, max_length, D) values a store (dma_compile.kv_cache) holds.

    payload/scales: every position in `fmt` (payload in either layout); high (B, H, sink + recent, D) or
    None: the sinks and recent window in the input dtype, which win where they
    apply (position < sink or >= lengths[b] - recent). Positions past a
    sequence's length read whatever is stored there.
    """
    payload = tokens(payload[:, :, : stored_rows(payload, max_length)])
    head_dim = payload.shape[-1] * (2 if fmt == "mxfp4_e2m1" else 1)
    scales = None if scales is None else scales[:, :, :max_length]
    out = decode(payload[:, :, :max_length], scales, fmt, head_dim)
    if high is None:
        return out
    pos = torch.arange(max_length, device=payload.device)
    hi = high[:, :, high_slots(pos, sink, recent).clamp(max=high.shape[2] - 1)].float()
    use = (pos[None, :] < sink) | ((pos[None, :] >= lengths[:, None] - recent) & (recent > 0))
    return torch.where(use[:, None, :, None], hi, out)
