"""Numerics of the Triton kernels: element rounding, E8M0 scales, conversions.

The `@triton.jit` helpers every pass and kernel shares (the quantization
passes, mask classification, the attention and decode kernels): powers of
two from exponent bits, rounding to the MX element grids (bit-identical to
`dma_compile.formats`: nearest even, saturating, rceil/floor scale rules),
the e4m3 conversions, and exact float32/bf16/fp16 conversions. `HW_CVT` picks
the hardware conversions on a GPU and their exact emulation under Triton's
interpreter (see `dma_compile.kernels.quantize`).
"""

from __future__ import annotations

import os
import re

import triton
import triton.language as tl

from dma_compile.kernels.codes import FMT_E4M3, FMT_E5M2

# Read when this module is imported, like triton.jit reads it when decorating.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HW_CVT = not INTERPRET
# (major, minor) of the running Triton, for the kernels' version rules.
TRITON_VERSION = tuple(int(p) for p in re.findall(r"\d+", triton.__version__)[:2])

@triton.jit
def pow2(e):
    """2^e as float32 for int32 e in [-126, 127], built from the exponent bits."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def scaled_pow2(e, NORM: tl.constexpr):
    """2^e times NORM (a float32 constant; 1: 2^e itself), the factor an MX
    pass scales a block by when NORM, the rotation's 1 / sqrt(D), rides
    along with the block's power of two. Exact where the product is normal."""
    r = pow2(e)
    if NORM != 1.0:
        r = r * NORM
    return r


@triton.jit
def pow2_f16(e):
    """2^e as float16 for int32 e <= 15: subnormal below -14, 0 below -24."""
    normal = ((tl.maximum(e, -14) + 15) << 10).to(tl.int16).to(tl.float16, bitcast=True)
    sub = (1 << tl.minimum(tl.maximum(e + 24, 0), 9)).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.where(e >= -14, normal, tl.where(e >= -24, sub, 0.0))


@triton.jit
def pow2_wide(e):
    """2^e as float32 for int32 e >= -149 (subnormal below -126), 0 further down."""
    normal = ((tl.maximum(e, -126) + 127) << 23).to(tl.float32, bitcast=True)
    sub = (1 << tl.minimum(tl.maximum(e + 149, 0), 22)).to(tl.float32, bitcast=True)
    return tl.where(e >= -126, normal, tl.where(e >= -149, sub, 0.0))


@triton.jit
def with_sign_of(mag, x):
    bits = mag.to(tl.int32, bitcast=True) | (x.to(tl.int32, bitcast=True) & -2147483648)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_grid(a, MBITS: tl.constexpr, MIN_EXP: tl.constexpr, MAX_NORMAL: tl.constexpr):
    """Round non-negative float32 `a` to a float grid: nearest even, saturating.

    Adding and subtracting 1.5 * 2^(quantum exponent + 23) makes the float32
    adder round to the quantum (nearest even); the quantum is that of a's
    binade, never below the smallest normal's (subnormals share it).
    """
    a = tl.minimum(a, MAX_NORMAL)
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, MIN_EXP)
    magic = (((e - MBITS + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
    return (a + magic) - magic


@triton.jit
def round_element(x, FMT: tl.constexpr):
    """x on the element grid of FMT (`codes`: e4m3, e5m2 or e2m1), float32; not for NaN."""
    if FMT == FMT_E4M3:
        r = with_sign_of(round_grid(tl.abs(x), 3, -6, 448.0), x)
    elif FMT == FMT_E5M2:
        r = with_sign_of(round_grid(tl.abs(x), 2, -14, 57344.0), x)
    else:
        r = with_sign_of(round_grid(tl.abs(x), 1, 0, 6.0), x)
    return r


@triton.jit
def e4m3_bits(x):
    """e4m3(x) (nearest even, saturating) as uint8 bits; not for NaN.

    Encoded by integer arithmetic from the rounded value rather than cast, so
    no conversion instruction can flush or re-round it.
    """
    r = round_element(x, 1)
    a = tl.abs(r)
    fb = a.to(tl.int32, bitcast=True)
    normal = (((fb >> 23) - 120) << 3) | ((fb >> 20) & 7)
    code = tl.where(a >= 0.015625, normal, (a * 512.0).to(tl.int32))
    return (code | ((r.to(tl.int32, bitcast=True) >> 24) & 0x80)).to(tl.uint8)


@triton.jit
def to_e4m3(x, HW_CVT: tl.constexpr):
    """e4m3(x) as float8e4nv for the attention kernel's P: the hardware cast
    (nearest even, saturating: it matched `formats` on every bf16 value in
    e4m3's range on an H200), emulated under the interpreter."""
    if HW_CVT:
        r = x.to(tl.float8e4nv)
    else:
        r = round_element(x, 1).to(tl.float8e4nv)
    return r


@triton.jit
def on_element_grid(x, FMT: tl.constexpr, HW_CVT: tl.constexpr):
    """round_element with the hardware fp8 cast for e4m3/e5m2 where HW_CVT.

    Triton casts float32 to fp8 with `cvt.rn.satfinite` (sm_89 on): nearest
    even, |x| above the largest normal becoming it, as in `formats`; the
    offline compile test (tests/test_quantize_compile.py) holds it to that,
    so no clamp precedes the cast. The widening back to float32 is exact.
    NaN gives an unspecified value.
    """
    if HW_CVT and FMT == FMT_E4M3:
        r = x.to(tl.float8e4nv).to(tl.float32)
    elif HW_CVT and FMT == FMT_E5M2:
        r = x.to(tl.float8e5).to(tl.float32)
    else:
        r = round_element(x, FMT)
    return r


@triton.jit
def on_element_grid_f16(x, FMT: tl.constexpr):
    """on_element_grid with HW_CVT, as float16 (exact: every element of
    e4m3, e5m2 and e2m1 is a float16); for the GPU only."""
    if FMT == FMT_E4M3:
        r = x.to(tl.float8e4nv).to(tl.float16)
    elif FMT == FMT_E5M2:
        r = x.to(tl.float8e5).to(tl.float16)
    else:
        r = round_element(x, FMT).to(tl.float16)
    return r


@triton.jit
def e4m3_code(x, HW_CVT: tl.constexpr):
    """e4m3(x) (nearest even, saturating) as uint8 bits: the hardware cast
    (saturating: see on_element_grid) where HW_CVT, `e4m3_bits` otherwise.
    Not for NaN."""
    if HW_CVT:
        r = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        r = e4m3_bits(x)
    return r


@triton.jit
def round_bf16_bits(x):
    """bf16(x), nearest even, built from the float32 bits (exact on every
    device, subnormals included; the interpreter's own cast truncates)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = tl.where(x == x, bits + (0x7FFF + ((bits >> 16) & 1)), bits)
    return (rounded >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def to_f32(x, HW_CVT: tl.constexpr):
    """x as float32 (the interpreter widens bf16 subnormals wrongly: shift the
    bits instead; it reads e4m3's NaN code as 480: select NaN there)."""
    if not HW_CVT and x.dtype == tl.bfloat16:
        r = (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif not HW_CVT and x.dtype == tl.float8e4nv:
        r = tl.where((x.to(tl.uint8, bitcast=True) & 0x7F) == 0x7F, float("nan"), x.to(tl.float32))
    else:
        r = x.to(tl.float32)
    return r


@triton.jit
def widen_bf16_signed(x, sign_bits):
    """bf16 x times +-1 as float32, exactly: x's bits shifted into a float32's
    high half with the sign flipped where sign_bits (int32) is 0x80000000,
    about one integer instruction per element on a GPU, against a widening
    and a float multiply by a sign (a NaN keeps its payload)."""
    return ((x.to(tl.int16, bitcast=True).to(tl.int32) << 16) ^ sign_bits).to(tl.float32, bitcast=True)


@triton.jit
def to_dtype(x, DTYPE: tl.constexpr, HW_CVT: tl.constexpr):
    """Cast float32 x to DTYPE with nearest-even rounding (hardware cast where there is one)."""
    if DTYPE == tl.bfloat16 and not HW_CVT:
        r = round_bf16_bits(x)
    else:
        r = x.to(DTYPE)
    return r


@triton.jit
def to_dtype_exact(x, DTYPE: tl.constexpr):
    """Cast float32 x to bf16 by bit arithmetic, to fp16 by the (exact) hardware cast."""
    if DTYPE == tl.bfloat16:
        r = round_bf16_bits(x)
    else:
        r = x.to(DTYPE)
    return r


@triton.jit
def log2_parts(a):
    """floor(log2(a)) and the 23 fraction bits of a's normalised significand, a > 0 finite."""
    bits = a.to(tl.int32, bitcast=True)
    ef = bits >> 23
    mant = bits & 0x7FFFFF
    # A subnormal has no implicit bit: find its leading bit by an exact int -> float conversion.
    lead = (mant.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127
    e = tl.where(ef > 0, ef - 127, lead - 149)
    shift = tl.minimum(tl.maximum(23 - lead, 0), 31)
    frac = tl.where(ef > 0, mant, (mant << shift) & 0x7FFFFF)
    return e, frac


@triton.jit
def mx_limits(FMT: tl.constexpr):
    """(emax, max_frac) of element format FMT (`codes`: e4m3, e5m2 or e2m1): its
    largest normal is 1.max_frac * 2^emax, max_frac as float32 mantissa bits."""
    if FMT == FMT_E4M3:
        return 8, 0x600000
    elif FMT == FMT_E5M2:
        return 15, 0x600000
    else:
        return 2, 0x400000


@triton.jit
def scale_exponent(amax, FMT: tl.constexpr, RCEIL: tl.constexpr):
    """E8M0 exponent of a block with finite amax (formats.scale_exponents):
    rceil takes the smallest k with amax <= max_normal * 2^k, floor the spec's
    floor(log2 amax) - emax."""
    emax, max_frac = mx_limits(FMT)
    e, frac = log2_parts(amax)
    if RCEIL:
        e = e + (frac > max_frac).to(tl.int32)
    s = tl.where(amax == 0, -127, e - emax)
    return tl.minimum(tl.maximum(s, -127), 127)


@triton.jit
def _maximum_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def block_amax(x):
    """Per block of 32 of x (tokens, D // 32, 32): the amax of |x| and whether
    the block holds NaN or Inf (it then gets a NaN scale and reads back NaN).

    One NaN-propagating float maximum of |x| per element (the absolute value
    is an operand modifier on a GPU) gives both: NaN or Inf where the block
    has one. Shared by the formats of one pass. A bad block's amax reads as
    float32's largest value: its elements, then overwritten, are scaled down
    and cannot overflow.
    """
    block_max = tl.reduce(tl.abs(x), 2, _maximum_nan)
    bad = ~(block_max < float("inf"))
    return tl.where(bad, 0x7F7FFFFF, block_max.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True), bad


@triton.jit
def _halve_columns(x, SUM: tl.constexpr):
    """x (R, N) with column c combined with column c + N / 2: (R, N / 2)."""
    R: tl.constexpr = x.shape[0]
    N: tl.constexpr = x.shape[1]
    a, b = tl.split(tl.permute(tl.reshape(x, [R, 2, N // 2]), [0, 2, 1]))
    if SUM:
        r = a + b
    else:
        r = tl.maximum(a, b)
    return r


@triton.jit
def row_reduce(x, SUM: tl.constexpr):
    """The max (SUM False) or sum of each row of the scores x (R, N), as a
    pairwise tree: the Gluon sm90 kernel's softmax. (The portable Triton
    kernel keeps its plain reductions: the tree was not measured faster
    there, BENCHMARKS.md 2026-12-07, fourth session.)

    A reduction over the row folds each thread's N / 4 or so values into one
    accumulator, a chain of dependent operations on the softmax's critical
    path (Triton 3.6). In a tensor-core accumulator layout a thread holds
    column 8j + 2q + e of its rows for every j and e (q its lane's quarter),
    so halving the columns down to 8 pairs values of one thread: each level
    is independent operations. The maximum is the same either way; the sum
    is added in another order."""
    N: tl.constexpr = x.shape[1]
    for level in tl.static_range(16):
        if (8 << level) < N:
            x = _halve_columns(x, SUM)
    if SUM:
        r = tl.sum(x, 1)
    else:
        r = tl.max(x, 1)
    return r
