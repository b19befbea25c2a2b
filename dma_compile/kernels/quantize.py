"""Quantization pass of the Triton attention kernels.

Reads Q and K (and V when P·V runs in FP8) once and writes what the attention
kernel reads, in its layout (docs/semantics.md gives the math):

- format "none": smoothed K rounded back to K's dtype (Q and unsmoothed K are
  used as given, nothing is written);
- MX, mx_mode "exact": the MX values dequantized to bf16, which holds every
  e4m3/e5m2/e2m1 element times a power of two exactly, so the attention kernel
  runs bf16 tensor cores on the exact MX numbers;
- MX, mx_mode "folded": the e4m3 payload (float8_e4m3fn) and one int32
  power-of-two exponent per token, for fp8 tensor cores;
- V for FP8 P·V: e4m3, transposed to (B, H, Dv, Lk_padded) because Hopper's
  fp8 MMA wants its second operand K-major, with one power-of-two scale per
  channel; for the Gluon kernel with each 32 keys in wgmma's operand order
  (`wgmma_key_order`).

With a rotating policy (`AttentionPolicy.rotate`), Q and K are rotated along
D (kernels/hadamard.py: a float32 butterfly in registers, bit-identical to
`dma_compile.rotation`) after smoothing and before every MX format; the
format-"none" output stays unrotated; the rotation's 1 / sqrt(D) is applied
with each MX block's power of two, the same bits for one multiply fewer.
A balancing policy
(`AttentionPolicy.balance_qk`) multiplies them first by a power of two per
(batch, head) and channel, folded into the rotation's sign vector.

K's mean over keys (smoothing) and V's per-channel amax, over the finite
values of the keys that count (docs/semantics.md; `key_keep`, `key_limit`),
come from a small reduction pass first: many programs per (batch, head),
each over a chunk of keys, accumulating element-wise in registers (one
cross-thread reduction at the end, not one per block of keys); the last
chunk of a head to finish combines them. Q, which needs no statistics, is
quantized by further programs of the same launch
(`kv_statistics(..., alongside=plan_tokens(q, ...))`), and K and V, which
need them, by one launch after it (`quantize_keys_and_values`): a Hopper
call makes three launches, the attention kernel's included (five for large
ones with FP8 P·V: `attention_sm90.FEWEST_LAUNCHES_BELOW`; Q in a launch of
its own without: `Q_BESIDE_STATISTICS_BELOW`).
The rounding is bit-identical to `dma_compile.formats` (nearest even,
saturating, rceil/floor scale rules, E8M0 exponents clamped to [-127, 127],
NaN/Inf blocks read back NaN).

Bandwidth is the goal: the token passes load 16-byte vectors of whole tokens
and write only what the attention kernel reads (Q in format "none" is read
as given, so it is never copied). Element rounding is where the arithmetic
goes, so the GPU uses the hardware conversions (`HW_CVT`):

- e4m3 and e5m2 (MX elements, the folded re-rounding, V for FP8 P·V): the
  `cvt.rn.satfinite` cast, nearest even and saturating like `formats` (it
  matched on every bf16 value in e4m3's range and 2^20 random floats on an
  H200); the folded re-rounding casts float16 pairs (`folded_mx`);
- e2m1 (Hopper has no conversion) and the bf16 outputs (exact for subnormals
  on every device) stay exact integer/float arithmetic.

Under Triton's interpreter (`HW_CVT` False: its float32 -> bf16/fp8 casts
truncate) every rounding is that emulation, so CI checks the same numbers the
GPU computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dma_compile.kernels.codes import FMT_E5M2, FMT_NONE, mx_format_slots
from dma_compile.kernels.hadamard import rotate_rows, transform_arguments, with_sign_bits
from dma_compile.kernels.launch import cdiv, launch, zeros
from dma_compile.kernels.numerics import (
    HW_CVT,
    block_amax,
    e4m3_code,
    log2_parts,
    mx_limits,
    on_element_grid,
    on_element_grid_f16,
    pow2,
    pow2_f16,
    pow2_wide,
    round_bf16_bits,
    scale_exponent,
    scaled_pow2,
    to_dtype_exact,
    to_f32,
    widen_bf16_signed,
)


@triton.jit
def folded_mx(x, amax, bad, FMT: tl.constexpr, RCEIL: tl.constexpr, HW_CVT: tl.constexpr, NORM: tl.constexpr = 1.0):
    """Folded MX of x (tokens, D // 32, 32) with its blocks' `block_amax`:
    the e4m3 bits (uint8) and each token's power-of-two exponent. Shared by
    the token pass and the Gluon kernel's Q prologue, so both round alike.
    NORM (other than 1): what x is to be multiplied by first, applied with
    each block's power of two (amax is already that of x * NORM): the same
    bits as multiplying first, one multiply per element fewer, as long as
    2^-s * NORM is a normal float32 (see `_quantize_token_block`).

    On a GPU the re-rounding to the token's exponent runs in float16, two
    elements per instruction: an element (4 significant bits at most) times
    2^shift is exact there down to 2^-21, and anything smaller rounds to a
    signed zero in e4m3 from float16 as from float32. e5m2 elements (up to
    2^16) are first scaled by 2^-8 (exact: their smallest is 2^-16), so that
    every shift whose product reaches e4m3's grid is a float16 power of two.
    A NaN block (`bad`) multiplies by NaN, which the conversion encodes as
    e4m3 NaN, instead of a select on every byte."""
    s = scale_exponent(amax, FMT, RCEIL)
    emax, _ = mx_limits(FMT)
    # NaN scales count as exponent 128 in the token's maximum (formats.fold_mx).
    a = tl.max(tl.where(bad, 128, s), axis=1) + (emax - 8)
    shift = s - a[:, None]
    down = scaled_pow2(-s, NORM)
    if HW_CVT:
        elem = on_element_grid_f16(x * down[:, :, None], FMT)
        if FMT == FMT_E5M2:
            elem = elem * 0.00390625
            shift = shift + 8
        factor = tl.where(bad, float("nan"), pow2_f16(shift)).to(tl.float16)
        bits = (elem * factor[:, :, None]).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        elem = on_element_grid(x * down[:, :, None], FMT, HW_CVT)
        bits = e4m3_code(elem * pow2(tl.maximum(shift, -126))[:, :, None], HW_CVT)
        bits = tl.where(bad[:, :, None], 0x7F, bits)
    return bits, a


@triton.jit
def folded_scale(a):
    """2^a for a folded exponent, clamped to float32's normal range (`Operand.scales`)."""
    return pow2(tl.minimum(tl.maximum(a, -126), 127))


@triton.jit
def _quantize_mx(x, amax, bad, ok, row_ok, OUT, EXPS, SCALES, out_offs, row_offs,
                 FMT: tl.constexpr, FOLDED: tl.constexpr, RCEIL: tl.constexpr, POW2: tl.constexpr,
                 HW_CVT: tl.constexpr, NORM: tl.constexpr):
    """MX-quantize x * NORM (tokens, D // 32, 32) with the blocks' `block_amax`
    of x * NORM; store the exact or folded form (and, with POW2, the folded
    exponents' powers of two). NORM multiplies with each block's power of
    two (`folded_mx`)."""
    if FOLDED:
        bits, a = folded_mx(x, amax, bad, FMT, RCEIL, HW_CVT, NORM)
        tl.store(OUT + out_offs, bits, mask=ok)
        tl.store(EXPS + row_offs, a, mask=row_ok)
        if POW2:
            tl.store(SCALES + row_offs, folded_scale(a), mask=row_ok)
    else:
        s = scale_exponent(amax, FMT, RCEIL)
        elem = on_element_grid(x * scaled_pow2(-s, NORM)[:, :, None], FMT, HW_CVT)
        # NaN before scaling (a bad block's elements could overflow); two
        # steps keep the power of two normal for s = -127.
        deq = (tl.where(bad[:, :, None], float("nan"), elem) * pow2(s + 1)[:, :, None]) * 0.5
        tl.store(OUT + out_offs, round_bf16_bits(deq), mask=ok)


@triton.jit
def _quantize_token_block(
    pid_t, pid_bh,
    X, sx_b, sx_h, sx_l, sx_d,
    MEAN, NONE_OUT, OUT1, EXPS1, SCALES1, OUT2, EXPS2, SCALES2, SIGNS, SIGNS_BH: tl.constexpr,
    H, L,
    D: tl.constexpr, BLOCK_T: tl.constexpr,
    SMOOTH: tl.constexpr, WRITE_NONE: tl.constexpr,
    FMT1: tl.constexpr, FMT2: tl.constexpr, FOLDED: tl.constexpr, RCEIL: tl.constexpr, POW2: tl.constexpr,
    HW_CVT: tl.constexpr, ROTATE: tl.constexpr, PRESCALE: tl.constexpr, INV_SQRT_D: tl.constexpr,
):
    """Block pid_t of BLOCK_T whole tokens of (batch, head) pid_bh: each thread
    loads 16-byte runs along D (contiguous when sx_d is 1, which Triton
    specializes on)."""
    b = pid_bh // H
    h = pid_bh % H
    NB: tl.constexpr = D // 32
    t1 = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t = t1[:, None, None]
    d = tl.arange(0, NB)[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
    row_ok = t1 < L
    ok = (t < L) & (d < D)
    src = X + b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h
    raw = tl.load(src + t.to(tl.int64) * sx_l + d * sx_d, mask=ok, other=0.0)
    # The sign (or balancing) vector at x's full shape, as the mean below.
    sign_ptrs = SIGNS + pid_bh * SIGNS_BH + (d + t * 0)
    # An int32 SIGNS holds the rotation's signs as bit masks, flipped in as x
    # widens (`hadamard.with_sign_bits`: bf16 tokens, nothing before the rotation).
    SIGN_BITS: tl.constexpr = ROTATE and SIGNS.dtype.element_ty == tl.int32
    if SIGN_BITS:
        x = widen_bf16_signed(raw, tl.load(sign_ptrs))
    else:
        x = to_f32(raw, HW_CVT)
    if SMOOTH:
        # Loaded at x's full shape (L1 hits after the first token): a [1, D]
        # load would get a layout of its own that the whole pass then adopts.
        x = x - tl.load(MEAN + pid_bh * D + (d + t * 0))
    out_offs = pid_bh.to(tl.int64) * L * D + t * D + d
    row_offs = pid_bh.to(tl.int64) * L + t1
    if WRITE_NONE:
        tl.store(NONE_OUT + out_offs, to_dtype_exact(x, NONE_OUT.dtype.element_ty), mask=ok)
    # The rotation's 1 / sqrt(D) multiplies with each block's power of two
    # 2^-s (`folded_mx`). The same bits: a block that is not NaN/Inf has a
    # finite butterfly, so |x * NORM| < 2^128 * NORM and s <= 126 + log2(NORM)
    # in every format (e2m1's is the tightest), where 2^-s * NORM is normal.
    NORM: tl.constexpr = INV_SQRT_D if ROTATE else 1.0
    if ROTATE:
        # 64 tokens or more (`_token_block`) fill the 4 warps' 16 token rows
        # each, so each thread holds half of every block of its token.
        signs = None if SIGN_BITS else tl.load(sign_ptrs)
        x = rotate_rows(x, signs, D, INV_SQRT_D, BLOCK_T >= 64, NORMALIZE=False)
    elif PRESCALE:
        x = x * tl.load(sign_ptrs)
    if FMT1 != FMT_NONE:
        amax, bad = block_amax(x)
        if ROTATE:
            # Rounding is monotonic: the largest |x * NORM| is the largest |x| times NORM.
            amax = amax * NORM
        _quantize_mx(x, amax, bad, ok, row_ok, OUT1, EXPS1, SCALES1, out_offs, row_offs,
                     FMT1, FOLDED, RCEIL, POW2, HW_CVT, NORM)
        if FMT2 != FMT_NONE:
            _quantize_mx(x, amax, bad, ok, row_ok, OUT2, EXPS2, SCALES2, out_offs, row_offs,
                         FMT2, FOLDED, RCEIL, POW2, HW_CVT, NORM)


@triton.jit
def _quantize_tokens_kernel(
    X, sx_b, sx_h, sx_l, sx_d,
    MEAN, NONE_OUT, OUT1, EXPS1, SCALES1, OUT2, EXPS2, SCALES2, SIGNS, SIGNS_BH: tl.constexpr,
    H, L,
    D: tl.constexpr, BLOCK_T: tl.constexpr,
    SMOOTH: tl.constexpr, WRITE_NONE: tl.constexpr,
    FMT1: tl.constexpr, FMT2: tl.constexpr, FOLDED: tl.constexpr, RCEIL: tl.constexpr, POW2: tl.constexpr,
    HW_CVT: tl.constexpr, ROTATE: tl.constexpr, PRESCALE: tl.constexpr, INV_SQRT_D: tl.constexpr,
):
    _quantize_token_block(
        tl.program_id(0), tl.program_id(1), X, sx_b, sx_h, sx_l, sx_d,
        MEAN, NONE_OUT, OUT1, EXPS1, SCALES1, OUT2, EXPS2, SCALES2, SIGNS, SIGNS_BH, H, L,
        D, BLOCK_T, SMOOTH, WRITE_NONE, FMT1, FMT2, FOLDED, RCEIL, POW2, HW_CVT, ROTATE, PRESCALE, INV_SQRT_D)


@triton.jit
def _counted(KEEP, skp_b, skp_h, b, h, rows, ok, HAS_KEEP: tl.constexpr):
    """Which of the keys `rows` of (b, h) count for the statistics: those
    below L (ok) that the key-keep vector, if any, marks nonzero."""
    if HAS_KEEP:
        keep = tl.load(KEEP + b.to(tl.int64) * skp_b + h.to(tl.int64) * skp_h + rows, mask=ok, other=0)
        ok = ok & (keep != 0)
    return ok


@triton.jit
def _stats_load(ptrs, ok, TAIL: tl.constexpr):
    if TAIL:
        x = tl.load(ptrs, mask=ok[:, None], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def _kv_stats_tiles(
    l0, k_src, sk_l, sk_d, v_src, sv_l, sv_d, KEEP, skp_b, skp_h, b, h, L,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_L: tl.constexpr,
    NEED_K: tl.constexpr, NEED_V: tl.constexpr, HAS_KEEP: tl.constexpr, TAIL: tl.constexpr,
):
    """Keys l0 .. l0 + BLOCK_L of K and V (0 where not needed) and which of
    them count (`_counted`); only a TAIL step masks keys from L on: a masked
    load with a fill value writes its registers first, which orders it after
    the last use of whatever shared them."""
    rows = l0 + tl.arange(0, BLOCK_L)
    if TAIL:
        ok = rows < L
    else:
        ok = tl.full([BLOCK_L], True, tl.int1)
    kt = 0.0
    vt = 0.0
    if NEED_K:
        kt = _stats_load(k_src + rows[:, None].to(tl.int64) * sk_l + tl.arange(0, D)[None, :] * sk_d, ok, TAIL)
    if NEED_V:
        vt = _stats_load(v_src + rows[:, None].to(tl.int64) * sv_l + tl.arange(0, DV)[None, :] * sv_d, ok, TAIL)
    counted = _counted(KEEP, skp_b, skp_h, b, h, rows, ok, HAS_KEEP)[:, None]
    return kt, vt, counted


@triton.jit
def _kv_stats_accumulate(
    ksum, kcnt, vmax_bits, kt, vt, counted,
    NEED_K: tl.constexpr, NEED_V: tl.constexpr, HW_CVT: tl.constexpr,
):
    """The accumulators with one step's tiles (`_kv_stats_tiles`) added."""
    if NEED_K:
        k32 = to_f32(kt, HW_CVT)
        use = counted & (tl.abs(k32) < float("inf"))
        ksum += tl.where(use, k32, 0.0).to(tl.float64)
        kcnt += use.to(tl.int32)
    if NEED_V:
        bits = to_f32(vt, HW_CVT).to(tl.int32, bitcast=True) & 0x7FFFFFFF
        vmax_bits = tl.maximum(vmax_bits, tl.where(counted & (bits < 0x7F800000), bits, 0))
    return ksum, kcnt, vmax_bits


@triton.jit
def _kv_stats_chunk(
    pid_c, pid_bh,
    K, sk_b, sk_h, sk_l, sk_d, V, sv_b, sv_h, sv_l, sv_d,
    KSUM, KCNT, VMAX, KEEP, skp_b, skp_h, H, L, CHUNK, N_CHUNKS,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_L: tl.constexpr,
    NEED_K: tl.constexpr, NEED_V: tl.constexpr, HAS_KEEP: tl.constexpr, HW_CVT: tl.constexpr,
):
    """Chunk pid_c of the keys of (batch, head) pid_bh: over the finite
    elements of the counted keys, the float64 sum and the count of K and the
    amax of |V| (docs/semantics.md: a masked-out or non-finite key does not
    move the statistics of the others).

    The loop only loads and accumulates element-wise in registers; the one
    cross-thread reduction is after it. It loads each step's tiles one step
    ahead: the compiler issues a step's loads only after the first use of
    some of them, so loading and using in one step would wait a memory
    latency or two per step. |V|'s float32 bits order like |V|, Inf and NaN
    above every finite value, so the finite ones are those below Inf's bits.
    """
    b = pid_bh // H
    h = pid_bh % H
    ksum = tl.zeros([BLOCK_L, D], dtype=tl.float64)
    kcnt = tl.zeros([BLOCK_L, D], dtype=tl.int32)
    vmax_bits = tl.zeros([BLOCK_L, DV], dtype=tl.int32)
    k_src = K + b.to(tl.int64) * sk_b + h.to(tl.int64) * sk_h
    v_src = V + b.to(tl.int64) * sv_b + h.to(tl.int64) * sv_h
    start = pid_c * CHUNK
    end = tl.minimum(start + CHUNK, L)
    last_full = start + ((end - start) // BLOCK_L - 1) * BLOCK_L
    if last_full >= start:
        kt, vt, counted = _kv_stats_tiles(start, k_src, sk_l, sk_d, v_src, sv_l, sv_d, KEEP, skp_b, skp_h, b, h, L,
                                          D, DV, BLOCK_L, NEED_K, NEED_V, HAS_KEEP, False)
        for l0 in range(start, last_full, BLOCK_L):
            k_next, v_next, counted_next = _kv_stats_tiles(
                l0 + BLOCK_L, k_src, sk_l, sk_d, v_src, sv_l, sv_d, KEEP, skp_b, skp_h, b, h, L,
                D, DV, BLOCK_L, NEED_K, NEED_V, HAS_KEEP, False)
            ksum, kcnt, vmax_bits = _kv_stats_accumulate(ksum, kcnt, vmax_bits, kt, vt, counted,
                                                         NEED_K, NEED_V, HW_CVT)
            kt, vt, counted = k_next, v_next, counted_next
        ksum, kcnt, vmax_bits = _kv_stats_accumulate(ksum, kcnt, vmax_bits, kt, vt, counted, NEED_K, NEED_V, HW_CVT)
    if last_full + BLOCK_L < end:
        kt, vt, counted = _kv_stats_tiles(last_full + BLOCK_L, k_src, sk_l, sk_d, v_src, sv_l, sv_d, KEEP, skp_b,
                                          skp_h, b, h, L, D, DV, BLOCK_L, NEED_K, NEED_V, HAS_KEEP, True)
        ksum, kcnt, vmax_bits = _kv_stats_accumulate(ksum, kcnt, vmax_bits, kt, vt, counted, NEED_K, NEED_V, HW_CVT)
    dk = tl.arange(0, D)
    dv = tl.arange(0, DV)
    if NEED_K:
        tl.store(KSUM + (pid_bh * N_CHUNKS + pid_c) * D + dk, tl.sum(ksum, axis=0))
        tl.store(KCNT + (pid_bh * N_CHUNKS + pid_c) * D + dk, tl.sum(kcnt, axis=0))
    if NEED_V:
        vmax = tl.max(vmax_bits, axis=0).to(tl.float32, bitcast=True)
        tl.store(VMAX + (pid_bh * N_CHUNKS + pid_c) * DV + dv, vmax)


@triton.jit
def _kv_stats_finalize(
    pid_bh, KSUM, KCNT, VMAX, MEAN, VEXP, VSCALE, N_CHUNKS,
    FIN_CHUNKS: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, NEED_K: tl.constexpr, NEED_V: tl.constexpr,
):
    """K's mean over the counted finite values (reference.key_mean: float64
    sum and division, then float32; 0 without any); V's per-channel e4m3
    scale 2^e, the smallest with amax / 2^e <= 448.

    A float64 sum of 16-bit inputs is exact or nearly so in any order, so the
    mean rounds to the same float32 as the reference's; a float32 sum would
    differ by a few ulps, and smoothed keys near an MX rounding boundary would
    then round the other way. The chunks' partial results are read past L1
    (.cg: other programs wrote them), FIN_CHUNKS at a time: the registers
    of the launch's other programs are what this one needs at most.
    """
    c = tl.arange(0, FIN_CHUNKS)[:, None]
    if NEED_K:
        dk = tl.arange(0, D)
        total = tl.zeros([D], dtype=tl.float64)
        count = tl.zeros([D], dtype=tl.int32)
        for c0 in range(0, N_CHUNKS, FIN_CHUNKS):
            rows = (pid_bh * N_CHUNKS + c0 + c) * D + dk[None, :]
            ok = c0 + c < N_CHUNKS
            total += tl.sum(tl.load(KSUM + rows, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
            count += tl.sum(tl.load(KCNT + rows, mask=ok, other=0, cache_modifier=".cg"), axis=0)
        # A float64 `/` compiles to a correctly rounded division (float32's may not).
        mean = total / tl.maximum(count, 1).to(tl.float64)
        tl.store(MEAN + pid_bh * D + dk, tl.where(count > 0, mean, 0.0).to(tl.float32))
    if NEED_V:
        dv = tl.arange(0, DV)
        amax = tl.zeros([DV], dtype=tl.float32)
        for c0 in range(0, N_CHUNKS, FIN_CHUNKS):
            rows = (pid_bh * N_CHUNKS + c0 + c) * DV + dv[None, :]
            part = tl.load(VMAX + rows, mask=c0 + c < N_CHUNKS, other=0.0, cache_modifier=".cg")
            amax = tl.maximum(amax, tl.max(part, axis=0))
        # A channel without a nonzero value gets scale 1, as reference.fp8_value_scale.
        amax = tl.where(amax > 0, amax, 448.0)
        e, frac = log2_parts(amax)
        e = e + (frac > 0x600000).to(tl.int32) - 8
        tl.store(VEXP + pid_bh * DV + dv, e)
        tl.store(VSCALE + pid_bh * DV + dv, pow2_wide(e))


@triton.jit
def _kv_stats_kernel(
    K, sk_b, sk_h, sk_l, sk_d, V, sv_b, sv_h, sv_l, sv_d,
    KSUM, KCNT, VMAX, KEEP, skp_b, skp_h, H, L, CHUNK, N_CHUNKS, N_STATS,
    DONE, MEAN, VEXP, VSCALE,
    X, sx_b, sx_h, sx_l, sx_d, OUT1, EXPS1, SCALES1, OUT2, EXPS2, SCALES2, SIGNS, SIGNS_BH: tl.constexpr, HX, LX,
    N_TOKEN_BLOCKS,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_L: tl.constexpr, FIN_CHUNKS: tl.constexpr,
    NEED_K: tl.constexpr, NEED_V: tl.constexpr, HAS_KEEP: tl.constexpr, HW_CVT: tl.constexpr,
    DX: tl.constexpr, BLOCK_T: tl.constexpr,
    FMT1: tl.constexpr, FMT2: tl.constexpr, FOLDED: tl.constexpr, RCEIL: tl.constexpr, POW2: tl.constexpr,
    ROTATE: tl.constexpr, PRESCALE: tl.constexpr, INV_SQRT_D: tl.constexpr,
):
    """The statistics chunks (the first N_STATS programs), then the token
    blocks of an independent tensor X (Q) to quantize, if any.

    The last chunk of a (batch, head) to finish, by the count in DONE
    (zeros at launch), combines the chunks' partial results; the launch
    thus needs no second one for that, nor one of its own for Q (each
    launch costs host time, a start and a tail).
    """
    pid = tl.program_id(0)
    if pid < N_STATS:
        pid_bh = pid // N_CHUNKS
        _kv_stats_chunk(
            pid % N_CHUNKS, pid_bh, K, sk_b, sk_h, sk_l, sk_d, V, sv_b, sv_h, sv_l, sv_d,
            KSUM, KCNT, VMAX, KEEP, skp_b, skp_h, H, L, CHUNK, N_CHUNKS, D, DV, BLOCK_L, NEED_K, NEED_V, HAS_KEEP,
            HW_CVT)
        # Every thread's partial results are written before the count
        # (release) and read after it (acquire) by the last chunk.
        tl.debug_barrier()
        done = tl.atomic_add(DONE + pid_bh, 1, sem="acq_rel", scope="gpu")
        if done == N_CHUNKS - 1:
            _kv_stats_finalize(pid_bh, KSUM, KCNT, VMAX, MEAN, VEXP, VSCALE, N_CHUNKS, FIN_CHUNKS, D, DV, NEED_K,
                               NEED_V)
    else:
        t = pid - N_STATS
        _quantize_token_block(
            t % N_TOKEN_BLOCKS, t // N_TOKEN_BLOCKS, X, sx_b, sx_h, sx_l, sx_d,
            X, X, OUT1, EXPS1, SCALES1, OUT2, EXPS2, SCALES2, SIGNS, SIGNS_BH, HX, LX,
            DX, BLOCK_T, False, False, FMT1, FMT2, FOLDED, RCEIL, POW2, HW_CVT, ROTATE, PRESCALE, INV_SQRT_D)


def wgmma_key_order(length: int) -> torch.Tensor:
    """The key each column of a V^T in wgmma's operand order holds (`length`
    a multiple of 32): within each 32 keys, the order in which an FP8 wgmma's
    register operand A takes the columns of a Hopper accumulator tile. The
    Gluon kernel feeds P·V its P straight from QK^T's accumulator; with V^T's
    keys in this order every thread already holds the P elements of its
    operand, so no P element crosses threads (FlashAttention-3 permutes V the
    same way when it transposes V in shared memory)."""
    # Column t = 32g + 16h + 4q + 2j + e holds key 32g + 16h + 8j + 2q + e: an
    # accumulator thread q owns columns 8j + 2q + e, its operand 16h + 4q + 2j + e.
    t = torch.arange(length)
    return (t & ~15) | (((t >> 1) & 1) << 3) | (((t >> 2) & 3) << 1) | (t & 1)


@triton.jit
def _wgmma_key(t):
    """`wgmma_key_order` in a kernel."""
    return (t & ~15) | (((t >> 1) & 1) << 3) | (((t >> 2) & 3) << 1) | (t & 1)


@triton.jit
def _quantize_v_block(
    pid_t, pid_bh, V, sv_b, sv_h, sv_l, sv_d, VEXP, OUT, KEEP, skp_b, skp_h, H, L, L_COUNTED, L_PAD,
    DV: tl.constexpr, BLOCK_T: tl.constexpr, HAS_KEEP: tl.constexpr, HW_CVT: tl.constexpr,
    WGMMA_ORDER: tl.constexpr,
):
    """Keys block pid_t of (batch, head) pid_bh as e4m3(V / 2^e) per channel,
    stored transposed: OUT (B*H, DV, L_PAD). With WGMMA_ORDER, column t holds
    key `_wgmma_key(t)` and the padding columns up to L_PAD are written (zeros):
    permuted keys of the last 32 land there.

    Keys that do not count (at or past L_COUNTED, or zero in KEEP) are
    stored as zeros: no query row attends them, and a zero keeps their
    content out of the P·V products of the rows that mask them. Non-finite
    elements become e4m3 NaN (e4m3 has no Inf).

    BLOCK_T keys per program so each channel's row of the output is written
    as one run of BLOCK_T bytes (Triton transposes through shared memory).
    """
    b = pid_bh // H
    h = pid_bh % H
    col = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    if WGMMA_ORDER:
        t = _wgmma_key(col)
        written = col < L_PAD
    else:
        t = col
        written = col < L
    d = tl.arange(0, DV)
    ok = t < L
    src = V + b.to(tl.int64) * sv_b + h.to(tl.int64) * sv_h
    v = tl.load(src + t[:, None].to(tl.int64) * sv_l + d[None, :] * sv_d, mask=ok[:, None], other=0.0)
    e = tl.load(VEXP + pid_bh * DV + d)
    # 2^-e in two normal factors: e can lie outside float32's normal range.
    half = (-e) >> 1
    x = to_f32(v, HW_CVT) * pow2(half)[None, :] * pow2(-e - half)[None, :]
    bits = tl.where(tl.abs(x) < float("inf"), e4m3_code(x, HW_CVT), 0x7F)
    counted = _counted(KEEP, skp_b, skp_h, b, h, t, ok & (t < L_COUNTED), HAS_KEEP)
    bits = tl.where(counted[:, None], bits, 0)
    dst = OUT + pid_bh.to(tl.int64) * DV * L_PAD
    tl.store(dst + d[:, None] * L_PAD + col[None, :], tl.trans(bits), mask=written[None, :])


@triton.jit
def _quantize_kv_kernel(
    X, sx_b, sx_h, sx_l, sx_d, MEAN, NONE_OUT, OUT1, EXPS1, SCALES1, OUT2, EXPS2, SCALES2, SIGNS, SIGNS_BH: tl.constexpr,
    H, L, N_TOKEN_BLOCKS, N_TOKEN_PROGRAMS,
    V, sv_b, sv_h, sv_l, sv_d, VEXP, VT, KEEP, skp_b, skp_h, HV, LV, L_COUNTED, L_PAD, N_V_BLOCKS,
    D: tl.constexpr, BLOCK_T: tl.constexpr, SMOOTH: tl.constexpr, WRITE_NONE: tl.constexpr,
    FMT1: tl.constexpr, FMT2: tl.constexpr, FOLDED: tl.constexpr, RCEIL: tl.constexpr, POW2: tl.constexpr,
    HW_CVT: tl.constexpr, ROTATE: tl.constexpr, PRESCALE: tl.constexpr, INV_SQRT_D: tl.constexpr,
    DV: tl.constexpr, BLOCK_V: tl.constexpr, HAS_KEEP: tl.constexpr, WGMMA_ORDER: tl.constexpr,
):
    """The token blocks of X (K: smoothed, quantized; the first
    N_TOKEN_PROGRAMS programs), then V's blocks into e4m3 V^T: both need
    the statistics, so they share the launch after it."""
    pid = tl.program_id(0)
    if pid < N_TOKEN_PROGRAMS:
        _quantize_token_block(
            pid % N_TOKEN_BLOCKS, pid // N_TOKEN_BLOCKS, X, sx_b, sx_h, sx_l, sx_d,
            MEAN, NONE_OUT, OUT1, EXPS1, SCALES1, OUT2, EXPS2, SCALES2, SIGNS, SIGNS_BH, H, L,
            D, BLOCK_T, SMOOTH, WRITE_NONE, FMT1, FMT2, FOLDED, RCEIL, POW2, HW_CVT, ROTATE, PRESCALE, INV_SQRT_D)
    else:
        t = pid - N_TOKEN_PROGRAMS
        _quantize_v_block(t % N_V_BLOCKS, t // N_V_BLOCKS, V, sv_b, sv_h, sv_l, sv_d, VEXP, VT, KEEP, skp_b, skp_h,
                          HV, LV, L_COUNTED, L_PAD, DV, BLOCK_V, HAS_KEEP, HW_CVT, WGMMA_ORDER)


@dataclass
class Operand:
    """Q or K as one QK^T format needs it in the attention kernel.

    values: (B, H, L, D), in the input dtype ("none"), bf16 (exact MX) or
    float8_e4m3fn (folded MX); exponents: (B, H, L) int32, the per-token power
    of two of folded MX (None otherwise); scales: (B, H, L) float32,
    2^exponents clamped to float32's normal range, for kernels that multiply
    by them (written only when asked).
    """

    values: torch.Tensor
    exponents: torch.Tensor | None = None
    scales: torch.Tensor | None = None


def _token_block(d: int, rotating: bool = False) -> int:
    """Tokens per program of the token pass: 4096 elements, 32 per thread of
    4 warps, i.e. four 16-byte loads of a 16-bit input in flight each.

    A rotating pass at D <= 128 takes at least 64 tokens: Triton 3.6 then
    lays each token's D / 32 blocks out in one thread (the 4 warps' 16 rows
    of threads all go to tokens), so the butterfly moves data between two
    lanes in one stage and never through shared memory (hadamard.py; Triton
    3.9 spreads the blocks over lanes: more shuffles, still no shared
    memory). At D 256 that would be 128 values per thread (spills): 16
    tokens, the general butterfly.
    """
    if rotating and d <= 128:
        return max(64, 4096 // d)
    return max(8, 4096 // d)


@dataclass
class TokenPlan:
    """One token-pass launch over x: the operands it fills and the arguments
    of `_quantize_token_block` that fill them (None when nothing is computed)."""

    operands: dict[str, Operand]
    args: dict | None
    blocks_per_head: int
    heads: int


def plan_tokens(
    x: torch.Tensor,
    formats: tuple[str, ...],
    mx_mode: str = "folded",
    scale_rule: str = "rceil",
    mean: torch.Tensor | None = None,
    write_none: bool = False,
    pow2_scales: bool = False,
    rotate: str = "none",
    balance: torch.Tensor | None = None,
) -> TokenPlan:
    """Allocate the outputs of `quantize_tokens` and the launch that fills them."""
    b, h, length, d = x.shape
    if d % 32 != 0 or d & (d - 1):
        raise ValueError(f"x: head_dim must be a power of two and a multiple of 32, got {d}")
    transform = transform_arguments(x, rotate, balance)
    rotating = transform["ROTATE"]
    mx, format_codes = mx_format_slots(formats)
    folded = mx_mode == "folded"
    pow2 = folded and pow2_scales
    operands: dict[str, Operand] = {}
    outs = []
    for fmt in mx:
        if folded:
            op = Operand(
                torch.empty(b, h, length, d, dtype=torch.float8_e4m3fn, device=x.device),
                torch.empty(b, h, length, dtype=torch.int32, device=x.device),
                torch.empty(b, h, length, dtype=torch.float32, device=x.device) if pow2 else None,
            )
            outs.append((op.values.view(torch.uint8), op.exponents, op.scales if pow2 else op.exponents))
        else:
            op = Operand(torch.empty(b, h, length, d, dtype=torch.bfloat16, device=x.device))
            outs.append((op.values, op.values, op.values))
        operands[fmt] = op
    none_out = None
    if write_none:
        none_out = torch.empty(b, h, length, d, dtype=x.dtype, device=x.device)
        operands["none"] = Operand(none_out)
    block_t = _token_block(d, rotating and bool(mx))
    plan = TokenPlan(operands, None, cdiv(length, block_t), b * h)
    if not mx and not write_none:
        return plan
    while len(outs) < 2:
        outs.append((x, x, x))
    smooth = mean is not None
    if mx:
        transform = with_sign_bits(transform, x, rotate, plain=not smooth and not write_none)
    plan.args = dict(
        X=x, sx_b=x.stride(0), sx_h=x.stride(1), sx_l=x.stride(2), sx_d=x.stride(3),
        MEAN=mean.contiguous() if smooth else x, NONE_OUT=none_out if write_none else x,
        OUT1=outs[0][0], EXPS1=outs[0][1], SCALES1=outs[0][2], OUT2=outs[1][0], EXPS2=outs[1][1], SCALES2=outs[1][2],
        H=h, L=length, D=d, BLOCK_T=block_t, SMOOTH=smooth, WRITE_NONE=write_none,
        **format_codes,
        FOLDED=folded, RCEIL=scale_rule == "rceil", POW2=pow2, HW_CVT=HW_CVT,
        **{**transform, "ROTATE": rotating and bool(mx), "PRESCALE": transform["PRESCALE"] and bool(mx)},
    )
    return plan


def launch_tokens(plan: TokenPlan, block_t: int | None = None, num_warps: int = 4) -> None:
    """Carry out plan by a launch of its own; block_t (tokens per program,
    default the plan's) and num_warps are for launch sweeps."""
    if plan.args is None:
        return
    args, blocks = plan.args, plan.blocks_per_head
    if block_t is not None:
        args, blocks = {**args, "BLOCK_T": block_t}, cdiv(args["L"], block_t)
    launch(_quantize_tokens_kernel, (blocks, plan.heads), **args, num_warps=num_warps)


def compile_tokens(formats: tuple[str, ...], mx_mode: str = "folded", scale_rule: str = "rceil",
                   rotate: str = "none", head_dim: int = 128, dtype: torch.dtype = torch.bfloat16,
                   capability: int = 90):
    """Compile the token pass for CUDA compute capability `capability` (90:
    sm_90a) on any machine, GPU or not, specialised as `launch_tokens` of a
    plan over (1, 8, 4096, head_dim) tokens would be. Returns Triton's
    compiled kernel (`.asm` holds "ttgir", "ptx", "cubin"); needs
    TRITON_INTERPRET unset."""
    from dma_compile.kernels.target_compile import compile_for_target

    x = torch.empty(1, 8, 4096, head_dim, dtype=dtype)
    plan = plan_tokens(x, formats, mx_mode, scale_rule, pow2_scales=True, rotate=rotate)
    return compile_for_target(_quantize_tokens_kernel, plan.args, capability, 4, 3)


def quantize_tokens(
    x: torch.Tensor,
    formats: tuple[str, ...],
    mx_mode: str = "folded",
    scale_rule: str = "rceil",
    mean: torch.Tensor | None = None,
    write_none: bool = False,
    pow2_scales: bool = False,
    rotate: str = "none",
    balance: torch.Tensor | None = None,
) -> dict[str, Operand]:
    """Quantize x (B, H, L, D) along D for each MX format in `formats`.

    mean: (B, H, D) float32 to subtract first (K smoothing). write_none: also
    return the (smoothed) values rounded to x's dtype under the key "none".
    pow2_scales: folded operands also get `Operand.scales`. rotate: the
    rotation (dma_compile.rotation) applied after smoothing, before the MX
    formats (not to "none"). balance: (B, H, D) powers of two multiplying
    each (batch, head)'s channels before the rotation
    (`AttentionPolicy.balance_qk`; MX formats only).
    """
    plan = plan_tokens(x, formats, mx_mode, scale_rule, mean, write_none, pow2_scales, rotate, balance)
    launch_tokens(plan)
    return plan.operands


@dataclass
class KVStatistics:
    """K's mean over keys (B, H, D) float32, and V's e4m3 per-channel exponents
    (B, H, Dv) int32 and scales 2^e (B, H, Dv) float32; None where not asked."""

    key_mean: torch.Tensor | None
    value_exponents: torch.Tensor | None
    value_scales: torch.Tensor | None


def _stats_chunking(b: int, h: int, length: int, d: int, dv: int, with_v: bool,
                    step_elements: int = 2048, programs: int = 512) -> tuple[int, int, int]:
    """(keys per loop step, keys per chunk, chunks per head) of the statistics pass.

    2048 elements of each tensor per step (16 per thread of 4 warps; 8192
    at head_dim 128 took every register and spilled, 1024 and 4096 were
    slower) and about 512 programs: with each step's loads issued a step ahead, longer chunks
    beat more programs (BENCHMARKS.md, 2026-12-07, second session: swept
    with 256 to 2048 programs at three shapes). At most 256 chunks per head
    for the finalize kernel.
    """
    block_l = max(1, step_elements // max(d, dv if with_v else d))
    n_chunks = max(1, min(cdiv(length, block_l), cdiv(programs, b * h), 256))
    chunk = max(block_l, cdiv(cdiv(length, n_chunks), block_l) * block_l)
    return block_l, chunk, cdiv(length, chunk)


_SHARED_TOKEN_ARGS = ("X", "sx_b", "sx_h", "sx_l", "sx_d", "OUT1", "EXPS1", "SCALES1", "OUT2", "EXPS2", "SCALES2",
                      "BLOCK_T", "FMT1", "FMT2", "FOLDED", "RCEIL", "POW2", "SIGNS", "SIGNS_BH", "ROTATE", "PRESCALE",
                      "INV_SQRT_D")


def _idle_token_args(placeholder: torch.Tensor) -> dict:
    """`plan_tokens`' launch arguments for no tokens at all, for a launch
    whose token programs share a kernel with other work and number zero."""
    p = placeholder
    return dict(X=p, sx_b=0, sx_h=0, sx_l=0, sx_d=0, MEAN=p, NONE_OUT=p, OUT1=p, EXPS1=p, SCALES1=p, OUT2=p,
                EXPS2=p, SCALES2=p, H=1, L=1, D=32, BLOCK_T=8, SMOOTH=False, WRITE_NONE=False, FMT1=0, FMT2=0,
                FOLDED=True, RCEIL=True, POW2=False, HW_CVT=HW_CVT, SIGNS=p, SIGNS_BH=0, ROTATE=False, PRESCALE=False,
                INV_SQRT_D=1.0)


def _token_launch_args(plan: TokenPlan | None, placeholder: torch.Tensor) -> tuple[dict, int, int]:
    """(plan's launch arguments, its token blocks per head, its number of
    programs), the idle ones (`_idle_token_args`) and (1, 0) without one."""
    if plan is None or plan.args is None:
        return _idle_token_args(placeholder), 1, 0
    return plan.args, plan.blocks_per_head, plan.blocks_per_head * plan.heads


def _shared_token_args(plan: TokenPlan | None, placeholder: torch.Tensor) -> tuple[dict, int]:
    """`_kv_stats_kernel`'s token arguments for plan and its number of token
    programs (placeholders and 0 without one)."""
    a, blocks_per_head, programs = _token_launch_args(plan, placeholder)
    args = {name: a[name] for name in _SHARED_TOKEN_ARGS}
    args.update(HX=a["H"], LX=a["L"], DX=a["D"], N_TOKEN_BLOCKS=blocks_per_head)
    return args, programs


def key_keep_arguments(key_keep: torch.Tensor | None, b: int, h: int, length: int, placeholder: torch.Tensor):
    """(KEEP, its batch and head strides, HAS_KEEP) for a key-keep vector
    broadcastable to (b, h, length), any dtype, nonzero = the key counts;
    KEEP's key stride is 1."""
    if key_keep is None:
        return placeholder, 0, 0, False
    if key_keep.dim() != 3 or key_keep.shape[-1] != length:
        raise ValueError(f"key_keep: expected a (B, H, {length}) tensor, got shape {tuple(key_keep.shape)}")
    keep = key_keep.view(torch.uint8) if key_keep.dtype == torch.bool else key_keep
    keep = keep.expand(b, h, length)
    if keep.stride(-1) != 1:
        keep = keep.contiguous()
    return keep, keep.stride(0), keep.stride(1), True


def kv_statistics(
    k: torch.Tensor, v: torch.Tensor, key_mean: bool, value_scale: bool, alongside: TokenPlan | None = None,
    key_keep: torch.Tensor | None = None, key_limit: int | None = None, chunking: dict | None = None,
    num_warps: int = 4,
) -> KVStatistics:
    """One launch over K and V, chunked over keys, whose last chunk per head
    combines the others' (see _kv_stats_finalize).

    The key mean equals reference.key_mean's (see _kv_stats_finalize).
    alongside: an unsmoothed token plan of another tensor (Q), carried out
    by the same launch (by its own where no statistics are asked).
    key_keep, key_limit: which keys count (reference.counted_keys): those
    below key_limit (default: all) that key_keep, broadcastable to
    (B, H, Lk) (e.g. `masks.MaskInfo.kept_keys`), marks nonzero; non-finite
    elements never count. chunking (`_stats_chunking`'s elements per step
    and programs) and num_warps are for launch sweeps.
    """
    if alongside is not None and alongside.args is not None and (
        alongside.args["SMOOTH"] or alongside.args["WRITE_NONE"]
    ):
        raise ValueError("alongside: only a plan without mean and write_none can share the statistics launch")
    if not (key_mean or value_scale):
        if alongside is not None:
            launch_tokens(alongside)
        return KVStatistics(None, None, None)
    grid, args, stats = _statistics_launch(k, v, key_mean, value_scale, alongside, key_keep, key_limit, chunking)
    launch(_kv_stats_kernel, grid, **args, num_warps=num_warps)
    return stats


def _statistics_launch(k, v, key_mean, value_scale, alongside, key_keep, key_limit, chunking: dict | None = None):
    """(grid, arguments by name, outputs) of `kv_statistics`' launch;
    chunking: `_stats_chunking`'s keyword arguments, for launch sweeps."""
    b, h, full_length, d = k.shape
    dv = v.shape[-1]
    keep, skp_b, skp_h, has_keep = key_keep_arguments(key_keep, b, h, full_length, k)
    if key_limit is not None and key_limit < 1:
        raise ValueError(f"key_limit: must be at least 1, got {key_limit}")
    # Keys from key_limit on do not count: the pass stops before them.
    length = min(full_length, key_limit) if key_limit is not None else full_length
    block_l, chunk, n_chunks = _stats_chunking(b, h, length, d, dv, value_scale, **(chunking or {}))
    dev = k.device
    ksum = torch.empty(b * h, n_chunks, d, dtype=torch.float64, device=dev) if key_mean else None
    kcnt = torch.empty(b * h, n_chunks, d, dtype=torch.int32, device=dev) if key_mean else None
    vmax = torch.empty(b * h, n_chunks, dv, dtype=torch.float32, device=dev) if value_scale else None
    mean = torch.empty(b, h, d, dtype=torch.float32, device=dev) if key_mean else None
    vexp = torch.empty(b, h, dv, dtype=torch.int32, device=dev) if value_scale else None
    vscale = torch.empty(b, h, dv, dtype=torch.float32, device=dev) if value_scale else None
    n_stats = n_chunks * b * h
    token_args, n_token_programs = _shared_token_args(alongside, k)
    some_stat = ksum if key_mean else vmax
    some = mean if key_mean else vscale
    args = dict(
        K=k, sk_b=k.stride(0), sk_h=k.stride(1), sk_l=k.stride(2), sk_d=k.stride(3),
        V=v, sv_b=v.stride(0), sv_h=v.stride(1), sv_l=v.stride(2), sv_d=v.stride(3),
        KSUM=some_stat, KCNT=kcnt if key_mean else some_stat, VMAX=vmax if value_scale else some_stat,
        KEEP=keep, skp_b=skp_b, skp_h=skp_h, H=h, L=length, CHUNK=chunk, N_CHUNKS=n_chunks, N_STATS=n_stats,
        DONE=zeros(b * h, dev), MEAN=some, VEXP=vexp if value_scale else some, VSCALE=vscale if value_scale else some,
        D=d, DV=dv, BLOCK_L=block_l, FIN_CHUNKS=32, NEED_K=key_mean, NEED_V=value_scale,
        HAS_KEEP=has_keep, HW_CVT=HW_CVT, **token_args,
    )
    return (n_stats + n_token_programs,), args, KVStatistics(mean, vexp, vscale)


def compile_statistics(head_dim: int = 128, key_mean: bool = True, value_scale: bool = True,
                       dtype: torch.dtype = torch.bfloat16, capability: int = 90):
    """Compile the statistics pass for CUDA compute capability `capability`
    (90: sm_90a) on any machine, GPU or not, specialised as `kv_statistics`
    on (1, 8, 16384, head_dim) keys and values would launch it. Returns
    Triton's compiled kernel; needs TRITON_INTERPRET unset."""
    from dma_compile.kernels.target_compile import compile_for_target

    k = torch.empty(1, 8, 16384, head_dim, dtype=dtype)
    _, args, _ = _statistics_launch(k, torch.empty_like(k), key_mean, value_scale, None, None, None)
    return compile_for_target(_kv_stats_kernel, args, capability, 4, 3)


def _value_block(dv: int) -> int:
    """Keys per program of V's pass at 4 warps: 128 (128-byte output rows) at
    D 128 and 64 at D 64, as measured best on an H200; 32 at D 256 keeps the
    elements per thread of D 128 (not measured)."""
    return 128 if dv == 128 else (64 if dv < 128 else 32)


def quantize_keys_and_values(
    keys: TokenPlan | None, v: torch.Tensor, value_exponents: torch.Tensor,
    key_keep: torch.Tensor | None = None, key_limit: int | None = None, wgmma_order: bool = False,
) -> torch.Tensor:
    """K's token plan (`plan_tokens`, smoothed by the statistics' mean), if
    any, and V into e4m3 V^T, in one launch. Returns V^T: e4m3(V / 2^e)
    transposed to (B, H, Dv, L_pad), L_pad a multiple of 16; with
    wgmma_order, of 32, each 32 keys in `wgmma_key_order`.

    key_keep, key_limit: as for `kv_statistics`; keys that do not count are
    stored as zeros, non-finite elements as e4m3 NaN.
    """
    b, h, length, dv = v.shape
    keep, skp_b, skp_h, has_keep = key_keep_arguments(key_keep, b, h, length, v)
    align = 32 if wgmma_order else 16
    l_pad = cdiv(length, align) * align
    out = torch.empty(b, h, dv, l_pad, dtype=torch.float8_e4m3fn, device=v.device)
    # A multiple of 32, so the programs over the keys also cover the last padding columns.
    block_v = _value_block(dv)
    n_v_blocks = cdiv(length, block_v)
    token_args, blocks_per_head, n_token_programs = _token_launch_args(keys, v)
    launch(
        _quantize_kv_kernel, (n_token_programs + n_v_blocks * b * h,),
        V=v, sv_b=v.stride(0), sv_h=v.stride(1), sv_l=v.stride(2), sv_d=v.stride(3), VEXP=value_exponents,
        VT=out.view(torch.uint8), KEEP=keep, skp_b=skp_b, skp_h=skp_h, HV=h, LV=length,
        L_COUNTED=length if key_limit is None else key_limit, L_PAD=l_pad, N_V_BLOCKS=n_v_blocks,
        N_TOKEN_BLOCKS=blocks_per_head, N_TOKEN_PROGRAMS=n_token_programs,
        DV=dv, BLOCK_V=block_v, HAS_KEEP=has_keep, WGMMA_ORDER=wgmma_order, **token_args, num_warps=4,
    )
    return out


def quantize_values_fp8(
    v: torch.Tensor, value_exponents: torch.Tensor, key_keep: torch.Tensor | None = None, key_limit: int | None = None,
    wgmma_order: bool = False,
) -> torch.Tensor:
    """V alone into e4m3 V^T (`quantize_keys_and_values` without keys)."""
    return quantize_keys_and_values(None, v, value_exponents, key_keep, key_limit, wgmma_order)
