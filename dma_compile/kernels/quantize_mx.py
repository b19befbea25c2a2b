"""MX payload pass for the Blackwell kernel: what `tl.dot_scaled` reads.

Reads Q or K once and writes, per MX format, the element payload and one E8M0
scale per block of 32 along the head dimension, bit-identical to
`dma_compile.formats.quantize_mx`:

- payload (B, H, L, D) uint8 holding e4m3 or e5m2 bits, or (B, H, L, D // 2)
  uint8 holding two e2m1 codes per byte, the even index in the low nibble
  (the layout `tl.dot_scaled` takes with the K dimension packed);
- scales (B, H, L, D // 32) uint8, E8M0 (bias 127, 255 = NaN): row-major per
  token, which is `tl.dot_scaled`'s [rows, K // 32] for both operands.

Optionally it also writes the (smoothed) values rounded to the input dtype
(format "none"). A rotating policy's rotation (kernels/hadamard.py) comes
after smoothing and before the MX formats, never in "none". Rounding, scale
rule and e4m3 encoding are the helpers of `dma_compile.kernels.numerics`
(shared with the Hopper kernel, whose pass
writes dequantized bf16 instead, which Blackwell's block-scaled MMA does not
need); the e5m2 and packed-e2m1 encoders live here. All are integer/float
arithmetic, bit-exact on every device and in the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dma_compile.kernels.codes import FMT_E2M1, FMT_E4M3, FMT_E5M2, FMT_NONE, MX_FORMAT_CODES, mx_format_slots
from dma_compile.kernels.hadamard import rotate_rows, transform_arguments, with_sign_bits
from dma_compile.kernels.launch import LAUNCH_OPTIONS, cdiv
from dma_compile.kernels.numerics import (
    HW_CVT,
    e4m3_bits,
    round_element,
    scale_exponent,
    scaled_pow2,
    to_dtype_exact,
    to_f32,
    widen_bf16_signed,
)

# Payload elements per byte for each format code (e2m1 packs two).
PACKING = {FMT_E4M3.value: 1, FMT_E5M2.value: 1, FMT_E2M1.value: 2}


@triton.jit
def _e5m2_bits(elem):
    """e5m2 bits of float32 values already on the e5m2 grid, by integer
    arithmetic (no conversion instruction can flush or re-round them)."""
    a = tl.abs(elem)
    fb = a.to(tl.int32, bitcast=True)
    normal = (((fb >> 23) - 112) << 2) | ((fb >> 21) & 3)
    # Subnormals are multiples of 2^-16.
    code = tl.where(a >= 6.103515625e-05, normal, (tl.minimum(a, 6.103515625e-05) * 65536.0).to(tl.int32))
    return (code | ((elem.to(tl.int32, bitcast=True) >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def _e2m1_codes(elem):
    """4-bit E2M1 codes (sign in bit 3) of float32 values already on the e2m1 grid."""
    twice = (tl.abs(elem) * 2.0).to(tl.int32)
    # Twice the magnitudes 0, 1, 2, 3, 4, 6, 8, 12 map to codes 0..7.
    mag = tl.where(twice <= 4, twice, tl.where(twice <= 8, 2 + twice // 2, 7))
    sign = (elem.to(tl.int32, bitcast=True) >> 31) & 1
    return mag | (sign << 3)


@triton.jit
def _store_mx(x, PAYLOAD, SCALES, bh, t, t_ok, L, D: tl.constexpr, FMT: tl.constexpr, RCEIL: tl.constexpr,
              NORM: tl.constexpr):
    """MX-quantize x * NORM (tokens, D // 32, 32) float32; store payload bytes
    and E8M0 scales. NORM (the rotation's 1 / sqrt(D), or 1) multiplies with
    each block's 2^-s: the same bits as multiplying first (`quantize.folded_mx`)."""
    NB: tl.constexpr = D // 32
    BLOCK_T: tl.constexpr = x.shape[0]
    ax = tl.abs(x)
    finite = ax < float("inf")
    # A block holding NaN or Inf gets scale 255 (NaN) and zero elements, as formats.quantize_mx.
    bad = tl.max((~finite).to(tl.int32), axis=2) > 0
    amax = tl.max(tl.where(finite, ax, 0.0), axis=2)
    if NORM != 1.0:
        amax = amax * NORM
    s = scale_exponent(amax, FMT, RCEIL)
    # A finite float32 amax is below 2^128 * NORM, so s <= 126 + log2(NORM)
    # and 2^-s * NORM is a normal float.
    elem = round_element(tl.where(finite, x, 0.0) * scaled_pow2(-s, NORM)[:, :, None], FMT)
    elem = tl.where(bad[:, :, None], 0.0, elem)
    rows = bh.to(tl.int64) * L + t
    blocks = tl.arange(0, NB)
    tl.store(SCALES + rows[:, None] * NB + blocks[None, :], tl.where(bad, 255, s + 127).to(tl.uint8),
             mask=t_ok[:, None])
    if FMT == FMT_E2M1:
        codes = tl.reshape(_e2m1_codes(elem), [BLOCK_T, D // 2, 2])
        even, odd = tl.split(codes)
        cols = tl.arange(0, D // 2)
        tl.store(PAYLOAD + rows[:, None] * (D // 2) + cols[None, :], (even | (odd << 4)).to(tl.uint8),
                 mask=t_ok[:, None])
    else:
        if FMT == FMT_E4M3:
            bits = e4m3_bits(elem)
        else:
            bits = _e5m2_bits(elem)
        cols = tl.arange(0, NB)[:, None] * 32 + tl.arange(0, 32)[None, :]
        tl.store(PAYLOAD + rows[:, None, None] * D + cols[None, :, :], bits, mask=t_ok[:, None, None])


@triton.jit
def _mx_payload_kernel(
    X, sx_b, sx_h, sx_l, sx_d,
    MEAN, NONE_OUT, PAYLOAD1, SCALES1, PAYLOAD2, SCALES2, SIGNS, SIGNS_BH: tl.constexpr,
    H, L,
    D: tl.constexpr, BLOCK_T: tl.constexpr,
    SMOOTH: tl.constexpr, WRITE_NONE: tl.constexpr,
    FMT1: tl.constexpr, FMT2: tl.constexpr, RCEIL: tl.constexpr, HW_CVT: tl.constexpr,
    ROTATE: tl.constexpr, PRESCALE: tl.constexpr, INV_SQRT_D: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    NB: tl.constexpr = D // 32
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < L
    d = tl.arange(0, NB)[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    ok = t_ok[:, None, None]
    src = X + b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h
    raw = tl.load(src + t[:, None, None].to(tl.int64) * sx_l + d * sx_d, mask=ok, other=0.0)
    sign_ptrs = SIGNS + pid_bh * SIGNS_BH + (d + t[:, None, None] * 0)
    # An int32 SIGNS: the rotation's signs as bit masks (`hadamard.with_sign_bits`).
    SIGN_BITS: tl.constexpr = ROTATE and SIGNS.dtype.element_ty == tl.int32
    if SIGN_BITS:
        x = widen_bf16_signed(raw, tl.load(sign_ptrs))
    else:
        x = to_f32(raw, HW_CVT)
    if SMOOTH:
        x = x - tl.load(MEAN + pid_bh * D + d)
    if WRITE_NONE:
        dst = NONE_OUT + (pid_bh.to(tl.int64) * L + t[:, None, None]) * D + d
        tl.store(dst, to_dtype_exact(x, NONE_OUT.dtype.element_ty), mask=ok)
    NORM: tl.constexpr = INV_SQRT_D if ROTATE else 1.0
    if ROTATE:
        signs = None if SIGN_BITS else tl.load(sign_ptrs)
        x = rotate_rows(x, signs, D, INV_SQRT_D, NORMALIZE=False)
    elif PRESCALE:
        x = x * tl.load(sign_ptrs)
    if FMT1 != FMT_NONE:
        _store_mx(x, PAYLOAD1, SCALES1, pid_bh, t, t_ok, L, D, FMT1, RCEIL, NORM)
    if FMT2 != FMT_NONE:
        _store_mx(x, PAYLOAD2, SCALES2, pid_bh, t, t_ok, L, D, FMT2, RCEIL, NORM)


@dataclass
class MXPayload:
    """One operand in one MX format, as `tl.dot_scaled` reads it.

    payload: (B, H, L, D) uint8 (e4m3/e5m2 bits) or (B, H, L, D // 2) uint8
    (packed e2m1); scales: (B, H, L, D // 32) uint8 E8M0.
    """

    fmt: str
    payload: torch.Tensor
    scales: torch.Tensor


def quantize_payloads(
    x: torch.Tensor,
    formats: tuple[str, ...],
    scale_rule: str = "rceil",
    mean: torch.Tensor | None = None,
    write_none: bool = False,
    rotate: str = "none",
    balance: torch.Tensor | None = None,
) -> dict[str, MXPayload | torch.Tensor]:
    """MX payloads and scales of x (B, H, L, D) for each MX format in `formats`.

    mean: (B, H, D) float32 subtracted first (K smoothing). write_none: also
    return the (smoothed) values rounded to x's dtype, (B, H, L, D) contiguous,
    under the key "none". rotate: the rotation (dma_compile.rotation) of the
    MX formats' input, after smoothing; balance: (B, H, D) powers of two
    multiplying it before the rotation (`AttentionPolicy.balance_qk`). One
    pass over x for up to two formats.
    """
    b, h, length, d = x.shape
    if d % 32 != 0 or d & (d - 1):
        raise ValueError(f"x: head_dim must be a power of two and a multiple of 32, got {d}")
    mx, format_codes = mx_format_slots(formats)
    if not mx and not write_none:
        return {}
    transform = with_sign_bits(transform_arguments(x, rotate, balance), x, rotate,
                               plain=mean is None and not write_none)
    result: dict[str, MXPayload | torch.Tensor] = {}
    outs = []
    for fmt in mx:
        code = MX_FORMAT_CODES[fmt]
        op = MXPayload(
            fmt,
            torch.empty(b, h, length, d // PACKING[code], dtype=torch.uint8, device=x.device),
            torch.empty(b, h, length, d // 32, dtype=torch.uint8, device=x.device),
        )
        result[fmt] = op
        outs.append((op.payload, op.scales))
    none_out = torch.empty(b, h, length, d, dtype=x.dtype, device=x.device) if write_none else x
    if write_none:
        result["none"] = none_out
    while len(outs) < 2:
        outs.append((x, x))
    block_t = max(8, 2048 // d)
    _mx_payload_kernel[(cdiv(length, block_t), b * h)](
        x, *x.stride(),
        mean.contiguous() if mean is not None else x, none_out,
        outs[0][0], outs[0][1], outs[1][0], outs[1][1], transform["SIGNS"], transform["SIGNS_BH"],
        h, length,
        D=d, BLOCK_T=block_t, SMOOTH=mean is not None, WRITE_NONE=write_none,
        **format_codes,
        RCEIL=scale_rule == "rceil", HW_CVT=HW_CVT, ROTATE=transform["ROTATE"] and bool(mx),
        PRESCALE=transform["PRESCALE"] and bool(mx), INV_SQRT_D=transform["INV_SQRT_D"],
        num_warps=4, **LAUNCH_OPTIONS,
    )
    return result
