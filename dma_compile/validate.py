"""Argument checks of `torch.ops.dma.attention`, shared by every door to it.

The op runs `check_inputs` itself, in its real kernel and in its fake one, so
`dma_attention` and a direct `torch.ops.dma.attention` call raise the same
`ValueError` naming the argument, and the compile pass and the transformers
integration, which serve such calls with stock SDPA, log the same reasons.

Under torch.compile the fake kernel sees symbolic sizes: a size check raises
there only when the sizes provably break the rule (asking more would add
guards after Dynamo has built them), and the real kernel repeats every check
on the actual sizes at run time. K and V lengths that come from two symbols
(K and V of a KV cache) are checked that way.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dma_compile.formats import BLOCK_SIZE
from dma_compile.policy import AttentionPolicy
from dma_compile.rotation import is_power_of_two

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
REFERENCE_DTYPES = INPUT_DTYPES + (torch.float64,)


def _known(condition) -> bool:
    """Whether `condition` (a bool, or a SymBool of a graph being compiled) provably holds."""
    return condition if type(condition) is bool else statically_known_true(condition)


def check_arguments(q, k, v, attn_mask, is_causal, scale) -> None:
    """The checks of argument kinds alone: what the op's schema would refuse less clearly."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        raise ValueError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    if not isinstance(is_causal, bool):
        raise ValueError(f"is_causal must be a bool, got {is_causal!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float, torch.SymFloat))):
        raise ValueError(f"scale must be a float or None, got {scale!r}")


def _check_mask(attn_mask: torch.Tensor, is_causal: bool, q: torch.Tensor, target: tuple) -> None:
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise ValueError(f"attn_mask: dtype must be bool or floating point, got {attn_mask.dtype}")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask must be on q's device ({q.device}), got {attn_mask.device}")
    shape = tuple(attn_mask.shape)
    if len(shape) > 4 or any(
        _known(m != 1) and _known(m != t) for m, t in zip(reversed(shape), reversed(target))
    ):
        raise ValueError(f"attn_mask: shape {shape} is not broadcastable to (B, Hq, Lq, Lk) = {target}")
    if is_causal:
        raise ValueError(
            "attn_mask and is_causal=True cannot be used together: SDPA documents the pair as an error "
            "(its math backend raises; only its CPU flash kernel accepts it); fold the causal rule into attn_mask"
        )


def check_inputs(q, k, v, attn_mask, is_causal, scale, policy: AttentionPolicy, impl: str) -> None:
    """Raise ValueError naming the offending argument for anything the op does not accept."""
    check_arguments(q, k, v, attn_mask, is_causal, scale)
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape
    for name, shape in (("q", q_shape), ("k", k_shape), ("v", v_shape)):
        if len(shape) != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, heads, length, head_dim), got shape {tuple(shape)}")
    dtype = q.dtype
    accepted = REFERENCE_DTYPES if impl == "reference" else INPUT_DTYPES
    if dtype not in accepted:
        raise ValueError(f"q: dtype must be one of {[str(d) for d in accepted]} with impl={impl!r}, got {dtype}")
    if k.dtype != dtype or v.dtype != dtype:
        raise ValueError(f"k, v: dtype must match q's ({dtype}), got k {k.dtype} and v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    b, hq, lq, d = q_shape
    _, hkv, lk, _ = k_shape
    if _known(k_shape[0] != b) or _known(v_shape[0] != b):
        raise ValueError(f"k, v: batch size must match q's ({b}), got {k_shape[0]} and {v_shape[0]}")
    if _known(v_shape[1] != hkv) or _known(v_shape[2] != lk):
        raise ValueError(f"v: (batch, heads, length) must match k's {tuple(k_shape[:3])}, got {tuple(v_shape[:3])}")
    if _known(k_shape[3] != d):
        raise ValueError(f"k: head_dim must match q's ({d}), got {k_shape[3]}")
    if _known(hkv == 0):
        if not _known(hq == 0):
            raise ValueError(f"k: the number of KV heads must be positive (q has {hq} heads), got 0")
    elif _known(hq % hkv != 0):
        raise ValueError(f"k: the number of KV heads ({hkv}) must divide q's heads ({hq})")
    if policy.uses_mx and _known(d % BLOCK_SIZE != 0):
        raise ValueError(
            f"q: head_dim must be a multiple of {BLOCK_SIZE} for MX formats (policy hi={policy.hi}, lo={policy.lo}), got {d}"
        )
    if policy.uses_mx and policy.rotate != "none" and isinstance(d, int) and not is_power_of_two(d):
        raise ValueError(
            f"q: head_dim must be a power of two (64, 128, 256, ...) for policy rotate={policy.rotate}, got {d}; "
            "use rotate=none for this layer"
        )
    if attn_mask is not None:
        _check_mask(attn_mask, is_causal, q, (b, hq, lq, lk))
    if (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled():
        raise ValueError(
            "q, k, v: DMA attention has no backward yet; call it under torch.no_grad() or "
            "torch.inference_mode(), or on tensors that do not require grad"
        )
