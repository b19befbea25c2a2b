"""The KV cache's rotation pass: tokens rotated (dma_compile.rotation), in their dtype.

A policy that rotates and quantizes the cache's K (`AttentionPolicy.rotates_cache`)
stores every key rotated, and rotates each decode step's query once, so
the decode kernel reads the cache as it always does. One launch, whole
tokens per program; the rotation is `hadamard.rotate_rows`, bit-identical
to `rotation.rotate`, then nearest-even rounding to the output dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dma_compile.kernels.hadamard import rotate_rows, rotation_arguments
from dma_compile.kernels.launch import LAUNCH_OPTIONS
from dma_compile.kernels.numerics import HW_CVT, to_dtype, to_f32


@triton.jit
def _rotate_tokens_kernel(X, sx_t, sx_d, SIGNS, OUT, N, D: tl.constexpr, BLOCK_T: tl.constexpr,
                          INV_SQRT_D: tl.constexpr, HW_CVT: tl.constexpr):
    """Tokens (rows of X) pid * BLOCK_T ..., rotated, to OUT (N, D) contiguous."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    d = tl.arange(0, D)[None, :]
    ok = t < N
    x = to_f32(tl.load(X + t.to(tl.int64) * sx_t + d * sx_d, mask=ok, other=0.0), HW_CVT)
    y = rotate_rows(x, tl.load(SIGNS + (d + t * 0)), D, INV_SQRT_D)
    tl.store(OUT + t.to(tl.int64) * D + d, to_dtype(y, OUT.dtype.element_ty, HW_CVT), mask=ok)


def rotate_tokens(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x (..., D) rotated (rotation.rotate), rounded to x's dtype, contiguous."""
    signs, rotate, inv = rotation_arguments(x, kind)
    if not rotate:
        return x
    d = x.shape[-1]
    flat = x.reshape(-1, d)
    out = torch.empty(flat.shape, dtype=x.dtype, device=x.device)
    block_t = max(8, 2048 // d)
    _rotate_tokens_kernel[(triton.cdiv(flat.shape[0], block_t),)](
        flat, flat.stride(0), flat.stride(1), signs, out, flat.shape[0],
        D=d, BLOCK_T=block_t, INV_SQRT_D=inv, HW_CVT=HW_CVT, num_warps=4, **LAUNCH_OPTIONS,
    )
    return out.reshape(x.shape)
