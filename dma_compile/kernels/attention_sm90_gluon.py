"""DMA attention for Hopper (sm_90a) in Gluon: warp-specialized, one launch.

FlashAttention-3's schedule with DMA's numerics. A program owns 128 query
rows of one (batch, head) and three roles:

- the **producer** (one warp, few registers) issues TMA loads of the key
  blocks, each into the ring of its precision class (the low format's K, the
  high format's K), and of the V blocks (or e4m3 V^T) into one V ring, each
  stage guarded by a ready and an empty mbarrier;
- two **consumer** warpgroups, 64 query rows each, read the same stages.
  Each issues QK^T of block j+1 (async wgmma) before the softmax of block j,
  so the tensor cores work while the CUDA cores run exp2. Each consumer
  thread releases a stage itself (`arrive_per_thread`), with no barrier
  across its warpgroup: `mbarrier.arrive` has one thread arrive after such
  a barrier, a stall every key block until the slowest warp catches up.
  The `pingpong` variant has the two take turns issuing their matmuls (a
  pair of mbarriers stands in for FA3's named barriers, which Gluon lacks),
  so one's softmax overlaps the other's matmuls; it measured slower than
  letting both issue as they go (BENCHMARKS.md, 2026-12-07, fifth
  session), so it is not the default.

The math is `attention_sm90`'s (docs/semantics.md): the same quantization
pass output (`attention_sm90.quantize_inputs`), the same precision bands per
128-token tile (`_block_plan`), folded MX on e4m3 tensor cores with one power
of two per query row and key column, "none" on bf16/fp16 tensor cores, online
softmax in fp32 with exp2, P·V in V's dtype or in FP8 (e4m3(P * 256) against
e4m3 V^T with per-channel scales). The calls it does not serve (see
`unsupported_reason`) go to the portable Triton kernel. Q comes quantized
from the pass; the `q_prologue` variant has each consumer quantize its Q
tile itself instead (same rounding, `quantize.folded_mx`), measured slower.
"""

from __future__ import annotations

import functools
import logging
import math

import torch
import triton

from dma_compile.kernels import Unsupported, sass
from dma_compile.kernels.attention_sm90 import (
    COMPILE_SHAPE,
    _kind,
    descriptor_geometry,
    placeholder_inputs,
    quantize_inputs,
)
from dma_compile.kernels.codes import FMT_NONE, KIND_FOLDED, LOG2E, MX_FORMAT_CODES
from dma_compile.kernels.gluon_compat import (
    TensorDescriptor,
    arrive_per_thread,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    thread_barrier,
    tma_load,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from dma_compile.kernels.launch import LAUNCH_OPTIONS
from dma_compile.kernels.limits import LIMITS
from dma_compile.kernels.numerics import TRITON_VERSION, block_amax, row_reduce
from dma_compile.kernels.quantize import folded_mx, folded_scale
from dma_compile.kernels.output import empty_output
from dma_compile.kernels.schedule import collapse_expanded_heads
from dma_compile.policy import AttentionPolicy

logger = logging.getLogger(__name__)

# Query rows of one consumer warpgroup (one wgmma M of 64) and of a program.
ROWS = gl.constexpr(64)
BLOCK_M = gl.constexpr(2 * 64)
# Registers per thread at launch over the 12 warps (3 warpgroups) of a
# program; setmaxnreg then moves them from the producer to the consumers.
MAXNREG = 168
CONSUMER_REGS = gl.constexpr(240)
CONSUMER_THREADS = gl.constexpr(128)
PRODUCER_REGS = gl.constexpr(32)


def unsupported_reason(q, k, v, attn_mask, is_causal: bool, policy: AttentionPolicy,
                       capability: tuple[int, int] | None = None) -> str | None:
    """Why the Gluon kernel cannot serve this call, or None when it can.

    capability: the GPU's compute capability (default: q's device's), so the
    rule can be checked for any GPU on any machine."""
    if capability is None:
        if q.device.type != "cuda":
            return f"the Gluon sm90 kernel needs CUDA tensors, got {q.device.type}"
        capability = torch.cuda.get_device_capability(q.device)
    if tuple(capability) != (9, 0):
        return "the Gluon sm90 kernel needs an sm_90 GPU (H100/H200)"
    reason = LIMITS["sm90_gluon"].refusal(q, v, None)
    if reason is not None:
        return reason
    if attn_mask is not None:
        return "the Gluon sm90 kernel does not read explicit masks yet"
    if policy.uses_mx and policy.mx_mode != "folded":
        return "the Gluon sm90 kernel runs folded MX only (exact MX dequantizes to bf16)"
    if is_causal and q.shape[2] < k.shape[2]:
        # Keys past Lq then count for no row (masks.counted_key_arguments): their
        # V would have to be zeroed in the loop, as the Triton kernel does.
        return "the Gluon sm90 kernel does not take causal calls with Lq < Lk"
    if policy.tile % BLOCK_M.value != 0:
        return f"the Gluon sm90 kernel needs a precision tile that is a multiple of {BLOCK_M.value}"
    return None


# Where, with impl="auto", the Gluon kernel takes a call from the portable
# Triton one: the calls it measured faster on, in the H200 crossover runs of
# BENCHMARKS.md (full call, quantization included), with these Triton versions.
FASTER_HEAD_DIM = 128
FASTER_MIN_LENGTH = 8192
FASTER_WITH_TRITON = ((3, 6),)


def slower_reason(q, k, v, attn_mask, is_causal: bool, scale, policy: AttentionPolicy) -> str | None:
    """Why the portable Triton kernel should take, with impl="auto", a call
    this kernel could serve (`ops.Kernel.passes_on`), or None where this
    one measured faster. The reasons do not name the call's sizes, so each
    is logged once."""
    if TRITON_VERSION not in FASTER_WITH_TRITON:
        measured = ", ".join(f"{major}.{minor}" for major, minor in FASTER_WITH_TRITON)
        return f"the Gluon kernel was timed against the Triton one with Triton {measured} only"
    if q.shape[-1] != FASTER_HEAD_DIM:
        return f"the Triton kernel measured faster at head_dim below {FASTER_HEAD_DIM}"
    if min(q.shape[2], k.shape[2]) < FASTER_MIN_LENGTH:
        return f"the Triton kernel measured faster with fewer than {FASTER_MIN_LENGTH} queries or keys"
    if not is_causal and policy.pv != "fp8":
        return "the Triton kernel measured as fast or faster on non-causal calls with 16-bit P·V"
    return None


@gluon.jit
def _intersect(a0, a1, b0, b1):
    """[a0, a1) ∩ [b0, b1) as (start, end), empty as start == end."""
    lo = gl.maximum(a0, b0)
    return lo, gl.maximum(gl.minimum(a1, b1), lo)


@gluon.jit
def _block_plan(m0, Lq, Lk, SINK_TILES, DIAG_TILES,
                TILE: gl.constexpr, IS_CAUSAL: gl.constexpr, ONE_CLASS: gl.constexpr):
    """The key ranges of the program's query block m0: two in the low format,
    two in the high one (docs/semantics.md's precision bands; `schedule.precision_band`)."""
    kv_end = Lk
    if IS_CAUSAL:
        kv_end = gl.minimum(Lk, m0 + BLOCK_M)
    if ONE_CLASS:
        l0s, l0e, l1s, l1e = 0, kv_end, 0, 0
        h0s, h0e, h1s, h1e = 0, 0, 0, 0
    else:
        q_first = (m0 // TILE) * TILE
        q_last = gl.minimum(q_first + TILE, Lq) - 1
        if IS_CAUSAL:
            offset = 0
        else:
            offset = Lk - Lq
        pad = gl.cdiv(Lq, TILE) * TILE
        band_lo = (q_first + offset + pad) // TILE - pad // TILE - (DIAG_TILES - 1)
        band_hi = (q_last + offset + pad) // TILE - pad // TILE + (DIAG_TILES - 1)
        sink_end = SINK_TILES * TILE
        band_s = gl.maximum(band_lo * TILE, sink_end)
        band_e = gl.maximum((band_hi + 1) * TILE, band_s)
        l0s, l0e = _intersect(sink_end, band_s, 0, kv_end)
        l1s, l1e = _intersect(band_e, kv_end, 0, kv_end)
        h0s, h0e = _intersect(0, sink_end, 0, kv_end)
        h1s, h1e = _intersect(band_s, band_e, 0, kv_end)
    return l0s, l0e, l1s, l1e, h0s, h0e, h1s, h1e


@gluon.jit
def _runtime_zero():
    """0 as an int32 tensor: loop-carried counters must not start as constants."""
    return gl.program_id(0) * 0


@gluon.jit
def _tile_coords(t, sched, Hq, Hk):
    """Tile t of the launch as (m0, batch, head, KV head). Tiles go section
    by section, a section being a few heads whose keys and values fit in L2
    together (`tile_sections`); within one, by query block, the block with
    the most keys first (with causal masking the last query block), so the
    programs running at once read the same heads and a long tile is not the
    last to start."""
    n_tiles, n_m, heads_total, section = sched
    per_section = section * n_m
    sec = t // per_section
    r = t - sec * per_section
    heads = gl.minimum(section, heads_total - sec * section)
    m_idx = r // heads
    bh = sec * section + (r - m_idx * heads)
    m0 = (n_m - 1 - m_idx) * BLOCK_M
    h = bh % Hq
    return m0, bh // Hq, h, h // (Hq // Hk)


@gluon.jit
def _block_start(i, n0, r0s, r1s, BLOCK_N: gl.constexpr):
    return gl.where(i < n0, r0s + i * BLOCK_N, r1s + (i - n0) * BLOCK_N)


@gluon.jit
def _produce_class(k_desc, ks_desc, v_desc, k_ring, ks_ring, v_ring, k_ready, k_empty, v_ready, v_empty,
                   b, hk, kv_row, r0s, r0e, r1s, r1e, k0, v0, KIND: gl.constexpr, PV_FP8: gl.constexpr,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The class's key blocks into its K ring (from position k0) and the V
    ring (from v0); returns how many."""
    n0 = gl.cdiv(r0e - r0s, BLOCK_N)
    n = n0 + gl.cdiv(r1e - r1s, BLOCK_N)
    for i in range(n):
        start = _block_start(i, n0, r0s, r1s, BLOCK_N)
        s = (k0 + i) % STAGES
        mbarrier.wait(k_empty.index(s), (((k0 + i) // STAGES) & 1) ^ 1)
        if KIND == KIND_FOLDED:
            # Folded K's per-key powers of two travel with their block: the
            # consumers read them from shared memory, holding no prefetch registers.
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes + ks_desc.block_type.nbytes)
            tma_load(ks_desc, [kv_row + start], k_ready.index(s), ks_ring.index(s))
        else:
            mbarrier.expect(k_ready.index(s), k_desc.block_type.nbytes)
        tma_load(k_desc, [b, hk, start, 0], k_ready.index(s), k_ring.index(s))
        vs = (v0 + i) % STAGES
        mbarrier.wait(v_empty.index(vs), (((v0 + i) // STAGES) & 1) ^ 1)
        mbarrier.expect(v_ready.index(vs), v_desc.block_type.nbytes)
        if PV_FP8:
            tma_load(v_desc, [b, hk, 0, start], v_ready.index(vs), v_ring.index(vs))
        else:
            tma_load(v_desc, [b, hk, start, 0], v_ready.index(vs), v_ring.index(vs))
    return n


@gluon.jit
def _produce_q(q_desc, q_smem, q_ready, q_empty, b, h, m0, j, ONE_LOAD: gl.constexpr):
    """Both consumers' Q tiles of the program's j-th tile, each once its
    consumer has released the last one's. q_desc, q_smem: the low and the high
    format's; ONE_LOAD: one tile serves both (one precision class, or Q as
    given, which the consumers quantize)."""
    q_lo_desc, q_hi_desc = q_desc
    q_lo_smem, q_hi_smem = q_smem
    for wg in gl.static_range(2):
        mbarrier.wait(q_empty.index(wg), (j & 1) ^ 1)
        if ONE_LOAD:
            mbarrier.expect(q_ready.index(wg), q_lo_desc.block_type.nbytes)
        else:
            mbarrier.expect(q_ready.index(wg), q_lo_desc.block_type.nbytes + q_hi_desc.block_type.nbytes)
            tma_load(q_hi_desc, [b, h, m0 + wg * ROWS, 0], q_ready.index(wg), q_hi_smem.index(wg))
        tma_load(q_lo_desc, [b, h, m0 + wg * ROWS, 0], q_ready.index(wg), q_lo_smem.index(wg))


@gluon.jit
def _producer(q_desc, k_lo_desc, k_hi_desc, ks_lo_desc, ks_hi_desc, v_desc, q_smem, k_lo_ring, k_hi_ring,
              ks_lo_ring, ks_hi_ring, v_ring, barriers, scalars, sched, TILE: gl.constexpr, IS_CAUSAL: gl.constexpr,
              ONE_CLASS: gl.constexpr, Q_IN_KERNEL: gl.constexpr, PV_FP8: gl.constexpr, HI_KIND: gl.constexpr,
              LO_KIND: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Loads, tile after tile of the program, the consumers' Q tiles, then
    every key block they visit in their order: the low format's ranges, then
    the high format's. The ring counters run on across tiles, so the next
    tile's Q and first key blocks load while the consumers finish the last one."""
    q_ready, q_empty, k_lo_ready, k_lo_empty, k_hi_ready, k_hi_empty, v_ready, v_empty, turns = barriers
    Hq, Hk, Lq, Lk, KS_ROW, SINK_TILES, DIAG_TILES = scalars
    # Each key block has its V block: the V ring's position is the sum of the K rings'.
    k_lo_count = _runtime_zero()
    k_hi_count = _runtime_zero()
    for t in range(gl.program_id(0), sched[0], gl.num_programs(0)):
        m0, b, h, hk = _tile_coords(t, sched, Hq, Hk)
        _produce_q(q_desc, q_smem, q_ready, q_empty, b, h, m0, t // gl.num_programs(0), ONE_CLASS or Q_IN_KERNEL)
        l0s, l0e, l1s, l1e, h0s, h0e, h1s, h1e = _block_plan(m0, Lq, Lk, SINK_TILES, DIAG_TILES,
                                                             TILE, IS_CAUSAL, ONE_CLASS)
        kv_row = (b * Hk + hk) * KS_ROW
        k_lo_count += _produce_class(
            k_lo_desc, ks_lo_desc, v_desc, k_lo_ring, ks_lo_ring, v_ring, k_lo_ready, k_lo_empty,
            v_ready, v_empty, b, hk, kv_row, l0s, l0e, l1s, l1e, k_lo_count, k_lo_count + k_hi_count,
            LO_KIND, PV_FP8, BLOCK_N, STAGES)
        if not ONE_CLASS:
            k_hi_count += _produce_class(
                k_hi_desc, ks_hi_desc, v_desc, k_hi_ring, ks_hi_ring, v_ring, k_hi_ready, k_hi_empty,
                v_ready, v_empty, b, hk, kv_row, h0s, h0e, h1s, h1e, k_hi_count, k_lo_count + k_hi_count,
                HI_KIND, PV_FP8, BLOCK_N, STAGES)


@gluon.jit
def _take_turn(turns, turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Wait until it is this consumer's turn to issue matmuls (PINGPONG)."""
    if PINGPONG:
        mbarrier.wait(turns[WG].index(0), (turn & 1) ^ (1 - WG))


@gluon.jit
def _pass_turn(turns, WG: gl.constexpr, PINGPONG: gl.constexpr):
    if PINGPONG:
        arrive_per_thread(turns[1 - WG].index(0))


@gluon.jit
def _key_scales(ks_ring, s, KIND: gl.constexpr, s_layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """Folded K's per-key powers of two for the block in stage s (ones for
    16-bit formats). Keys past Lk read zeros or the next head's scales,
    which the mask in `_scores` discards."""
    if KIND == KIND_FOLDED:
        ks = ks_ring.index(s).load(gl.SliceLayout(0, s_layout))
    else:
        ks = gl.full([BLOCK_N], 1.0, gl.float32, gl.SliceLayout(0, s_layout))
    return ks


@gluon.jit
def _key_scaled(s_acc, ks, KIND: gl.constexpr):
    """S with folded K's per-key scales applied, beside the stage's release.
    The scales' shared-memory loads were issued before QK^T's wait, hundreds
    of cycles before the producer can see the release and reload the stage;
    ptxas interleaves these multiplies with the arrival, so that distance,
    not an ordering, is what keeps the loads ahead of the next TMA write."""
    if KIND == KIND_FOLDED:
        s_acc = s_acc * ks[None, :]
    return s_acc


@gluon.jit
def _scores(s_acc, q_scale, m_i, start, rows, row0, Lk,
            KIND: gl.constexpr, IS_CAUSAL: gl.constexpr, P_LOG2: gl.constexpr,
            s_layout: gl.constexpr, row_layout: gl.constexpr, BLOCK_N: gl.constexpr):
    """One block's online-softmax step on S with its key scales applied
    (`_key_scaled`): P (fp32, scaled by 2^P_LOG2), the new row max and the
    factor that rescales what came before."""
    offs_n = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    qs = gl.convert_layout(q_scale, gl.SliceLayout(1, s_layout))
    needs_mask = start + BLOCK_N > Lk
    if IS_CAUSAL:
        needs_mask = needs_mask | (start + BLOCK_N - 1 > row0)
    if needs_mask:
        s = s_acc * qs[:, None]
        rows_s = gl.convert_layout(rows, gl.SliceLayout(1, s_layout))
        valid = (offs_n < Lk)[None, :]
        if IS_CAUSAL:
            valid = valid & (offs_n[None, :] <= rows_s[:, None])
        s = gl.where(valid, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.convert_layout(row_reduce(s, False), row_layout))
        # Rows with every key so far masked keep m = -inf; subtract 0 there.
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - gl.convert_layout(m_use - P_LOG2, gl.SliceLayout(1, s_layout))[:, None])
        alpha = gl.exp2(m_i - m_use)
    else:
        m_new = gl.maximum(m_i, gl.convert_layout(row_reduce(s_acc, False), row_layout) * q_scale)
        p = gl.exp2(s_acc * qs[:, None] - gl.convert_layout(m_new - P_LOG2, gl.SliceLayout(1, s_layout))[:, None])
        alpha = gl.exp2(m_i - m_new)
    return p, m_new, alpha


@gluon.jit
def _pv_operand(p, v_dtype: gl.constexpr, PV_FP8: gl.constexpr, o_layout: gl.constexpr):
    if PV_FP8:
        # V^T holds each 32 keys in wgmma's operand order (`quantize.wgmma_key_order`):
        # put P's keys in the same order and every thread already holds the
        # operand elements it owns in the accumulator, so the conversion moves
        # bytes within registers, never between threads.
        n: gl.constexpr = p.shape[1]
        p8 = p.to(gl.float8e4nv).reshape([ROWS, n // 32, 2, 2, 4, 2]).permute((0, 1, 2, 4, 3, 5))
        r = gl.convert_layout(p8.reshape([ROWS, n]), gl.DotOperandLayout(0, o_layout, 4))
    else:
        r = gl.convert_layout(p.to(v_dtype), gl.DotOperandLayout(0, o_layout, 2))
    return r


@gluon.jit
def _v_operand(v_ring, vs, PV_FP8: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr):
    if PV_FP8:
        r = v_ring.index(vs).reshape([HEAD_DIM, BLOCK_N]).permute((1, 0))
    else:
        r = v_ring.index(vs).reshape([BLOCK_N, HEAD_DIM])
    return r


@gluon.jit
def _consume_class(acc, m_i, l_i, k0, v0, turn, q_smem, q_scale, k_ring, ks_ring, k_ready, k_empty,
                   v_ring, v_ready, v_empty, turns, rows, row0, Lk, r0s, r0e, r1s, r1e,
                   WG: gl.constexpr, KIND: gl.constexpr, IS_CAUSAL: gl.constexpr, PV_FP8: gl.constexpr,
                   PINGPONG: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                   s_layout: gl.constexpr, o_layout: gl.constexpr):
    """Online softmax over one precision class's key blocks, software
    pipelined: S of block i is issued with P·V of block i - 1. k0, v0, turn:
    the K and V rings' positions and the ping-pong turn at its start.
    Returns the state, the blocks consumed and the turn after them."""
    P_LOG2: gl.constexpr = 8.0 if PV_FP8 else 0.0
    row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    n0 = gl.cdiv(r0e - r0s, BLOCK_N)
    n = n0 + gl.cdiv(r1e - r1s, BLOCK_N)
    if n > 0:
        zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
        start = _block_start(0, n0, r0s, r1s, BLOCK_N)
        s = k0 % STAGES
        mbarrier.wait(k_ready.index(s), (k0 // STAGES) & 1)
        ks = _key_scales(ks_ring, s, KIND, s_layout, BLOCK_N)
        _take_turn(turns, turn, WG, PINGPONG)
        s_tok = warpgroup_mma(q_smem, k_ring.index(s).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                              use_acc=False, is_async=True)
        _pass_turn(turns, WG, PINGPONG)
        s_acc = _key_scaled(warpgroup_mma_wait(0, deps=(s_tok,)), ks, KIND)
        arrive_per_thread(k_empty.index(s))
        p, m_i, alpha = _scores(s_acc, q_scale, m_i, start, rows, row0, Lk, KIND, IS_CAUSAL, P_LOG2,
                                s_layout, row_layout, BLOCK_N)
        l_i = l_i * alpha + gl.convert_layout(row_reduce(p, True), row_layout)
        acc = acc * alpha[:, None]
        for i in range(1, n):
            start = _block_start(i, n0, r0s, r1s, BLOCK_N)
            s = (k0 + i) % STAGES
            vs = (v0 + i - 1) % STAGES
            mbarrier.wait(k_ready.index(s), ((k0 + i) // STAGES) & 1)
            ks = _key_scales(ks_ring, s, KIND, s_layout, BLOCK_N)
            mbarrier.wait(v_ready.index(vs), ((v0 + i - 1) // STAGES) & 1)
            _take_turn(turns, turn + i, WG, PINGPONG)
            s_tok = warpgroup_mma(q_smem, k_ring.index(s).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), zero_s,
                                  use_acc=False, is_async=True)
            o_tok = warpgroup_mma(_pv_operand(p, v_ring.dtype, PV_FP8, o_layout),
                                  _v_operand(v_ring, vs, PV_FP8, BLOCK_N, HEAD_DIM), acc, is_async=True)
            _pass_turn(turns, WG, PINGPONG)
            s_acc = _key_scaled(warpgroup_mma_wait(1, deps=(s_tok,)), ks, KIND)
            arrive_per_thread(k_empty.index(s))
            p, m_i, alpha = _scores(s_acc, q_scale, m_i, start, rows, row0, Lk, KIND, IS_CAUSAL, P_LOG2,
                                    s_layout, row_layout, BLOCK_N)
            l_i = l_i * alpha + gl.convert_layout(row_reduce(p, True), row_layout)
            acc = warpgroup_mma_wait(0, deps=(o_tok,))
            arrive_per_thread(v_empty.index(vs))
            acc = acc * alpha[:, None]
        vs = (v0 + n - 1) % STAGES
        mbarrier.wait(v_ready.index(vs), ((v0 + n - 1) // STAGES) & 1)
        _take_turn(turns, turn + n, WG, PINGPONG)
        o_tok = warpgroup_mma(_pv_operand(p, v_ring.dtype, PV_FP8, o_layout),
                              _v_operand(v_ring, vs, PV_FP8, BLOCK_N, HEAD_DIM), acc, is_async=True)
        _pass_turn(turns, WG, PINGPONG)
        acc = warpgroup_mma_wait(0, deps=(o_tok,))
        arrive_per_thread(v_empty.index(vs))
        turn += n + 1
    return acc, m_i, l_i, n, turn


@gluon.jit
def _quantized_q_class(x, amax, bad, dst, sm_scale, FMT: gl.constexpr, RCEIL: gl.constexpr,
                       HEAD_DIM: gl.constexpr, row_layout: gl.constexpr):
    """One class's Q operand from the tile x (ROWS, D // 32, 32): its folded MX
    payload stored into dst, and its row scales times sm_scale (sm_scale
    alone for format none, whose operand is the tile as given)."""
    if FMT == FMT_NONE:
        r = gl.full([ROWS], 1.0, gl.float32, row_layout) * sm_scale
    else:
        bits, a = folded_mx(x, amax, bad, FMT, RCEIL, True)
        dst.store(bits.reshape([ROWS, HEAD_DIM]).to(gl.float8e4nv, bitcast=True))
        r = gl.convert_layout(folded_scale(a), row_layout) * sm_scale
    return r


@gluon.jit
def _quantize_q(src, q_lo, q_hi, sm_scale, LO_FMT: gl.constexpr, HI_FMT: gl.constexpr, ONE_CLASS: gl.constexpr,
                RCEIL: gl.constexpr, HEAD_DIM: gl.constexpr, row_layout: gl.constexpr):
    """The prologue's Q quantization (no Q in the pass): the consumer's Q tile
    as given, src, into both classes' operands, rounded as the pass rounds
    (`quantize.folded_mx`); returns their row scales times sm_scale. Each
    thread holds whole 32-element blocks, so block maxima need no shuffles."""
    NB: gl.constexpr = HEAD_DIM // 32
    layout: gl.constexpr = gl.BlockedLayout([1, 32], [32 // NB, NB], [4, 1], [1, 0])
    x = src.load(layout).to(gl.float32).reshape([ROWS, NB, 32])
    amax, bad = block_amax(x)
    qs_lo = _quantized_q_class(x, amax, bad, q_lo, sm_scale, LO_FMT, RCEIL, HEAD_DIM, row_layout)
    if ONE_CLASS:
        qs_hi = qs_lo
    else:
        qs_hi = _quantized_q_class(x, amax, bad, q_hi, sm_scale, HI_FMT, RCEIL, HEAD_DIM, row_layout)
    # The warpgroup's stores reach the tensor cores' (async) view of shared memory before any wgmma reads them.
    fence_async_shared()
    thread_barrier()
    return qs_lo, qs_hi


@gluon.jit
def _row_scale(QS, row0, rows, Lq, sm_scale, KIND: gl.constexpr):
    if KIND == KIND_FOLDED:
        r = gl.load(QS + row0 + rows, mask=rows < Lq, other=0.0) * sm_scale
    else:
        r = gl.zeros_like(rows.to(gl.float32)) + sm_scale
    return r


@gluon.jit
def _consumer(WG: gl.constexpr, ptrs, q_smem, k_lo_ring, k_hi_ring, ks_lo_ring, ks_hi_ring, v_ring,
              barriers, scalars, sched,
              TILE: gl.constexpr, IS_CAUSAL: gl.constexpr, ONE_CLASS: gl.constexpr, PV_FP8: gl.constexpr,
              HI_KIND: gl.constexpr, LO_KIND: gl.constexpr, Q_IN_KERNEL: gl.constexpr, HI_FMT: gl.constexpr,
              LO_FMT: gl.constexpr, RCEIL: gl.constexpr, PINGPONG: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
              s_lo_layout: gl.constexpr, s_hi_layout: gl.constexpr, o_layout: gl.constexpr):
    """Consumer WG's 64 query rows of each of the program's tiles."""
    Hq, Hk = scalars[0], scalars[1]
    counts = (_runtime_zero(), _runtime_zero(), _runtime_zero())
    for t in range(gl.program_id(0), sched[0], gl.num_programs(0)):
        m0, b, h, hk = _tile_coords(t, sched, Hq, Hk)
        # t = program + j * programs: this is the program's j-th tile.
        counts = _consume_tile(WG, m0, b, h, hk, t // gl.num_programs(0), counts, ptrs, q_smem, k_lo_ring,
                               k_hi_ring, ks_lo_ring, ks_hi_ring, v_ring, barriers, scalars, TILE, IS_CAUSAL,
                               ONE_CLASS, PV_FP8, HI_KIND, LO_KIND, Q_IN_KERNEL, HI_FMT, LO_FMT, RCEIL,
                               PINGPONG, BLOCK_N, HEAD_DIM, STAGES, s_lo_layout, s_hi_layout, o_layout)


@gluon.jit
def _consume_tile(WG: gl.constexpr, m0, b, h, hk, j, counts, ptrs, q_smem, k_lo_ring, k_hi_ring,
                  ks_lo_ring, ks_hi_ring, v_ring, barriers, scalars,
                  TILE: gl.constexpr, IS_CAUSAL: gl.constexpr, ONE_CLASS: gl.constexpr, PV_FP8: gl.constexpr,
                  HI_KIND: gl.constexpr, LO_KIND: gl.constexpr, Q_IN_KERNEL: gl.constexpr, HI_FMT: gl.constexpr,
                  LO_FMT: gl.constexpr, RCEIL: gl.constexpr, PINGPONG: gl.constexpr,
                  BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                  s_lo_layout: gl.constexpr, s_hi_layout: gl.constexpr, o_layout: gl.constexpr):
    """One tile's 64 rows: both precision classes on the Q tiles the producer
    loaded (with Q_IN_KERNEL quantized here first, from the tile as given),
    then the epilogue. j: the tile's place among the program's;
    counts: the K rings' positions (low, high; the V ring's is their sum)
    and the ping-pong turn, carried from tile to tile."""
    q_ready, q_empty, k_lo_ready, k_lo_empty, k_hi_ready, k_hi_empty, v_ready, v_empty, turns = barriers
    Hq, Hk, Lq, Lk, SINK_TILES, DIAG_TILES, sm_scale = scalars
    QS_LO, QS_HI, VSCALE, O, o_strides = ptrs
    q_src_smem, q_lo_smem, q_hi_smem = q_smem
    k_lo_count, k_hi_count, turn = counts
    row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    rows = m0 + WG * ROWS + gl.arange(0, ROWS, layout=row_layout)
    # Q and its scales are (B, Hq, Lq, ...) row-major: one row index serves both.
    row0 = (b.to(gl.int64) * Hq + h) * Lq
    l0s, l0e, l1s, l1e, h0s, h0e, h1s, h1e = _block_plan(m0, Lq, Lk, SINK_TILES, DIAG_TILES,
                                                         TILE, IS_CAUSAL, ONE_CLASS)
    q_lo = q_lo_smem.index(WG).reshape([ROWS, HEAD_DIM])
    q_hi = q_hi_smem.index(WG).reshape([ROWS, HEAD_DIM])
    if Q_IN_KERNEL:
        mbarrier.wait(q_ready.index(WG), j & 1)
        qs_lo, qs_hi = _quantize_q(q_src_smem.index(WG).reshape([ROWS, HEAD_DIM]), q_lo, q_hi, sm_scale,
                                   LO_FMT, HI_FMT, ONE_CLASS, RCEIL, HEAD_DIM, row_layout)
    else:
        qs_lo = _row_scale(QS_LO, row0, rows, Lq, sm_scale, LO_KIND)
        qs_hi = _row_scale(QS_HI, row0, rows, Lq, sm_scale, HI_KIND)
        mbarrier.wait(q_ready.index(WG), j & 1)

    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([ROWS], gl.float32, row_layout)
    acc, m_i, l_i, n, turn = _consume_class(
        acc, m_i, l_i, k_lo_count, k_lo_count + k_hi_count, turn, q_lo, qs_lo,
        k_lo_ring, ks_lo_ring, k_lo_ready, k_lo_empty, v_ring, v_ready, v_empty, turns, rows, m0 + WG * ROWS, Lk,
        l0s, l0e, l1s, l1e, WG, LO_KIND, IS_CAUSAL, PV_FP8, PINGPONG, BLOCK_N, HEAD_DIM, STAGES,
        s_lo_layout, o_layout)
    k_lo_count += n
    if not ONE_CLASS:
        acc, m_i, l_i, n_hi, turn = _consume_class(
            acc, m_i, l_i, k_hi_count, k_lo_count + k_hi_count, turn, q_hi, qs_hi,
            k_hi_ring, ks_hi_ring, k_hi_ready, k_hi_empty, v_ring, v_ready, v_empty, turns, rows, m0 + WG * ROWS, Lk,
            h0s, h0e, h1s, h1e, WG, HI_KIND, IS_CAUSAL, PV_FP8, PINGPONG, BLOCK_N, HEAD_DIM, STAGES,
            s_hi_layout, o_layout)
        k_hi_count += n_hi
    # Every matmul reading this tile's Q has retired: the producer may load the next one.
    arrive_per_thread(q_empty.index(WG))

    d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    if PV_FP8:
        acc = acc * gl.load(VSCALE + (b.to(gl.int64) * Hk + hk) * HEAD_DIM + d)[None, :]
    # A row with every key masked has l = 0 and outputs zeros, as SDPA.
    empty = l_i == 0.0
    out = gl.where(empty[:, None], 0.0, acc / gl.where(empty, 1.0, l_i)[:, None])
    out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [4, 1], [1, 0])
    out = gl.convert_layout(out.to(O.dtype.element_ty), out_layout)
    r_o = m0 + WG * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, out_layout))
    d_o = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, out_layout))
    so_b, so_h, so_l = o_strides
    o_ptr = O + b.to(gl.int64) * so_b + h * so_h + r_o[:, None].to(gl.int64) * so_l + d_o[None, :]
    gl.store(o_ptr, out, mask=(r_o < Lq)[:, None])
    return k_lo_count, k_hi_count, turn


@gluon.jit
def _q_operand_smem(q_src_smem, FMT: gl.constexpr, HEAD_DIM: gl.constexpr, q8_layout: gl.constexpr):
    """Where a class's Q operand lives when the kernel quantizes Q: the tiles
    as given for format none, e4m3 tiles of their own otherwise (shaped as
    the descriptors' blocks, [1, 1, ROWS, HEAD_DIM], per consumer)."""
    if FMT == FMT_NONE:
        r = q_src_smem
    else:
        r = gl.allocate_shared_memory(gl.float8e4nv, [2, 1, 1, ROWS, HEAD_DIM], q8_layout)
    return r


@gluon.jit
def _dma_attention_gluon_kernel(
    QS_LO, QS_HI, VSCALE, O, so_b, so_h, so_l,
    q_lo_desc, q_hi_desc, k_lo_desc, k_hi_desc, ks_lo_desc, ks_hi_desc, v_desc,
    sm_scale, Hq, Hk, Lq, Lk, KS_ROW, SINK_TILES, DIAG_TILES, N_TILES, N_M, HEADS, SECTION,
    HEAD_DIM: gl.constexpr, TILE: gl.constexpr, HI_KIND: gl.constexpr, LO_KIND: gl.constexpr,
    ONE_CLASS: gl.constexpr, PV_FP8: gl.constexpr, IS_CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
    Q_IN_KERNEL: gl.constexpr, HI_FMT: gl.constexpr, LO_FMT: gl.constexpr, RCEIL: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    s_lo_layout: gl.constexpr, s_hi_layout: gl.constexpr, o_layout: gl.constexpr, q8_layout: gl.constexpr,
):
    # Persistent: program p runs tiles p, p + P, p + 2P, ... of the P
    # programs, in `_tile_coords`' order.
    if Q_IN_KERNEL:
        # The producer loads Q as given (q_lo_desc and q_hi_desc are both its
        # descriptor); each consumer quantizes its tile into the classes' operands.
        q_src_smem = gl.allocate_shared_memory(q_lo_desc.dtype, [2] + q_lo_desc.block_type.shape, q_lo_desc.layout)
        q_lo_smem = _q_operand_smem(q_src_smem, LO_FMT, HEAD_DIM, q8_layout)
        if ONE_CLASS:
            q_hi_smem = q_lo_smem
        else:
            q_hi_smem = _q_operand_smem(q_src_smem, HI_FMT, HEAD_DIM, q8_layout)
        q_loads = (q_src_smem, q_src_smem)
    else:
        q_lo_smem = gl.allocate_shared_memory(q_lo_desc.dtype, [2] + q_lo_desc.block_type.shape, q_lo_desc.layout)
        if ONE_CLASS:
            q_hi_smem = q_lo_smem
        else:
            q_hi_smem = gl.allocate_shared_memory(q_hi_desc.dtype, [2] + q_hi_desc.block_type.shape,
                                                  q_hi_desc.layout)
        q_src_smem = q_lo_smem
        q_loads = (q_lo_smem, q_hi_smem)
    k_lo_ring = gl.allocate_shared_memory(k_lo_desc.dtype, [STAGES] + k_lo_desc.block_type.shape, k_lo_desc.layout)
    if ONE_CLASS:
        k_hi_ring = k_lo_ring
    else:
        k_hi_ring = gl.allocate_shared_memory(k_hi_desc.dtype, [STAGES] + k_hi_desc.block_type.shape,
                                              k_hi_desc.layout)
    ks_lo_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], ks_lo_desc.layout)
    ks_hi_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], ks_hi_desc.layout)
    v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_lo_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_lo_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_hi_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_hi_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    # The ping-pong's two barriers apart: a consumer waits on one and arrives
    # on the other, and Triton puts a warpgroup barrier between a wait and an
    # arrive it cannot tell apart.
    turns = (gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()),
             gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()))
    for i in gl.static_range(STAGES):
        mbarrier.init(k_lo_ready.index(i), count=1)
        mbarrier.init(k_hi_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        # Both consumers release every stage, each of their threads (`arrive_per_thread`).
        mbarrier.init(k_lo_empty.index(i), count=2 * CONSUMER_THREADS)
        mbarrier.init(k_hi_empty.index(i), count=2 * CONSUMER_THREADS)
        mbarrier.init(v_empty.index(i), count=2 * CONSUMER_THREADS)
    for i in gl.static_range(2):
        # One Q tile per consumer.
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=CONSUMER_THREADS)
        mbarrier.init(turns[i].index(0), count=CONSUMER_THREADS)

    barriers = (q_ready, q_empty, k_lo_ready, k_lo_empty, k_hi_ready, k_hi_empty, v_ready, v_empty, turns)
    ptrs = (QS_LO, QS_HI, VSCALE, O, (so_b, so_h, so_l))
    scalars = (Hq, Hk, Lq, Lk, SINK_TILES, DIAG_TILES, sm_scale)
    sched = (N_TILES, N_M, HEADS, SECTION)
    q_smem = (q_src_smem, q_lo_smem, q_hi_smem)
    producer_args = ((q_lo_desc, q_hi_desc), k_lo_desc, k_hi_desc, ks_lo_desc, ks_hi_desc, v_desc, q_loads,
                     k_lo_ring, k_hi_ring, ks_lo_ring, ks_hi_ring, v_ring, barriers,
                     (Hq, Hk, Lq, Lk, KS_ROW, SINK_TILES, DIAG_TILES),
                     sched, TILE, IS_CAUSAL, ONE_CLASS, Q_IN_KERNEL, PV_FP8, HI_KIND, LO_KIND, BLOCK_N, STAGES)
    gl.warp_specialize([
        (_consumer, (0, ptrs, q_smem, k_lo_ring, k_hi_ring, ks_lo_ring, ks_hi_ring, v_ring, barriers, scalars, sched,
                     TILE, IS_CAUSAL, ONE_CLASS, PV_FP8, HI_KIND, LO_KIND, Q_IN_KERNEL, HI_FMT, LO_FMT, RCEIL,
                     PINGPONG, BLOCK_N, HEAD_DIM, STAGES, s_lo_layout, s_hi_layout, o_layout)),
        (_consumer, (1, ptrs, q_smem, k_lo_ring, k_hi_ring, ks_lo_ring, ks_hi_ring, v_ring, barriers, scalars, sched,
                     TILE, IS_CAUSAL, ONE_CLASS, PV_FP8, HI_KIND, LO_KIND, Q_IN_KERNEL, HI_FMT, LO_FMT, RCEIL,
                     PINGPONG, BLOCK_N, HEAD_DIM, STAGES, s_lo_layout, s_hi_layout, o_layout)),
        (_producer, producer_args),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# What the heads of one section of tiles may hold in keys and values: a
# share of the H100/H200 L2 (50 MB) that leaves room for Q and the output.
L2_SECTION_BYTES = 32 * 2**20


def tile_sections(hq: int, hk: int, lk: int, key_bytes_per_token: int, heads_total: int) -> int:
    """How many consecutive (batch, head) pairs one section of tiles spans
    (`_tile_coords`): as many KV heads as fit in `L2_SECTION_BYTES`, at least
    one, times the query heads that share each. key_bytes_per_token: the
    bytes of K and V the kernel reads per key of one KV head."""
    kv_heads = max(1, L2_SECTION_BYTES // max(1, lk * key_bytes_per_token))
    return max(1, min(heads_total, kv_heads * (hq // hk)))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _kernel_args(qi, out, shape, is_causal: bool, scale: float, policy: AttentionPolicy,
                 block_n: int = 128, stages: int = 2, pingpong: bool = False) -> dict:
    """The kernel's arguments by name. shape: (B, Hq, Hkv, Lq, Lk, D, Dv)."""
    b, hq, hk, lq, lk, d, dv = shape
    pv_fp8 = policy.pv == "fp8"
    n_m = triton.cdiv(lq, BLOCK_M.value)
    key_bytes = d * qi.k_lo.values.element_size() + dv * qi.v.element_size()

    def descriptor(x, rows):
        x, dims, strides = descriptor_geometry(x)
        block = [1, 1, rows, d]
        return TensorDescriptor(x, dims, strides, block, gl.NVMMASharedLayout.get_default_for(block, _gl_dtype(x)))

    q_lo = descriptor(qi.q_lo.values, ROWS.value)
    q_hi = q_lo if qi.q_hi.values is qi.q_lo.values else descriptor(qi.q_hi.values, ROWS.value)
    q_block = [1, 1, ROWS.value, d]
    k_lo = descriptor(qi.k_lo.values, block_n)
    k_hi = k_lo if qi.k_hi.values is qi.k_lo.values else descriptor(qi.k_hi.values, block_n)
    # FP8 V^T in wgmma's key order: the last keys' columns may lie past Lk, in the zeroed padding.
    v, dims, strides = descriptor_geometry(qi.v, triton.cdiv(lk, 32) * 32 if pv_fp8 else None)
    v_block = [1, 1, dv, block_n] if pv_fp8 else [1, 1, block_n, dv]
    v_desc = TensorDescriptor(v, dims, strides, v_block, gl.NVMMASharedLayout.get_default_for(v_block, _gl_dtype(v)))
    hi_kind, lo_kind = _kind(policy.hi, policy), _kind(policy.lo, policy)

    def s_layout(kind):
        return gl.NVMMADistributedLayout([3, 0], [4, 1], [16, block_n, 32 if kind == KIND_FOLDED.value else 16])

    def placeholder(x):
        return x if x is not None else out

    def ks_descriptor(scales):
        flat, row = _scale_rows(scales, qi.q_lo.values.device, block_n)
        return TensorDescriptor(flat, [flat.numel()], [1], [block_n], _KS_LAYOUT), row

    ks_lo, ks_row_lo = ks_descriptor(qi.k_lo.scales)
    ks_hi, ks_row_hi = ks_descriptor(qi.k_hi.scales)

    return dict(
        QS_LO=placeholder(qi.q_lo.scales), QS_HI=placeholder(qi.q_hi.scales), VSCALE=placeholder(qi.v_scales), O=out,
        so_b=out.stride(0), so_h=out.stride(1), so_l=out.stride(2),
        q_lo_desc=q_lo, q_hi_desc=q_hi, k_lo_desc=k_lo, k_hi_desc=k_hi, v_desc=v_desc,
        ks_lo_desc=ks_lo, ks_hi_desc=ks_hi, KS_ROW=max(ks_row_lo, ks_row_hi),
        sm_scale=scale * LOG2E.value, Hq=hq, Hk=hk, Lq=lq, Lk=lk,
        SINK_TILES=policy.sink_tiles, DIAG_TILES=policy.diag_tiles,
        N_TILES=n_m * b * hq, N_M=n_m, HEADS=b * hq, SECTION=tile_sections(hq, hk, lk, key_bytes, b * hq),
        HEAD_DIM=d, TILE=policy.tile, HI_KIND=hi_kind, LO_KIND=lo_kind, ONE_CLASS=policy.hi == policy.lo,
        PV_FP8=pv_fp8, IS_CAUSAL=bool(is_causal), PINGPONG=pingpong, BLOCK_N=block_n, STAGES=stages,
        Q_IN_KERNEL=not qi.q_quantized, HI_FMT=_fmt(policy.hi), LO_FMT=_fmt(policy.lo),
        RCEIL=policy.scale_rule == "rceil",
        s_lo_layout=s_layout(lo_kind), s_hi_layout=s_layout(hi_kind),
        o_layout=gl.NVMMADistributedLayout([3, 0], [4, 1], [16, dv, 32 if pv_fp8 else 16]),
        q8_layout=gl.NVMMASharedLayout.get_default_for(q_block, gl.float8e4nv),
    )


def _fmt(fmt: str) -> int:
    """The element format code (`codes`) of a policy format, FMT_NONE for none."""
    return MX_FORMAT_CODES.get(fmt, FMT_NONE.value)


_KS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


@functools.lru_cache(maxsize=None)
def _no_scales(device: torch.device, block_n: int) -> torch.Tensor:
    """What a 16-bit class's scale descriptor points at (it is never read)."""
    return torch.ones(block_n, dtype=torch.float32, device=device)


def _scale_rows(scales: torch.Tensor | None, device, block_n: int) -> tuple[torch.Tensor, int]:
    """Folded K's scales (B, Hkv, Lk) as one dimension over every KV head's
    keys, and the distance between two heads' rows there. A bulk copy must
    start on 16 bytes, so rows whose length is not a multiple of 4 are padded
    (one small copy per call); a block past a head's end reads the padding or
    the next head's scales, which the mask in `_scores` discards."""
    if scales is None:
        return _no_scales(device, block_n), 0
    length = scales.shape[-1]
    row = -(-length // 4) * 4
    if row != length or not scales.is_contiguous():
        scales = torch.nn.functional.pad(scales, (0, row - length))
    return scales.reshape(-1), row


_GL_DTYPES = {
    torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float8_e4m3fn: "float8e4nv",
}


def _gl_dtype(x: torch.Tensor):
    return getattr(gl, _GL_DTYPES[x.dtype])


def attention_sm90_gluon(q, k, v, attn_mask, is_causal: bool, scale: float | None, policy: AttentionPolicy,
                         **variant) -> torch.Tensor:
    """DMA attention on validated SDPA-style inputs (see ops.dma_attention).

    variant: block_n, stages, pingpong, programs, q_prologue (benchmarks and
    tests); raises Unsupported for calls `unsupported_reason` names."""
    variant = dict(variant)
    q_prologue = variant.pop("q_prologue", False)
    if q_prologue and not can_quantize_q(policy):
        raise ValueError("q_prologue: the kernel cannot quantize a rotated or balanced Q; the pass does")
    reason = unsupported_reason(q, k, v, attn_mask, is_causal, policy)
    if reason is not None:
        raise Unsupported(reason)
    b, hq, lq, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    LIMITS["sm90_gluon"].check(q, v, scale)
    k, v = collapse_expanded_heads(k, v)
    shape = (b, hq, k.shape[1], lq, k.shape[2], d, v.shape[-1])
    qi = quantize_inputs(q, k, v, policy, is_causal=is_causal, **pass_options(q_prologue))
    return gluon_attention_from_quantized(qi, shape, is_causal, scale, policy, **variant)


def can_quantize_q(policy: AttentionPolicy) -> bool:
    """Whether the kernel can quantize Q itself, in its prologue (the
    `q_prologue` variant): for policies that neither rotate nor balance Q
    (those transforms stay in the pass). Not the default: on an H100 the
    prologue cost the kernel more than it saved the pass (BENCHMARKS.md,
    2026-12-06, "Q quantized in the kernel's prologue")."""
    return policy.rotate == "none" and not (policy.balance_qk and policy.uses_mx)


def pass_options(q_prologue: bool = False) -> dict:
    """What this kernel asks of the quantization pass (`attention_sm90.quantize_inputs`):
    V^T in wgmma's key order, and Q unless the kernel's prologue quantizes it."""
    return {"v_wgmma_order": True, "quantize_q": not q_prologue}


def gluon_attention_from_quantized(qi, shape, is_causal: bool, scale: float, policy: AttentionPolicy,
                                   **variant) -> torch.Tensor:
    """The attention kernel alone, on the quantization pass's output
    (`attention_sm90.quantize_inputs` with `pass_options`: V^T in wgmma's key
    order for FP8 P·V; Q as given where the kernel quantizes it, or quantized).
    shape: (B, Hq, Hkv, Lq, Lk, D, Dv).

    Without an explicit `block_n` the kernel takes 128 keys per block, or 64
    where the compiler spilled registers in the matmul loops at 128
    (`default_block_n`). The grid is persistent, one program per SM;
    `programs` (a variant) sets another count, e.g. one per tile to time the
    difference."""
    b, hq, _, lq, _, d, dv = shape
    if policy.pv == "fp8" and not qi.v_wgmma_order:
        raise ValueError("the Gluon kernel reads FP8 V^T in wgmma's key order: quantize_inputs(..., v_wgmma_order=True)")
    out = empty_output(b, hq, lq, dv, qi.out_dtype, qi.q_lo.values.device)
    variant = dict(variant)
    programs = variant.pop("programs", None) or _sm_count(out.device)
    key = None
    if "block_n" not in variant:
        # Triton specializes on lengths divisible by 16, and so may allocate registers differently.
        key = (policy, d, qi.out_dtype, bool(is_causal), shape[3] % 16 == 0, shape[4] % 16 == 0,
               tuple(sorted(variant.items())))
        variant = {**variant, "block_n": default_block_n(key)}
    args = _kernel_args(qi, out, shape, is_causal, scale, policy, **variant)
    compiled = _dma_attention_gluon_kernel[(min(programs, args["N_TILES"]),)](
        **args, num_warps=4, maxnreg=MAXNREG, **LAUNCH_OPTIONS)
    if key is not None and key not in _WIDE_SPILLS:
        _WIDE_SPILLS[key] = wide_loop_spills(compiled)
        if _WIDE_SPILLS[key]:
            logger.info("the Gluon sm90 kernel spills registers in its matmul loops at %d keys per block for %s "
                        "(D %d, %s, causal %s) with this Triton; using %d from the next call on", WIDE_BLOCK_N,
                        policy, d, qi.out_dtype, bool(is_causal), NARROW_BLOCK_N)
    return out


# Keys per block. A wider block spreads each iteration's fixed work (waits,
# releases, the accumulator's rescale) over more keys but holds more
# registers; which configurations the compiler keeps in registers at the wide
# one differs between Triton versions, so it is read off the compiled kernel.
WIDE_BLOCK_N = 128
NARROW_BLOCK_N = 64
# compile key -> whether the wide block spilled in the matmul loops.
_WIDE_SPILLS: dict = {}


def wide_loop_spills(compiled) -> bool:
    """Whether a compiled kernel spills inside its matmul loops
    (`sass.matmul_loops`). A kernel with spills elsewhere only (a scalar
    reloaded once per tile) does not count; without cuobjdump to read the SASS, any spill does."""
    if getattr(compiled, "n_spills", 0) == 0:
        return False
    code = sass.disassemble(compiled.asm["cubin"])
    return code is None or sass.counted_spills(code) > 0


def default_block_n(key) -> int:
    """The block width for a compile key (policy, D, dtype, causal, whether
    Lq and Lk are multiples of 16, launch variant): the wide one unless a
    launch of it spilled in its matmul loops."""
    return NARROW_BLOCK_N if _WIDE_SPILLS.get(key) else WIDE_BLOCK_N


def compile_sm90_gluon(policy: AttentionPolicy, *, dtype: str = "bfloat16", head_dim: int = 128,
                       is_causal: bool = True, capability: int = 90, **variant):
    """Compile the Gluon kernel for sm_90a on any machine, GPU or not (CI's
    check of its machinery), specialised as a launch on (1, 8, 1024, head_dim)
    queries and (1, 2, 1024, head_dim) keys and values would be. Returns
    Triton's compiled kernel (`.asm` holds "ttgir", "ptx", "cubin").
    variant: as for `attention_sm90_gluon`."""
    from dma_compile.kernels.target_compile import compile_for_target

    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    b, hq, hk, length, d = COMPILE_SHAPE + (head_dim,)
    variant = dict(variant)
    qi = placeholder_inputs(policy, torch_dtype, head_dim, q_quantized=not variant.pop("q_prologue", False))
    out = empty_output(b, hq, length, d, torch_dtype, "cpu")
    args = _kernel_args(qi, out, (b, hq, hk, length, length, d, d), is_causal, 1.0 / math.sqrt(d), policy, **variant)
    return compile_for_target(_dma_attention_gluon_kernel, args, capability, 4, 1,
                              extra_options={"maxnreg": MAXNREG}, gluon=True)
