"""The Hadamard rotation of `dma_compile.rotation` as a Triton kernel step.

`rotate_rows` rotates a block of whole tokens held in registers, in the
same float32 operations and order as `rotation.rotate` (signs, log2(D)
butterfly stages, one multiply by 1 / sqrt(D)), so it gives the same bits;
the quantization passes (quantize.py, quantize_mx.py) call it between K
smoothing and MX quantization. Stage s views each row as (D / 2s, 2, s),
brings the pair axis last (a free transpose of the layout), splits it into
(a, b) and joins (a + b, a - b) back in place. Stages whose pairs lie in one
thread's registers stay there; the compiler moves data between threads only
for the wider ones (compiled for sm_90: no spills; the share of the pass it
costs is measured by benchmarks/bench_attention.py --rotate).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dma_compile.rotation import check_head_dim, inverse_sqrt, sign_vector


@triton.jit
def _butterfly(x, D: tl.constexpr):
    """Unnormalized Walsh–Hadamard transform of each row of float32 x (T, D)."""
    T: tl.constexpr = x.shape[0]
    for stage in tl.static_range(16):
        if (1 << stage) < D:
            pairs = tl.reshape(x, [T, D // (2 << stage), 2, 1 << stage])
            a, b = tl.split(tl.permute(pairs, [0, 1, 3, 2]))
            x = tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [T, D])
    return x


@triton.jit
def rotate_rows(x, signs, D: tl.constexpr, INV_SQRT_D: tl.constexpr):
    """x (T, ..., D in its trailing dims) times the rotation with sign vector
    `signs` (x's shape): signs, butterfly, normalization, as rotation.rotate."""
    shape: tl.constexpr = x.shape
    y = _butterfly(tl.reshape(x * signs, [shape[0], D]), D)
    return tl.reshape(y, shape) * INV_SQRT_D


@functools.lru_cache(maxsize=None)
def inverse_sqrt_constant(d: int) -> float:
    """float(inverse_sqrt(d)): a float32 value, so Triton's float32 constant holds it exactly."""
    return float(inverse_sqrt(d))


def rotation_arguments(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, bool, float]:
    """(SIGNS, ROTATE, INV_SQRT_D) kernel arguments of the passes for x (..., D)."""
    d = x.shape[-1]
    check_head_dim(d, kind)
    if kind == "none":
        return x, False, 1.0
    return sign_vector(d, kind, x.device), True, inverse_sqrt_constant(d)
