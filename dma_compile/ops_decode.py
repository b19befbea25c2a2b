"""The KV-cache custom ops: `dma::decode_attention` and `dma::encode_cache_tokens`.

The second door to the kernels (beside `dma::attention` in ops.py), with
`dma::rotate_tokens`, the rotation a rotating policy applies to the keys it
stores and to each decode step's query (dma_compile.rotation).
`decode_attention` takes the tensors of a `dma_compile.kv_cache.QuantizedKV`
and picks the split-K decode kernel on CUDA, the reference
(cache_formats.stored_values, then reference.decode_attention_math) on the
CPU. On a GPU, a call the kernel cannot serve runs stock SDPA over the
dequantized cache, logged once. The cache formats travel in the policy
string, like the prefill op's policy. `encode_cache_tokens` writes tokens in
a cache format: the Triton quantization passes on CUDA (one launch, the
same bits), `cache_formats.encode` elsewhere.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
import torch.nn.functional as F

from dma_compile.cache_formats import encode, stored_values
from dma_compile.formats import E8M0_BIAS, E8M0_NAN
from dma_compile.policy import AttentionPolicy
from dma_compile.reference import decode_attention_math, decode_keep
from dma_compile.rotation import ROTATIONS, check_head_dim, rotate

logger = logging.getLogger(__name__)

IMPLS = ("auto", "reference", "triton")
ENCODED_FORMATS = ("mxfp8_e4m3", "mxfp4_e2m1")


@functools.lru_cache(maxsize=256)
def _parse_policy(text: str) -> AttentionPolicy:
    return AttentionPolicy.from_string(text)


@functools.lru_cache(maxsize=None)
def _warn_fallback_once(reason: str) -> None:
    logger.warning("dma decode: the kernel cannot serve this call, running SDPA on the dequantized cache: %s", reason)


def _dequantized_attention(q, kp, ks, vp, vs, hk, hv, lengths, key_keep, max_length, sink, recent, pol, scale, exact):
    common = (lengths, max_length, sink, recent)
    k = stored_values(kp, ks, hk, *common, pol.cache_k)
    v = stored_values(vp, vs, hv, *common, pol.cache_v)
    if exact:
        return decode_attention_math(q, k, v, lengths, scale, key_keep).to(q.dtype)
    keep = decode_keep(lengths, q.shape[2], max_length, key_keep)[:, None]
    out = F.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=keep, scale=scale, enable_gqa=True
    )
    return torch.where(keep.any(dim=-1, keepdim=True), out, 0.0) if key_keep is not None else out


@torch.library.custom_op("dma::decode_attention", mutates_args=())
def decode_attention_op(
    q: torch.Tensor,
    k_payload: torch.Tensor,
    k_scales: Optional[torch.Tensor],
    v_payload: torch.Tensor,
    v_scales: Optional[torch.Tensor],
    hi_k: Optional[torch.Tensor],
    hi_v: Optional[torch.Tensor],
    lengths: torch.Tensor,
    key_keep: Optional[torch.Tensor],
    max_length: int,
    sink: int,
    recent: int,
    policy: str,
    scale: Optional[float],
    impl: str,
) -> torch.Tensor:
    """Decode attention over cache tensors; see `decode_attention`."""
    pol = _parse_policy(policy)
    args = (q, k_payload, k_scales, v_payload, v_scales, hi_k, hi_v, lengths, key_keep, max_length, sink, recent)
    if impl == "auto":
        impl = "triton" if q.device.type == "cuda" else "reference"
    if impl == "reference":
        return _dequantized_attention(*args, pol, scale, exact=True)
    from dma_compile.kernels import Unsupported
    from dma_compile.kernels.decode import decode_attention as kernel

    try:
        return kernel(q, k_payload, k_scales, v_payload, v_scales, hi_k, hi_v, lengths, max_length, sink, recent,
                      pol.cache_k, pol.cache_v, scale, key_keep=key_keep)
    except Unsupported as e:
        if q.device.type != "cuda":
            raise
        _warn_fallback_once(str(e))
        return _dequantized_attention(*args, pol, scale, exact=False)


@decode_attention_op.register_fake
def _(q, k_payload, k_scales, v_payload, v_scales, hi_k, hi_v, lengths, key_keep, max_length, sink, recent, policy,
      scale, impl):
    return torch.empty_like(q)


def decode_attention(
    q: torch.Tensor,
    k_payload: torch.Tensor,
    k_scales: torch.Tensor | None,
    v_payload: torch.Tensor,
    v_scales: torch.Tensor | None,
    hi_k: torch.Tensor | None,
    hi_v: torch.Tensor | None,
    lengths: torch.Tensor,
    max_length: int,
    sink: int,
    recent: int,
    policy: AttentionPolicy,
    scale: float | None = None,
    impl: str = "auto",
    key_keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q (B, Hq, T, D), the T newest tokens of each sequence, over
    a cache laid out as `kv_cache.QuantizedKV` holds it (its tensors, lengths
    (B,) int32 including the T new tokens, max_length >= every length, its sink
    and recent token counts). impl: "auto" (kernel on CUDA, reference on CPU),
    "reference", or "triton" (the kernel, also on CPU under TRITON_INTERPRET=1).
    key_keep: None, or bool (B, L >= max_length) on q's device, False at the
    cached positions no query of the sequence sees (a key-padding mask); a
    query that sees no key outputs zeros, as SDPA does.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise ValueError("q must be a (batch, heads, tokens, head_dim) tensor")
    b, hq, t, d = q.shape
    if k_payload.shape[0] != b or hq % k_payload.shape[1] != 0:
        raise ValueError(
            f"q: batch {b} and heads {hq} must match the cache's batch {k_payload.shape[0]} and be a "
            f"multiple of its {k_payload.shape[1]} KV heads"
        )
    if lengths.shape != (b,) or lengths.dtype != torch.int32:
        raise ValueError(f"lengths must be int32 of shape ({b},), got {lengths.dtype} {tuple(lengths.shape)}")
    if t < 1 or t > max_length:
        raise ValueError(f"q: query length must be in 1..max_length ({max_length}), got {t}")
    if key_keep is not None and (
        not isinstance(key_keep, torch.Tensor) or key_keep.dtype != torch.bool or key_keep.dim() != 2
        or key_keep.shape[0] != b or key_keep.shape[1] < max_length or key_keep.device != q.device
    ):
        raise ValueError(
            f"key_keep must be a bool tensor of shape ({b}, >= max_length {max_length}) on {q.device}, got "
            + (f"{key_keep.dtype} {tuple(key_keep.shape)} on {key_keep.device}"
               if isinstance(key_keep, torch.Tensor) else type(key_keep).__name__)
        )
    stored = {x.dtype for x in (hi_k, k_payload, v_payload) if x is not None and x.is_floating_point()}
    if stored and stored != {q.dtype}:
        raise ValueError(f"q: dtype must be the cache's input dtype {stored.pop()}, got {q.dtype}")
    return torch.ops.dma.decode_attention(
        q, k_payload, k_scales, v_payload, v_scales, hi_k, hi_v, lengths, key_keep, int(max_length), int(sink),
        int(recent), policy.to_string(), None if scale is None else float(scale), impl,
    )


@torch.library.custom_op("dma::encode_cache_tokens", mutates_args=())
def encode_cache_tokens_op(x: torch.Tensor, fmt: str, scale_rule: str, impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(payload, scales) of tokens x (..., D); see `encode_cache_tokens`."""
    if impl == "auto":
        impl = "triton" if x.device.type == "cuda" else "reference"
    if impl == "reference":
        return encode(x, fmt, scale_rule)
    from dma_compile.kernels.quantize import quantize_tokens
    from dma_compile.kernels.quantize_mx import quantize_payloads

    flat = x.reshape(1, 1, -1, x.shape[-1])
    if fmt == "mxfp4_e2m1":
        op = quantize_payloads(flat, (fmt,), scale_rule)[fmt]
        return op.payload.reshape(*x.shape[:-1], -1), op.scales.reshape(*x.shape[:-1], -1)
    op = quantize_tokens(flat, (fmt,), "folded", scale_rule)[fmt]
    # A token with a NaN/Inf block has exponent 128 (formats.fold_mx): it reads back NaN.
    exps = op.exponents.reshape(x.shape[:-1])
    scales = torch.where(exps > E8M0_BIAS, E8M0_NAN, exps + E8M0_BIAS).to(torch.uint8)
    return op.values.view(torch.uint8).reshape(x.shape), scales


@encode_cache_tokens_op.register_fake
def _(x, fmt, scale_rule, impl):
    if fmt == "mxfp4_e2m1":
        return x.new_empty((*x.shape[:-1], x.shape[-1] // 2), dtype=torch.uint8), x.new_empty(
            (*x.shape[:-1], x.shape[-1] // 32), dtype=torch.uint8
        )
    return x.new_empty(x.shape, dtype=torch.uint8), x.new_empty(x.shape[:-1], dtype=torch.uint8)


def encode_cache_tokens(x: torch.Tensor, fmt: str, scale_rule: str = "rceil", impl: str = "auto"):
    """Tokens x (..., D) in cache format `fmt` (cache_formats): (payload, scales),
    or (x, None) for "none"."""
    if fmt == "none":
        return x, None
    if fmt not in ENCODED_FORMATS:
        raise ValueError(f"fmt must be one of {['none', *ENCODED_FORMATS]}, got {fmt!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
    d = x.shape[-1]
    if impl != "reference" and (d % 32 or d & (d - 1)):
        impl = "reference"  # the Triton passes take power-of-two head dims
    return torch.ops.dma.encode_cache_tokens(x.contiguous(), fmt, scale_rule, impl)


@torch.library.custom_op("dma::rotate_tokens", mutates_args=())
def rotate_tokens_op(x: torch.Tensor, kind: str, impl: str) -> torch.Tensor:
    """Tokens x (..., D) rotated, in x's dtype; see `rotate_tokens`."""
    if impl == "auto":
        impl = "triton" if x.device.type == "cuda" else "reference"
    if impl == "reference":
        return rotate(x, kind).to(x.dtype)
    from dma_compile.kernels.rotate import rotate_tokens as kernel

    return kernel(x, kind)


@rotate_tokens_op.register_fake
def _(x, kind, impl):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def rotate_tokens(x: torch.Tensor, kind: str, impl: str = "auto") -> torch.Tensor:
    """x (..., D) times the rotation `kind` (rotation.rotate: float32, then
    rounded to x's dtype), the same bits on every impl: "auto" (the Triton
    pass on CUDA, the reference elsewhere), "reference" or "triton"; x itself
    for "none"."""
    if kind not in ROTATIONS:
        raise ValueError(f"kind must be one of {list(ROTATIONS)}, got {kind!r}")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
    check_head_dim(x.shape[-1], kind)
    if kind == "none":
        return x
    return torch.ops.dma.rotate_tokens(x.contiguous(), kind, impl)
