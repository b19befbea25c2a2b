"""The Hadamard rotation of `dma_compile.rotation` as a Triton kernel step.

`rotate_rows` rotates a block of whole tokens held in registers, in the
same float32 operations and order as `rotation.rotate` (signs, log2(D)
butterfly stages, one multiply by 1 / sqrt(D)), so it gives the same bits;
the quantization passes (quantize.py, quantize_mx.py) call it between K
smoothing and MX quantization, and kernels/rotate.py on its own.

Two forms of the stages, the same additions in the same order:

- general: stage s views each row as (D / 2s, 2, s), brings the pair axis
  last (a free transpose of the layout), splits it into (a, b) and joins
  (a + b, a - b) back in place. The split needs the pair in one thread, so
  every stage whose pair the layout spreads over threads costs a layout
  conversion through shared memory;
- blocks in registers (`IN_THREAD`, for x of shape (T, D / 32, 32), the
  token pass with 64 tokens per program): stage s views x with the pair as
  an axis of size 2; each element takes its partner along it (`tl.flip`:
  free over registers, one shuffle over lanes) and adds itself times +1 or
  -1. The result keeps x's layout: no conversion, no shared memory. How
  many stages cross lanes is Triton's layout choice:
  Triton 3.6 gives each thread half of every block of one token (one
  stage crosses lanes), Triton 3.9 half of one block of four tokens (three
  stages do, about three times the shuffles; offline SASS, sm_90a, D 128).
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
def _pair_sums(p, AXIS: tl.constexpr):
    """(a + b, a - b) in place of each pair (a, b) along axis AXIS (2 or 3, size 2) of p (5-D).

    Each element takes its partner (`tl.flip`: over lanes one shuffle, over
    registers none) and adds itself times +1 (a) or -1 (b): b + a and
    a + (-b), each one correctly rounded addition, as rotation.rotate's."""
    if AXIS == 2:
        i = tl.arange(0, 2)[None, None, :, None, None]
    else:
        i = tl.arange(0, 2)[None, None, None, :, None]
    return tl.flip(p, AXIS) + p * (1 - 2 * i).to(tl.float32)


@triton.jit
def _butterfly_blocks(x):
    """`_butterfly` of float32 x (T, NB, 32) along its flattened trailing
    dims (index 32 * block + j), for a layout with each token's blocks in
    one thread (see the module docstring); stages within a block first,
    as in the flat order."""
    T: tl.constexpr = x.shape[0]
    NB: tl.constexpr = x.shape[1]
    for stage in tl.static_range(5):
        p = tl.reshape(x, [T, NB, 16 >> stage, 2, 1 << stage])
        x = tl.reshape(_pair_sums(p, 3), [T, NB, 32])
    for stage in tl.static_range(16):
        if (1 << stage) < NB:
            p = tl.reshape(x, [T, NB // (2 << stage), 2, 1 << stage, 32])
            x = tl.reshape(_pair_sums(p, 2), [T, NB, 32])
    return x


@triton.jit
def rotate_rows(x, signs, D: tl.constexpr, INV_SQRT_D: tl.constexpr, IN_THREAD: tl.constexpr = False,
                NORMALIZE: tl.constexpr = True):
    """x (T, ..., D in its trailing dims) times the rotation with sign vector
    `signs` (x's shape; None: x carries its signs already, `sign_bits`):
    signs, butterfly, normalization, as rotation.rotate.
    IN_THREAD: x is (T, D / 32, 32) with each token's blocks in one thread
    (module docstring); the same bits, without layout conversions.
    NORMALIZE False leaves out the multiply by INV_SQRT_D, for a caller that
    folds it into a multiply of its own (`quantize.folded_mx`)."""
    shape: tl.constexpr = x.shape
    if signs is not None:
        x = x * signs
    if IN_THREAD:
        y = _butterfly_blocks(x)
    else:
        y = tl.reshape(_butterfly(tl.reshape(x, [shape[0], D]), D), shape)
    if NORMALIZE:
        y = y * INV_SQRT_D
    return y


@functools.lru_cache(maxsize=None)
def inverse_sqrt_constant(d: int) -> float:
    """float(inverse_sqrt(d)): a float32 value, so Triton's float32 constant holds it exactly."""
    return float(inverse_sqrt(d))


def transform_arguments(x: torch.Tensor, kind: str, balance: torch.Tensor | None = None) -> dict:
    """The token passes' arguments for what x (B, H, L, D) undergoes before
    MX quantization: SIGNS and SIGNS_BH, a vector per (batch, head) at
    SIGNS + (b * H + h) * SIGNS_BH (stride 0: one vector for all), which
    multiplies x first; ROTATE, the butterfly after it (rotation.rotate);
    PRESCALE, the multiply without a butterfly; INV_SQRT_D.

    The vector is the rotation's signs, times `balance` (B, H, D), powers of
    two, when given (`AttentionPolicy.balance_qk`): both are exact, so the
    product equals scaling first and rotating after."""
    signs, rotating, inv_sqrt_d = rotation_arguments(x, kind)
    if balance is None:
        return dict(SIGNS=signs, SIGNS_BH=0, ROTATE=rotating, PRESCALE=False, INV_SQRT_D=inv_sqrt_d)
    d = x.shape[-1]
    vectors = balance.reshape(-1, d).to(device=x.device, dtype=torch.float32)
    if rotating:
        vectors = vectors * signs
    return dict(SIGNS=vectors.contiguous(), SIGNS_BH=d, ROTATE=rotating, PRESCALE=not rotating, INV_SQRT_D=inv_sqrt_d)


@functools.lru_cache(maxsize=None)
def sign_bits(d: int, kind: str, device: torch.device) -> torch.Tensor:
    """The sign vector of `kind` as int32 bit masks (0x80000000 where the sign
    is -1), for a pass that flips bf16 inputs' signs as it widens them
    (`numerics.widen_bf16_signed`)."""
    signs = sign_vector(d, kind, device)
    return torch.where(signs < 0, -(2**31), 0).to(torch.int32)


def with_sign_bits(transform: dict, x: torch.Tensor, kind: str, plain: bool) -> dict:
    """`transform_arguments`' result with SIGNS as `sign_bits` where a pass
    can flip the signs as it widens x: a rotation of bf16 x with nothing
    applied before it (plain: no smoothing, no unrotated copy written; no
    balancing vectors). A pass reads an int32 SIGNS that way."""
    if transform["ROTATE"] and plain and transform["SIGNS_BH"] == 0 and x.dtype == torch.bfloat16:
        transform = {**transform, "SIGNS": sign_bits(x.shape[-1], kind, x.device)}
    return transform


def rotation_arguments(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, bool, float]:
    """(SIGNS, ROTATE, INV_SQRT_D) kernel arguments of the passes for x (..., D)."""
    d = x.shape[-1]
    check_head_dim(d, kind)
    if kind == "none":
        return x, False, 1.0
    return sign_vector(d, kind, x.device), True, inverse_sqrt_constant(d)
