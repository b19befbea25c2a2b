"""The `dma::attention` custom op and its Python entry `dma_attention`.

This is the single door to the kernels: everything above (the compile
backend, the transformers integration, calibration) calls the op, and the op
picks the implementation by device: the sm_100 kernel on Blackwell, the sm_90
kernel on Hopper, the reference elsewhere. The policy travels as a string
argument so compiled-graph caches see it.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
import torch.nn.functional as F

from dma_compile.policy import AttentionPolicy, as_policy
from dma_compile.reference import dma_attention_reference

logger = logging.getLogger(__name__)

IMPLS = ("auto", "reference", "sm90", "sm90_gluon", "sm100")
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
REFERENCE_ONLY_DTYPES = (torch.float64,)


@functools.lru_cache(maxsize=256)
def _parse_policy(text: str) -> AttentionPolicy:
    return AttentionPolicy.from_string(text)


def _auto_impl(q: torch.Tensor) -> str:
    if q.device.type != "cuda":
        return "reference"
    major, _ = torch.cuda.get_device_capability(q.device)
    return {9: "sm90", 10: "sm100"}.get(major, "reference")


@functools.lru_cache(maxsize=None)
def _warn_fallback_once(reason: str) -> None:
    logger.warning("dma attention: using the PyTorch reference instead of the kernel: %s", reason)


def _kernel(impl: str):
    if impl == "sm90_gluon":
        from dma_compile.kernels.attention_sm90_gluon import attention_sm90_gluon

        return attention_sm90_gluon
    if impl == "sm90":
        from dma_compile.kernels.attention_sm90 import attention_sm90

        return attention_sm90
    from dma_compile.kernels.attention_sm100 import attention_sm100

    return attention_sm100


# flexible_layout: Inductor may hand the op any strides, so every layer of a
# compiled model shares one mask buffer (and one cached mask classification).
@torch.library.custom_op("dma::attention", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    is_causal: bool,
    scale: Optional[float],
    policy: str,
    impl: str,
) -> torch.Tensor:
    """DMA attention on validated SDPA-style inputs; see `dma_attention`."""
    pol = _parse_policy(policy)
    if impl == "auto":
        if q.shape[-2] < pol.min_q_len:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
            )
        impl = _auto_impl(q)
        if impl != "reference":
            from dma_compile.kernels import Unsupported

            try:
                return _kernel(impl)(q, k, v, attn_mask, is_causal, scale, pol)
            except Unsupported as e:
                _warn_fallback_once(str(e))
                impl = "reference"
    if impl == "reference":
        return dma_attention_reference(q, k, v, attn_mask, is_causal, scale, pol).contiguous()
    return _kernel(impl)(q, k, v, attn_mask, is_causal, scale, pol)


@attention.register_fake
def _(q, k, v, attn_mask, is_causal, scale, policy, impl):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def _check_tensor(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must have 4 dimensions (batch, heads, length, head_dim), got shape {tuple(x.shape)}")


def check_inputs(q, k, v, attn_mask, is_causal, scale, policy: AttentionPolicy, impl: str) -> None:
    """Raise ValueError naming the offending argument for anything the op does not accept."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    accepted = INPUT_DTYPES + (REFERENCE_ONLY_DTYPES if impl == "reference" else ())
    if q.dtype not in accepted:
        raise ValueError(f"q: dtype must be one of {[str(d) for d in accepted]} with impl={impl!r}, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k, v: dtype must match q's ({q.dtype}), got k {k.dtype} and v {v.dtype}")
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    b, hq, lq, d = q.shape
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"k, v: batch size must match q's ({b}), got {k.shape[0]} and {v.shape[0]}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"v: (batch, heads, length) must match k's {tuple(k.shape[:3])}, got {tuple(v.shape[:3])}")
    if k.shape[-1] != d:
        raise ValueError(f"k: head_dim must match q's ({d}), got {k.shape[-1]}")
    if hq % k.shape[1] != 0:
        raise ValueError(f"k: the number of KV heads ({k.shape[1]}) must divide q's heads ({hq})")
    if lq == 0 or k.shape[2] == 0:
        raise ValueError(f"q, k: sequence lengths must be positive, got {lq} and {k.shape[2]}")
    if policy.uses_mx and d % 32 != 0:
        raise ValueError(
            f"q: head_dim must be a multiple of 32 for MX formats (policy hi={policy.hi}, lo={policy.lo}), got {d}"
        )
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise ValueError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            raise ValueError(f"attn_mask: dtype must be bool or floating point, got {attn_mask.dtype}")
        if attn_mask.device != q.device:
            raise ValueError(f"attn_mask must be on q's device ({q.device}), got {attn_mask.device}")
        try:
            torch.broadcast_shapes(attn_mask.shape, (b, hq, lq, k.shape[2]))
        except RuntimeError:
            raise ValueError(
                f"attn_mask: shape {tuple(attn_mask.shape)} is not broadcastable to (B, Hq, Lq, Lk) = "
                f"{(b, hq, lq, k.shape[2])}"
            ) from None
        if is_causal:
            raise ValueError("attn_mask and is_causal=True cannot be used together (as in SDPA)")
    if not isinstance(is_causal, bool):
        raise ValueError(f"is_causal must be a bool, got {is_causal!r}")
    if scale is not None and not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a float or None, got {scale!r}")
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        raise ValueError(
            "q, k, v: DMA attention has no backward yet; call it under torch.no_grad() or "
            "torch.inference_mode(), or on tensors that do not require grad"
        )


def dma_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    policy: AttentionPolicy | str | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Drop-in for `F.scaled_dot_product_attention` (no dropout) running DMA.

    policy: an AttentionPolicy, its string form or a preset name; None takes
    the device's default. impl: "auto" picks the kernel for the GPU (or the
    reference on CPU and other GPUs); "reference", "sm90" and "sm100" force
    one, the kernels also on CPU tensors under TRITON_INTERPRET=1. GQA is
    served whenever q's heads are a multiple of k's.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
    pol = as_policy(policy, q.device if isinstance(q, torch.Tensor) else None)
    check_inputs(q, k, v, attn_mask, is_causal, scale, pol, impl)
    return torch.ops.dma.attention(
        q, k, v, attn_mask, is_causal, None if scale is None else float(scale), pol.to_string(), impl
    )
