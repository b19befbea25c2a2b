"""Hadamard rotation of Q and K along the head dimension, before MX quantization.

One large channel sets an MX block's shared exponent and flushes its
neighbours to zero. Rotating every token's head vector by one orthogonal
matrix R leaves each score unchanged, (Q R)(K R)^T = Q K^T, and spreads such
outliers over the whole vector. `AttentionPolicy.rotate` names R:

- "none": no rotation;
- "hadamard": the normalized Walsh–Hadamard matrix H / sqrt(D) (Sylvester
  order, H[i, j] = (-1)^popcount(i & j));
- "signed_hadamard": diag(s) H / sqrt(D) with a fixed pseudo-random sign
  vector s in {-1, +1}^D (`sign_vector`: torch's CPU generator seeded with
  SIGN_SEED, the same signs on every machine), which breaks the structure
  that plain Hadamard shares with channel patterns of real models.

The transform is computed as a butterfly in float32: the signs (exact), then
log2(D) stages that replace each pair (a, b) at distance 1, 2, 4, ... by
(a + b, a - b), then one multiply by the float32 value of 1 / sqrt(D) (a power
of two for D = 64 and 256, so exact there). Each step is one correctly
rounded float32 operation in a fixed order, so the Triton passes
(kernels/hadamard.py) compute the same bits as this module on every device;
the reference and the kernels therefore quantize identical rotated values.
D must be a power of two (the MX formats also need a multiple of 32).
"""

from __future__ import annotations

import functools
import math

import torch

ROTATIONS = ("none", "hadamard", "signed_hadamard")
# Seed of torch.Generator (CPU) that draws the sign vector of "signed_hadamard".
SIGN_SEED = 0x5EED


def check_rotation(kind: str) -> None:
    if kind not in ROTATIONS:
        raise ValueError(f"rotate must be one of {list(ROTATIONS)}, got {kind!r}")


def is_power_of_two(d: int) -> bool:
    return d >= 2 and d & (d - 1) == 0


def check_head_dim(d: int, kind: str, name: str = "x") -> None:
    """Raise unless head_dim d can be rotated by `kind` ("none" takes any)."""
    check_rotation(kind)
    if kind != "none" and not is_power_of_two(d):
        raise ValueError(
            f"{name}: head_dim must be a power of two for rotate={kind} (64, 128, 256, ...), got {d}; "
            "use rotate=none for this layer"
        )


@functools.lru_cache(maxsize=None)
def _signs_cpu(d: int, kind: str) -> torch.Tensor:
    if kind == "hadamard":
        return torch.ones(d)
    generator = torch.Generator().manual_seed(SIGN_SEED)
    return torch.randint(0, 2, (d,), generator=generator).float() * 2 - 1


_SIGNS: dict = {}


def sign_vector(d: int, kind: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 (d,) of +-1 applied before the Hadamard butterfly (all ones for
    "hadamard"), built once per (d, kind, device)."""
    check_head_dim(d, kind)
    if kind == "none":
        raise ValueError("rotate=none has no sign vector")
    key = (d, kind, torch.device(device))
    if key not in _SIGNS:
        _SIGNS[key] = _signs_cpu(d, kind).to(device)
    return _SIGNS[key]


def inverse_sqrt(d: int) -> torch.Tensor:
    """1 / sqrt(d) rounded to float32, the butterfly's normalization."""
    return torch.tensor(1.0 / math.sqrt(d), dtype=torch.float32)


def _butterfly(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh–Hadamard transform of float32 x along its last dimension."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    half = 1
    while half < d:
        pairs = x.reshape(*lead, d // (2 * half), 2, half)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, d)
        half *= 2
    return x


def rotate(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x (..., D) times the rotation `kind`, as float32 (x itself for "none")."""
    check_head_dim(x.shape[-1], kind)
    if kind == "none":
        return x
    d = x.shape[-1]
    y = _butterfly(x.float() * sign_vector(d, kind, x.device))
    return y * inverse_sqrt(d).to(x.device)


def unrotate(y: torch.Tensor, kind: str) -> torch.Tensor:
    """The inverse of `rotate` (the transpose: H is symmetric), as float32."""
    check_head_dim(y.shape[-1], kind)
    if kind == "none":
        return y
    d = y.shape[-1]
    return _butterfly(y.float()) * inverse_sqrt(d).to(y.device) * sign_vector(d, kind, y.device)


def rotation_matrix(d: int, kind: str, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The (d, d) matrix R with rotate(x) = x @ R (up to float32 rounding)."""
    check_head_dim(d, kind)
    if kind == "none":
        return torch.eye(d, dtype=dtype)
    i = torch.arange(d)
    bits = torch.bitwise_and(i[:, None], i[None, :])
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    h = (1 - 2 * parity).to(dtype) / math.sqrt(d)
    return _signs_cpu(d, kind).to(dtype)[:, None] * h
