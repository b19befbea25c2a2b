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
