"""Split-K flash-decoding over the quantized KV cache (dma_compile.kv_cache).

One program per (batch, KV head, key chunk) serves every query head of the KV
head (GQA) and every new query token (1 .. a few, causal among themselves):
its rows are (head, token) pairs. Program chunk 0 reads the sinks and the
recent window, kept in the input dtype; the other chunks split the quantized
middle of the cache. Each reads the payload bytes and scales of
`dma_compile.cache_formats` directly and dequantizes in registers (e4m3 and
e2m1 times a power of two are exact in bf16/fp16), so no wider copy of the
cache is ever written. Per chunk it writes the normalised partial output and
its log-sum-exp (base 2); a second kernel merges the chunks.

Sequences of one batch may have different lengths (`lengths`); chunks past a
sequence's end write an empty partial (log-sum-exp -inf). A key-keep vector
per sequence (`key_keep`) leaves out cached positions that no query of it
sees, as a padded batch's key-padding mask does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from dma_compile import cache_formats
from dma_compile.kernels import Unsupported
from dma_compile.kernels.codes import FMT_E2M1, FMT_E4M3, FMT_NONE, LOG2E, MX_FORMAT_CODES
from dma_compile.kernels.launch import LAUNCH_OPTIONS
from dma_compile.kernels.numerics import HW_CVT, INTERPRET, pow2_wide, to_f32
from dma_compile.kernels.quantize import key_keep_arguments

# Cache format name -> element format code.
CACHE_FORMAT_CODES = {"none": FMT_NONE.value, **{f: MX_FORMAT_CODES[f] for f in ("mxfp8_e4m3", "mxfp4_e2m1")}}
HEAD_DIMS = (32, 64, 128, 256)
# Keys per block of an e4m3 V store (cache_formats: channel-major within a block).
KEY_BLOCK = tl.constexpr(cache_formats.KEY_BLOCK)
MAX_ROWS = 128


@triton.jit
def _scale_of(byte):
    """2^(byte - 127) for a stored exponent byte; 255 (a NaN token) reads NaN."""
    return tl.where(byte == 255, float("nan"), pow2_wide(byte.to(tl.int32) - 127))


@triton.jit
def _e4m3_values(bits, DTYPE: tl.constexpr, HW_CVT: tl.constexpr):
    """e4m3 bytes as DTYPE on the GPU; as float32 by integer arithmetic under the
    interpreter (whose fp8 and bf16 conversions are not exact)."""
    if HW_CVT:
        r = bits.to(tl.float8e4nv, bitcast=True).to(DTYPE)
    else:
        b = bits.to(tl.int32)
        e = (b >> 3) & 15
        m = (b & 7).to(tl.float32)
        mag = tl.where(e == 0, m * 0.001953125, (8.0 + m) * pow2_wide(e - 10))
        mag = tl.where((b & 127) == 127, float("nan"), mag)
        r = tl.where((b & 128) != 0, -mag, mag)
    return r


# Four packed bytes ($4) to eight fp16s, by way of e4m3: a code's bits placed
# in an e4m3 byte (sign at 7, exponent and mantissa at 2..4) are its value
# times 2^-6 exactly, subnormals included, and never e4m3's NaN; Hopper
# converts two e4m3s to fp16 in one instruction. Low nibbles (even
# elements) go to $0 (bytes 0, 1) and $1 (bytes 2, 3), high nibbles (odd
# elements) to $2, $3.
_E2M1_PAIRS_ASM = tl.constexpr(
    "{ .reg .b32 e, o, t; .reg .b16 e0, e1, o0, o1; "
    "shl.b32 e, $4, 2; and.b32 e, e, 0x1C1C1C1C; shl.b32 t, $4, 4; and.b32 t, t, 0x80808080; or.b32 e, e, t; "
    "shr.b32 o, $4, 2; and.b32 o, o, 0x1C1C1C1C; and.b32 t, $4, 0x80808080; or.b32 o, o, t; "
    "mov.b32 {e0, e1}, e; mov.b32 {o0, o1}, o; "
    "cvt.rn.f16x2.e4m3x2 $0, e0; cvt.rn.f16x2.e4m3x2 $1, e1; "
    "cvt.rn.f16x2.e4m3x2 $2, o0; cvt.rn.f16x2.e4m3x2 $3, o1; }")
# What the unpacked values are worth: the code's value times this.
E2M1_UNPACKED_SCALE = tl.constexpr(2.0 ** -6)


@triton.jit
def _e2m1_half_bits(codes):
    """E2M1 codes (low 4 bits of int16) as fp16 bits worth the value times 2^-14."""
    return (((codes & 7) << 9) | ((codes & 8) << 12)).to(tl.float16, bitcast=True)


@triton.jit
def _e2m1_pairs(packed, HW_CVT: tl.constexpr):
    """The two E2M1 codes of each packed byte (low nibble: the even element),
    each worth its value times E2M1_UNPACKED_SCALE (exact): fp16 on the GPU,
    float32 under the interpreter.

    On the GPU the codes become e4m3 bytes and then fp16, four packed bytes
    at a time (`_E2M1_PAIRS_ASM`); the interpreter, which runs no assembly,
    places each code's bits at the top of an fp16 (sign at 15, exponent and
    mantissa at 9..11: its value times 2^-14 exactly, subnormals included).
    """
    if HW_CVT:
        even, odd = tl.inline_asm_elementwise(
            asm=_E2M1_PAIRS_ASM, constraints="=r,=r,=r,=r,r", args=[packed], dtype=(tl.float16, tl.float16),
            is_pure=True, pack=4)
    else:
        c = packed.to(tl.int16)
        even = _e2m1_half_bits(c).to(tl.float32) * (16384.0 * E2M1_UNPACKED_SCALE)
        odd = _e2m1_half_bits(c >> 4).to(tl.float32) * (16384.0 * E2M1_UNPACKED_SCALE)
    return even, odd


@triton.jit
def _operand(x, DTYPE: tl.constexpr, HW_CVT: tl.constexpr):
    """A dot operand: DTYPE on the GPU (exact for the cache's values), float32
    under the interpreter, which multiplies 16-bit floats through float32 anyway."""
    if HW_CVT:
        r = x.to(DTYPE)
    else:
        r = to_f32(x, HW_CVT)
    return r


@triton.jit
def _scores(
    q, q_even, q_odd, q16, q16_scale, kp, sb, pos, ok, stride_kt, sm_scale,
    FMT: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BLOCK_N: tl.constexpr, HW_CVT: tl.constexpr,
):
    """sm_scale * q @ k^T (float32, (W, rows, BLOCK_N)) for the keys at `pos`
    (W, BLOCK_N) of a K store of format FMT (kp: this sequence and head's
    payload base pointer; sb: the keys' scale bytes, `_scale_bytes`); q
    operands are (W, rows, D), one copy per warp, and for MXFP4 keys tuples
    of D / 32 (W, rows, 16): q16's even and odd elements per key block.
    q16_scale holds sm_scale already.

    Quantized keys multiply q16 = q / q16_scale in fp16: e4m3 converts to
    fp16 in one instruction per pair, to bf16 in two more, and the products
    are exact in both. MXFP4 keys take one product per 32-element block,
    scaled by the block's scale in float32: the unpacked codes enter the
    matmul as they are (scaling each element would put them in a layout
    that has to change, through shared memory, on the way to the matmul)."""
    if FMT == FMT_E2M1:
        scales = _scale_of(sb)
        which = tl.arange(0, D // 32)[None, None, :]
        s = tl.zeros((W, q16.shape[1], BLOCK_N), dtype=tl.float32)
        for blk in tl.static_range(D // 32):
            dh = blk * 16 + tl.arange(0, 16)
            packed = tl.load(kp + pos[:, :, None] * stride_kt + dh[None, None, :], mask=ok[:, :, None], other=0)
            k_even, k_odd = _e2m1_pairs(packed, HW_CVT)
            part = tl.dot(q_even[blk], tl.trans(k_even, (0, 2, 1))) + tl.dot(q_odd[blk], tl.trans(k_odd, (0, 2, 1)))
            block_scale = tl.sum(tl.where(which == blk, scales, 0.0), 2)
            s += part * block_scale[:, None, :]
        s = s * (q16_scale * (1.0 / E2M1_UNPACKED_SCALE))[None, :, None]
    else:
        d = tl.arange(0, D)
        raw = tl.load(kp + pos[:, :, None] * stride_kt + d[None, None, :], mask=ok[:, :, None], other=0)
        if FMT == FMT_E4M3:
            s = tl.dot(q16, tl.trans(_e4m3_values(raw, tl.float16, HW_CVT), (0, 2, 1)))
            s = s * q16_scale[None, :, None] * _scale_of(sb)[:, None, :]
        else:
            s = tl.dot(q, tl.trans(_operand(raw, q.dtype, HW_CVT), (0, 2, 1))) * sm_scale
    return s


@triton.jit
def _key_block_bytes(vp, pos, ok, stride_vb, ALL_KEPT: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr):
    """The bytes (W, BLOCK_N, D) of the values at `pos` of a store in key
    blocks (KEY_BLOCK keys, channel-major; stride_vb between blocks). Each
    warp's BLOCK_N keys are aligned and lie in one block, so every channel's
    keys are contiguous: whole-vector loads, and P·V's operand (pairs of keys
    per channel) forms without byte gathers. Unless ALL_KEPT,
    keys outside `ok` read 0 (they may hold anything, NaN included), and a
    warp with no key in `ok` reads nothing (its block may not exist)."""
    first = tl.min(pos, 1)
    # Each warp's first key is a multiple of BLOCK_N (decode_attention's alignment check).
    base = tl.multiple_of(first // KEY_BLOCK * stride_vb + first % KEY_BLOCK, BLOCK_N)
    addr = base[:, None, None] + tl.arange(0, D)[None, :, None] * KEY_BLOCK + tl.arange(0, BLOCK_N)[None, None, :]
    if ALL_KEPT:
        raw = tl.load(vp + addr)
    else:
        block_ok = tl.max(ok.to(tl.int32), 1) > 0
        raw = tl.load(vp + addr, mask=block_ok[:, None, None], other=0)
    raw = tl.trans(raw, (0, 2, 1))
    if not ALL_KEPT:
        raw = tl.where(ok[:, :, None], raw, 0)
    return raw


@triton.jit
def _pv(
    p, acc, vp, sb, pos, ok, stride_vt, ALL_KEPT: tl.constexpr, V_BLOCKED: tl.constexpr,
    FMT: tl.constexpr, DTYPE: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, HW_CVT: tl.constexpr,
):
    """acc + p @ v for the values at `pos` (W, BLOCK_N) of a V store of format
    FMT (sb: their scale bytes, `_scale_bytes`); p and acc are (W, rows,
    BLOCK_N) and (W, rows, D). With V_BLOCKED the store is in key blocks
    (`_key_block_bytes`; stride_vt between blocks), else token after token
    (stride_vt between tokens). ALL_KEPT: every key at pos is in `ok`.

    e4m3 values run in fp16 (see _scores). Their per-token scales 2^s split
    into each warp's largest, applied to the product, and 2^(s - largest) <= 1
    folded into p: p then fits fp16 whatever the scales (a padded position's
    byte 0 scales by 2^-127, never the largest)."""
    if V_BLOCKED:
        raw = _key_block_bytes(vp, pos, ok, stride_vt, ALL_KEPT, D, BLOCK_N)
    else:
        d = tl.arange(0, D)
        raw = tl.load(vp + pos[:, :, None] * stride_vt + d[None, None, :], mask=ok[:, :, None], other=0)
    if FMT == FMT_E4M3:
        scale = _scale_of(sb)
        top = tl.max(scale, 1)
        p = p * (scale / top[:, None])[:, None, :]
        r = acc + tl.dot(_operand(p, tl.float16, HW_CVT), _e4m3_values(raw, tl.float16, HW_CVT)) * top[:, None, None]
    else:
        r = tl.dot(_operand(p, DTYPE, HW_CVT), _operand(raw, DTYPE, HW_CVT), acc)
    return r


@triton.jit
def _scale_bytes(ptr, pos, ok, stride, FMT: tl.constexpr, OTHER: tl.constexpr, D: tl.constexpr):
    """The scale bytes of the tokens at `pos` (W, BLOCK_N) of a store of format
    FMT: one per token (e4m3), D / 32 (e2m1), none (a placeholder 0). A padded
    position reads OTHER."""
    if FMT == FMT_E2M1:
        db = tl.arange(0, D // 32)
        r = tl.load(ptr + pos[:, :, None] * stride + db[None, None, :], mask=ok[:, :, None], other=OTHER)
    elif FMT == FMT_E4M3:
        r = tl.load(ptr + pos * stride, mask=ok, other=OTHER)
    else:
        r = tl.zeros_like(pos).to(tl.uint8)
    return r


@triton.jit
def _kept_bytes(sb, ok, OTHER: tl.constexpr, FMT: tl.constexpr):
    """Scale bytes (`_scale_bytes`) with those of keys outside `ok` (W, BLOCK_N) set to OTHER."""
    if FMT == FMT_E2M1:
        r = tl.where(ok[:, :, None], sb, OTHER)
    elif FMT == FMT_E4M3:
        r = tl.where(ok, sb, OTHER)
    else:
        r = sb
    return r


@triton.jit
def _step(
    acc, m_i, l_i, k_sb, v_sb, q, q_even, q_odd, q16, q16_scale, n0, end, qpos, slot_base, ring, keep_row,
    kp, ks, vp, vs, stride_kt, stride_ks, stride_vt, stride_vs, sm_scale,
    K_FMT: tl.constexpr, V_FMT: tl.constexpr, V_BLOCKED: tl.constexpr, RING: tl.constexpr, MASKED: tl.constexpr,
    HAS_KEEP: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BLOCK_N: tl.constexpr, HW_CVT: tl.constexpr,
):
    """One online-softmax step over W * BLOCK_N keys from n0 (see _attend_range);
    returns the state and the next step's scale bytes. Without MASKED every key
    exists and every row sees it: no load mask, no score mask. With HAS_KEEP
    a key whose byte at keep_row is 0 is left out for every row: neither its
    payload nor its scale is read into the sums, so a NaN there reaches no row."""
    pos = n0 + tl.arange(0, W)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    if MASKED:
        ok = pos < end
    else:
        ok = tl.full((W, BLOCK_N), 1, tl.int1)
    if HAS_KEEP:
        ok = ok & (tl.load(keep_row + pos, mask=ok, other=0) != 0)
        k_sb = _kept_bytes(k_sb, ok, 127, K_FMT)
        v_sb = _kept_bytes(v_sb, ok, 0, V_FMT)
    if RING:
        slot = slot_base + pos % ring
    else:
        slot = pos
    nxt = pos + W * BLOCK_N
    k_sb_next = _scale_bytes(ks, nxt, nxt < end, stride_ks, K_FMT, 127, D)
    v_sb_next = _scale_bytes(vs, nxt, nxt < end, stride_vs, V_FMT, 0, D)
    s = _scores(q, q_even, q_odd, q16, q16_scale, kp, k_sb, slot, ok, stride_kt, sm_scale, K_FMT, D, W, BLOCK_N, HW_CVT)
    if MASKED:
        s = tl.where(ok[:, None, :] & (pos[:, None, :] <= qpos[None, :, None]), s, float("-inf"))
    elif HAS_KEEP:
        s = tl.where(ok[:, None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 2))
    # Rows that have seen no key yet keep m = -inf: shift by 0 instead.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, :, None])
    l_i = l_i * alpha + tl.sum(p, 2)
    acc = _pv(p, acc * alpha[:, :, None], vp, v_sb, slot, ok, stride_vt, not (MASKED or HAS_KEEP), V_BLOCKED,
              V_FMT, q.dtype, D, BLOCK_N, HW_CVT)
    return acc, m_new, l_i, k_sb_next, v_sb_next


@triton.jit
def _attend_range(
    acc, m_i, l_i, q, q_even, q_odd, q16, q16_scale, start, end, visible, qpos, slot_base, ring, keep_row,
    kp, ks, vp, vs, stride_kt, stride_ks, stride_vt, stride_vs, sm_scale,
    K_FMT: tl.constexpr, V_FMT: tl.constexpr, V_BLOCKED: tl.constexpr, RING: tl.constexpr, HAS_KEEP: tl.constexpr,
    D: tl.constexpr, W: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, HW_CVT: tl.constexpr,
):
    """Online softmax over keys [start, end), W independent streams: each step
    warp w takes keys n0 + w * BLOCK_N + [0, BLOCK_N) into its own (acc, m_i,
    l_i) slice, so no reduction or layout change crosses warps inside the loop.
    A position p lives at slot p of the store, or with RING at slot_base + p %
    ring (the recent window). Keys below `visible` are seen by every row
    (HAS_KEEP: every row sees the keys the sequence's keep bytes keep).

    The steps whose keys all exist and are all visible run unmasked, the rest
    (at most two) masked. The payload goes through Triton's pipeliner
    (STAGES); the scale bytes, too narrow for its asynchronous copies, are
    loaded one step ahead by hand so that their latency hides behind a step's
    work (RING ranges have none)."""
    step = W * BLOCK_N
    full_end = start + tl.maximum(tl.minimum(end, visible) - start, 0) // step * step
    lane = start + tl.arange(0, W)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    k_sb = _scale_bytes(ks, lane, lane < end, stride_ks, K_FMT, 127, D)
    v_sb = _scale_bytes(vs, lane, lane < end, stride_vs, V_FMT, 0, D)
    for n0 in tl.range(start, full_end, step, num_stages=STAGES):
        acc, m_i, l_i, k_sb, v_sb = _step(
            acc, m_i, l_i, k_sb, v_sb, q, q_even, q_odd, q16, q16_scale, n0, end, qpos, slot_base, ring, keep_row,
            kp, ks, vp, vs, stride_kt, stride_ks, stride_vt, stride_vs, sm_scale,
            K_FMT, V_FMT, V_BLOCKED, RING, False, HAS_KEEP, D, W, BLOCK_N, HW_CVT)
    for n0 in tl.range(full_end, end, step, num_stages=1):
        acc, m_i, l_i, k_sb, v_sb = _step(
            acc, m_i, l_i, k_sb, v_sb, q, q_even, q_odd, q16, q16_scale, n0, end, qpos, slot_base, ring, keep_row,
            kp, ks, vp, vs, stride_kt, stride_ks, stride_vt, stride_vs, sm_scale,
            K_FMT, V_FMT, V_BLOCKED, RING, True, HAS_KEEP, D, W, BLOCK_N, HW_CVT)
    return acc, m_i, l_i


@triton.jit
def _chunk_keys(span, CHUNK, MIN_CHUNK, PIECES: tl.constexpr):
    """Keys per program over a sequence's `span` quantized keys: CHUNK, or
    with PIECES, span / PIECES rounded up to a multiple of MIN_CHUNK, within
    [MIN_CHUNK, CHUNK] (`DecodeConfig`). From the sequence's own length
    only, so its split is the same in any batch."""
    if PIECES > 0:
        per = tl.cdiv(tl.cdiv(tl.maximum(span, 1), PIECES), MIN_CHUNK) * MIN_CHUNK
        keys = tl.minimum(per, CHUNK)
    else:
        keys = CHUNK
    return keys


@triton.jit
def _decode_split_kernel(
    Q, KP, KS, VP, VS, HK, HV, LENGTHS, KEEP, O_PART, LSE_PART,
    sqb, sqh, sqt, skeep,
    skb, skh, skt, sksb, sksh, skst,
    svb, svh, svt, svsb, svsh, svst,
    shb, shh, sht,
    sm_scale, T, G, HKV, CHUNK, MIN_CHUNK, SINK, RECENT,
    K_FMT: tl.constexpr, V_FMT: tl.constexpr, V_BLOCKED: tl.constexpr, HAS_HI: tl.constexpr, HAS_KEEP: tl.constexpr,
    D: tl.constexpr, BLOCK_M: tl.constexpr, W: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
    PIECES: tl.constexpr, HW_CVT: tl.constexpr,
):
    pid = tl.program_id(0)
    chunk = tl.program_id(1)
    n_chunks = tl.num_programs(1)
    # 64-bit offsets: a batch of long caches spans more than 2^31 bytes.
    b = (pid // HKV).to(tl.int64)
    h = (pid % HKV).to(tl.int64)
    length = tl.load(LENGTHS + b)
    keep_row = KEEP + b * skeep

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < G * T
    t = rows % T
    qpos = length - T + t
    visible = length - T + 1
    q_row = Q + b * sqb + (h * G + rows // T) * sqh + t * sqt
    d = tl.arange(0, D)
    q_raw = tl.load(q_row[:, None] + d[None, :], mask=row_ok[:, None], other=0.0)
    q = _operand(q_raw, Q.dtype.element_ty, HW_CVT)
    # q16 = q / q16_scale exactly, with the row's largest |element| in
    # [2^14, 2^15): in fp16's range, elements 2^-24 below it still exact.
    q_f32 = to_f32(q_raw, HW_CVT)
    q_amax = tl.max(tl.abs(q_f32), 1)
    q_exp = tl.where(q_amax > 0, tl.maximum((q_amax.to(tl.int32, bitcast=True) >> 23) - 127 - 14, -112), 0)
    q16_scale = pow2_wide(q_exp) * sm_scale
    q_down = pow2_wide(-q_exp)[:, None]
    q16 = _operand(q_f32 * q_down, tl.float16, HW_CVT)
    if K_FMT == FMT_E2M1:
        # A packed e2m1 byte holds elements 2i (low nibble) and 2i + 1: per
        # 32-element block of the key, the query's 16 even and 16 odd elements.
        # Loaded again rather than split from q16: the split's layout costs
        # the hot loop.
        q_even = ()
        q_odd = ()
        for blk in tl.static_range(D // 32):
            dh = 2 * (blk * 16 + tl.arange(0, 16))
            even = tl.load(q_row[:, None] + dh[None, :], mask=row_ok[:, None], other=0.0)
            odd = tl.load(q_row[:, None] + dh[None, :] + 1, mask=row_ok[:, None], other=0.0)
            q_even = q_even + (tl.broadcast_to(
                _operand(to_f32(even, HW_CVT) * q_down, tl.float16, HW_CVT)[None], (W, BLOCK_M, 16)),)
            q_odd = q_odd + (tl.broadcast_to(
                _operand(to_f32(odd, HW_CVT) * q_down, tl.float16, HW_CVT)[None], (W, BLOCK_M, 16)),)
    else:
        q_even = q
        q_odd = q
    # One copy of each operand per warp (the leading axis): every warp's
    # matmuls then run on its own keys (see _attend_range).
    q = tl.broadcast_to(q[None], (W, BLOCK_M, D))
    q16 = tl.broadcast_to(q16[None], (W, BLOCK_M, D))

    acc = tl.zeros((W, BLOCK_M, D), dtype=tl.float32)
    m_i = tl.full((W, BLOCK_M), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((W, BLOCK_M), dtype=tl.float32)
    kp = KP + b * skb + h * skh
    ks = KS + b * sksb + h * sksh
    vp = VP + b * svb + h * svh
    vs = VS + b * svsb + h * svsh
    if HAS_HI:
        lo_start = tl.minimum(SINK, length)
        lo_end = tl.maximum(lo_start, length - RECENT)
        if chunk == 0:
            hk = HK + b * shb + h * shh
            hv = HV + b * shb + h * shh
            acc, m_i, l_i = _attend_range(
                acc, m_i, l_i, q, q, q, q16, q16_scale, 0, lo_start, visible, qpos, 0, 1, keep_row, hk, hk, hv, hv, sht, 0, sht,
                0, sm_scale, 0, 0, False, False, HAS_KEEP, D, W, BLOCK_N, 1, HW_CVT)
            acc, m_i, l_i = _attend_range(
                acc, m_i, l_i, q, q, q, q16, q16_scale, lo_end, length, visible, qpos, SINK, RECENT, keep_row, hk, hk, hv, hv,
                sht, 0, sht, 0, sm_scale, 0, 0, False, True, HAS_KEEP, D, W, BLOCK_N, 1, HW_CVT)
        else:
            keys = _chunk_keys(lo_end - lo_start, CHUNK, MIN_CHUNK, PIECES)
            start = lo_start + (chunk - 1) * keys
            acc, m_i, l_i = _attend_range(
                acc, m_i, l_i, q, q_even, q_odd, q16, q16_scale, start, tl.minimum(lo_end, start + keys), visible, qpos, 0, 0,
                keep_row, kp, ks, vp, vs, skt, skst, svt, svst, sm_scale, K_FMT, V_FMT, V_BLOCKED, False, HAS_KEEP, D, W, BLOCK_N, STAGES, HW_CVT)
    else:
        keys = _chunk_keys(length, CHUNK, MIN_CHUNK, PIECES)
        start = chunk * keys
        acc, m_i, l_i = _attend_range(
            acc, m_i, l_i, q, q_even, q_odd, q16, q16_scale, start, tl.minimum(length, start + keys), visible, qpos, 0, 0,
            keep_row, kp, ks, vp, vs, skt, skst, svt, svst, sm_scale, K_FMT, V_FMT, V_BLOCKED, False, HAS_KEEP, D, W, BLOCK_N, STAGES, HW_CVT)

    # Merge the warps' streams, once per program.
    m = tl.max(m_i, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    f = tl.exp2(m_i - m_safe[None, :])
    l_sum = tl.sum(l_i * f, 0)
    acc_sum = tl.sum(acc * f[:, :, None], 0)
    part = (pid * n_chunks + chunk) * BLOCK_M + rows
    lse = tl.where(l_sum > 0, m + tl.log2(tl.where(l_sum > 0, l_sum, 1.0)), float("-inf"))
    out = acc_sum / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(O_PART + part[:, None] * D + d[None, :], out, mask=row_ok[:, None])
    tl.store(LSE_PART + part, lse, mask=row_ok)


@triton.jit
def _decode_combine_kernel(
    O_PART, LSE_PART, OUT, sob, soh, sot, T, G, HKV, N_CHUNKS,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    row = tl.program_id(1)
    b = pid // HKV
    h = pid % HKV
    c = tl.arange(0, BLOCK_C)
    c_ok = c < N_CHUNKS
    part = (pid * N_CHUNKS + c) * BLOCK_M + row
    lse = tl.load(LSE_PART + part, mask=c_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - top))
    d = tl.arange(0, D)
    o = tl.load(O_PART + part[:, None] * D + d[None, :], mask=c_ok[:, None], other=0.0)
    # A row that keeps no key (all its chunks empty) outputs zeros, as SDPA does.
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    dst = OUT + b * sob + (h * G + row // T) * soh + (row % T) * sot + d
    tl.store(dst, out.to(OUT.dtype.element_ty))


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the split kernel: keys each warp takes per step (a
    step is num_warps * block_n keys, each warp an independent softmax
    stream), keys per program (the split: a multiple of block_n), warps, the
    pipeline stages of the payload loads, and a cap on registers per thread
    (None: the compiler's choice), which sets how many programs share an SM.

    pieces > 0 splits each sequence's quantized keys into about `pieces`
    programs instead: its length / pieces rounded up to a multiple of
    min_chunk, at most `chunk` keys each (so a long sequence still takes
    `chunk`-key programs). A short cache then still spreads over the GPU's
    SMs, where a fixed split leaves most of them idle at batch 1."""

    block_n: int
    chunk: int
    num_warps: int = 4
    num_stages: int = 2
    maxnreg: int | None = None
    pieces: int = 0
    min_chunk: int = 0

    def programs_per_sequence(self, keys: int) -> int:
        """Programs over the quantized keys of a sequence with at most `keys` of them."""
        if self.pieces == 0:
            return triton.cdiv(keys, self.chunk)
        return max(min(self.pieces, triton.cdiv(keys, self.min_chunk)), triton.cdiv(keys, self.chunk))

    def compile_options(self) -> dict:
        """Triton compile options beyond warps and stages (a launch's keyword arguments)."""
        return {} if self.maxnreg is None else {"maxnreg": self.maxnreg}


def default_config(head_dim: int) -> DecodeConfig:
    """The launch used unless one is given. On a GPU: from sweeps of
    benchmarks/sweep_decode.py on an H100 with Triton 3.6 (BENCHMARKS.md);
    the interpreter takes small steps and splits by pieces too.

    The split never depends on the batch or its longest sequence, only on
    each sequence's own length: chunk boundaries then sit at the same
    positions whatever else is in the batch, so each sequence's output is
    batch-invariant.
    """
    if INTERPRET:
        return DecodeConfig(block_n=16, chunk=64, pieces=4, min_chunk=16)
    return _gpu_config(head_dim)


def _gpu_config(head_dim: int) -> DecodeConfig:
    # Up to head_dim 64, 168 registers let three programs share an SM (two at
    # the compiler's choice); at 128 a program needs 255 whatever the cap,
    # and 4096 keys per program leave fewer programs for a last, partial round.
    # At 128, a sequence of up to 16 * 2048 quantized keys takes 2048-key
    # programs (up to 16) instead of 4096-key ones: a small batch then fills
    # more SMs, at a small cost to large batches (BENCHMARKS.md, 2026-12-07,
    # second session); smaller programs cost large batches more than they
    # give small ones.
    if head_dim <= 64:
        return DecodeConfig(block_n=32, chunk=2048, num_warps=4, num_stages=3, maxnreg=168)
    if head_dim <= 128:
        return DecodeConfig(block_n=32, chunk=4096, num_warps=4, num_stages=3, pieces=16, min_chunk=2048)
    return DecodeConfig(block_n=16, chunk=2048, num_warps=4, num_stages=2)


def _check_config(config: DecodeConfig) -> None:
    if config.block_n < 16 or config.block_n > KEY_BLOCK.value or config.block_n & (config.block_n - 1):
        raise ValueError(f"config: block_n must be a power of two in 16..{KEY_BLOCK.value} (a warp's keys lie "
                         f"in one key block of an e4m3 V store), got {config.block_n}")
    if config.chunk < config.block_n or config.chunk % config.block_n:
        raise ValueError(f"config: chunk must be a positive multiple of block_n ({config.block_n}), got {config.chunk}")
    if config.pieces < 0:
        raise ValueError(f"config: pieces must be 0 (a fixed split) or positive, got {config.pieces}")
    if config.pieces and (config.min_chunk < config.block_n or config.min_chunk % config.block_n
                          or config.chunk % config.min_chunk):
        raise ValueError(f"config: min_chunk must be a positive multiple of block_n ({config.block_n}) that divides "
                         f"chunk ({config.chunk}), got {config.min_chunk}")


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
    k_fmt: str,
    v_fmt: str,
    scale: float | None = None,
    chunk: int | None = None,
    config: DecodeConfig | None = None,
    key_keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of q (B, Hq, T, D) over a cache laid out as in
    dma_compile.kv_cache; returns (B, Hq, T, D) in q's dtype.

    max_length bounds lengths (it sizes the grid); chunk overrides the
    config's keys per program (tests); config overrides `default_config`
    (benchmarks' sweeps). key_keep: None, or bool (B, >= max_length), False
    for the cached positions no query sees (a padded batch's pad tokens).
    """
    q = q if q.stride(-1) == 1 else q.contiguous()
    b, hq, t, d = q.shape
    hkv = k_payload.shape[1]
    if q.device.type != "cuda" and not INTERPRET:
        raise Unsupported(f"the decode kernel needs CUDA tensors, got {q.device.type}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise Unsupported(f"the decode kernel takes bf16 or fp16, got {q.dtype}")
    if d not in HEAD_DIMS:
        raise Unsupported(f"the decode kernel takes head_dim in {HEAD_DIMS}, got {d}")
    group = hq // hkv
    if group * t > MAX_ROWS:
        raise Unsupported(f"query heads per KV head x query length = {group * t} > {MAX_ROWS}")
    block_m = max(16, triton.next_power_of_2(group * t))
    config = config or default_config(d)
    if chunk is not None:
        config = replace(config, chunk=chunk, block_n=min(config.block_n, chunk), pieces=0)
    _check_config(config)
    block_n, chunk = config.block_n, config.chunk
    has_hi = hi_k is not None
    v_blocked = v_payload.dim() == 5
    if v_blocked:
        blocks = v_payload.shape[2]
        if v_fmt != "mxfp8_e4m3" or v_payload.shape[3:] != (d, KEY_BLOCK.value) or v_payload.stride()[3:] != (KEY_BLOCK.value, 1):
            raise Unsupported(f"the decode kernel reads an e4m3 V store in contiguous key blocks (B, H, blocks, {d}, "
                              f"{KEY_BLOCK.value}), got {v_fmt} {tuple(v_payload.shape)}")
        if (sink if has_hi else 0) % KEY_BLOCK.value or blocks * KEY_BLOCK.value < max_length:
            raise Unsupported(f"the decode kernel needs the sinks ({sink}) in whole key blocks of "
                              f"{KEY_BLOCK.value} and a V store holding max_length ({max_length}) keys")
    middle = max_length - (sink if has_hi else 0)
    n_middle = config.programs_per_sequence(max(middle, 0))
    n_chunks = n_middle + int(has_hi)
    o_part = torch.empty(b * hkv * n_chunks * block_m, d, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(b * hkv * n_chunks * block_m, device=q.device, dtype=torch.float32)
    placeholder = k_payload
    ks = k_scales if k_scales is not None else placeholder
    vs = v_scales if v_scales is not None else placeholder
    hk = hi_k if has_hi else placeholder
    hv = hi_v if has_hi else placeholder
    # The passes' (B, H, L) key-keep arguments, with one head.
    keep_length = max_length if key_keep is None else key_keep.shape[-1]
    keep, skeep, _, has_keep = key_keep_arguments(
        None if key_keep is None else key_keep[:, None], b, 1, keep_length, placeholder)
    sm_scale = (1.0 / math.sqrt(d) if scale is None else scale) * LOG2E.value
    _decode_split_kernel[(b * hkv, n_chunks)](
        q, k_payload, ks, v_payload, vs, hk, hv, lengths, keep, o_part, lse_part,
        q.stride(0), q.stride(1), q.stride(2), skeep,
        *k_payload.stride()[:3], *ks.stride()[:3],
        *v_payload.stride()[:3], *vs.stride()[:3],
        *hk.stride()[:3],
        sm_scale, t, group, hkv, chunk, max(config.min_chunk, 1), sink, recent,
        K_FMT=CACHE_FORMAT_CODES[k_fmt], V_FMT=CACHE_FORMAT_CODES[v_fmt], V_BLOCKED=v_blocked, HAS_HI=has_hi,
        HAS_KEEP=has_keep, D=d, BLOCK_M=block_m, W=config.num_warps, BLOCK_N=block_n, STAGES=config.num_stages,
        PIECES=config.pieces, HW_CVT=HW_CVT,
        num_warps=config.num_warps, num_stages=config.num_stages,
        **config.compile_options(), **LAUNCH_OPTIONS,
    )
    out = torch.empty_like(q)
    _decode_combine_kernel[(b * hkv, group * t)](
        o_part, lse_part, out, out.stride(0), out.stride(1), out.stride(2), t, group, hkv, n_chunks,
        D=d, BLOCK_M=block_m, BLOCK_C=triton.next_power_of_2(n_chunks), **LAUNCH_OPTIONS,
    )
    return out


def compile_decode(k_fmt: str, v_fmt: str, *, head_dim: int = 128, group: int = 4, query_len: int = 1,
                   dtype: torch.dtype = torch.bfloat16, config: DecodeConfig | None = None, capability: int = 90):
    """Compile the split kernel for CUDA compute capability `capability` (90:
    H100/H200, sm_90a) on any machine, GPU or not, specialised as a launch on
    a cache of (2, 8, 32768 + 64, head_dim) with sinks and a recent window
    would be. config: the launch (default: `default_config` of a GPU).
    Returns Triton's compiled kernel (`.asm` holds "ttgir", "ptx", "cubin");
    needs TRITON_INTERPRET unset."""
    from dma_compile.kernels.target_compile import compile_for_target

    b, hkv, capacity, slots = 2, 8, 32768 + 64, 64
    block_m = max(16, triton.next_power_of_2(group * query_len))
    config = config or _gpu_config(head_dim)

    def store(fmt, role):
        payload = torch.empty(b, hkv, *cache_formats.payload_store_shape(fmt, role, head_dim, capacity),
                              dtype=dtype if fmt == "none" else torch.uint8)
        scales = cache_formats.scale_store_shape(fmt, head_dim, capacity)
        return payload, (payload if scales is None else torch.empty(b, hkv, *scales, dtype=torch.uint8))

    (kp, ks), (vp, vs) = store(k_fmt, "k"), store(v_fmt, "v")
    q = torch.empty(b, hkv * group, query_len, head_dim, dtype=dtype)
    hi = torch.empty(b, hkv, slots, head_dim, dtype=dtype)
    part = torch.empty(1, dtype=torch.float32)
    names = ["sqb", "sqh", "sqt", "skb", "skh", "skt", "sksb", "sksh", "skst", "svb", "svh", "svt",
             "svsb", "svsh", "svst", "shb", "shh", "sht"]
    strides = [*q.stride()[:3], *kp.stride()[:3], *ks.stride()[:3], *vp.stride()[:3], *vs.stride()[:3],
               *hi.stride()[:3]]
    args = {
        "Q": q, "KP": kp, "KS": ks, "VP": vp, "VS": vs, "HK": hi, "HV": hi,
        "LENGTHS": torch.empty(b, dtype=torch.int32), "KEEP": torch.empty(b, capacity, dtype=torch.uint8), "skeep": capacity, "O_PART": part, "LSE_PART": part,
        **dict(zip(names, strides)),
        "sm_scale": 0.1, "T": query_len, "G": group, "HKV": hkv, "CHUNK": config.chunk,
        "MIN_CHUNK": max(config.min_chunk, 1), "SINK": 32, "RECENT": 32,
        "K_FMT": CACHE_FORMAT_CODES[k_fmt], "V_FMT": CACHE_FORMAT_CODES[v_fmt], "V_BLOCKED": vp.dim() == 5,
        "HAS_HI": True, "HAS_KEEP": False,
        "D": head_dim, "BLOCK_M": block_m, "W": config.num_warps, "BLOCK_N": config.block_n,
        "STAGES": config.num_stages, "PIECES": config.pieces, "HW_CVT": True,
    }
    return compile_for_target(_decode_split_kernel, args, capability, config.num_warps, config.num_stages,
                              config.compile_options())
