"""Which keys a query block visits, and in which precision: shared by the
sm_90 and sm_100 attention kernels so both follow one tiling rule.

`key_range` narrows the keys to those not fully masked for the block (causal
limit, explicit-mask classification) and finds the span that needs no masking;
`precision_band` applies docs/semantics.md's rule to the block's query tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dma_compile.kernels.codes import SELECT_V_KEEP, SELECT_V_LIMIT, SELECT_V_NONE


@triton.jit
def intersect(a0, a1, b0, b1):
    """[a0, a1) ∩ [b0, b1) as (start, end), empty as start == end."""
    lo = tl.maximum(a0, b0)
    return lo, tl.maximum(tl.minimum(a1, b1), lo)


@triton.jit
def key_range(
    m0, Lq, Lk, summary_row0, ss_r,
    IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, CELL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Keys [kv_start, kv_end) are not fully masked for some row of the block
    starting at query m0; [u_lo, u_hi) needs no masking for any row. Both are
    BLOCK_N aligned except kv_end, which the masking loops handle.
    `summary_row0` points at the mask classification (kernels.masks) of this
    batch and head, `ss_r` is its stride between cells of CELL query rows."""
    kv_start = 0
    kv_end = Lk
    u_lo = 0
    u_hi = (Lk // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        kv_end = tl.minimum(Lk, m0 + BLOCK_M)
        u_hi = tl.minimum(u_hi, ((m0 + 1) // BLOCK_N) * BLOCK_N)
    if HAS_MASK:
        cells = m0 // CELL + tl.arange(0, BLOCK_M // CELL)
        cell_ok = cells * CELL < Lq
        summary = summary_row0 + cells * ss_r
        big = Lk // CELL + 1
        ns_lo = tl.min(tl.load(summary, mask=cell_ok, other=big), 0)
        ns_hi = tl.max(tl.load(summary + 1, mask=cell_ok, other=0), 0)
        f_lo = tl.max(tl.load(summary + 2, mask=cell_ok, other=0), 0)
        f_hi = tl.min(tl.load(summary + 3, mask=cell_ok, other=big), 0)
        kv_start = ((ns_lo * CELL) // BLOCK_N) * BLOCK_N
        kv_end = tl.minimum(kv_end, ns_hi * CELL)
        u_lo = tl.cdiv(f_lo * CELL, BLOCK_N) * BLOCK_N
        u_hi = tl.minimum(u_hi, ((f_hi * CELL) // BLOCK_N) * BLOCK_N)
    kv_end = tl.maximum(kv_end, kv_start)
    u_lo = tl.minimum(tl.maximum(u_lo, kv_start), kv_end)
    u_hi = tl.maximum(tl.minimum(u_hi, (kv_end // BLOCK_N) * BLOCK_N), u_lo)
    return kv_start, kv_end, u_lo, u_hi


@triton.jit
def precision_band(
    m0, Lq, Lk, SINK_TILES, DIAG_TILES,
    TILE: tl.constexpr, IS_CAUSAL: tl.constexpr, ONE_CLASS: tl.constexpr,
):
    """(sink_end, band_s, band_e): the high format runs on keys [0, sink_end)
    and [band_s, band_e) for the query tile holding row m0, the low one
    elsewhere (docs/semantics.md). ONE_CLASS: hi == lo, no band needed."""
    if ONE_CLASS:
        sink_end = 0
        band_s = 0
        band_e = 0
    else:
        q_first = (m0 // TILE) * TILE
        q_last = tl.minimum(q_first + TILE, Lq) - 1
        if IS_CAUSAL:
            offset = 0
        else:
            offset = Lk - Lq
        # Shifted by a multiple of TILE so that // floors a non-negative number.
        pad = tl.cdiv(Lq, TILE) * TILE
        band_lo = (q_first + offset + pad) // TILE - pad // TILE - (DIAG_TILES - 1)
        band_hi = (q_last + offset + pad) // TILE - pad // TILE + (DIAG_TILES - 1)
        sink_end = SINK_TILES * TILE
        band_s = tl.maximum(band_lo * TILE, sink_end)
        band_e = tl.maximum((band_hi + 1) * TILE, band_s)
    return sink_end, band_s, band_e


@triton.jit
def counted_v(KEEP, offs_n, key_ok, KEY_LIMIT, HAS_KEEP: tl.constexpr):
    """Which keys offs_n count (reference.counted_keys): below KEY_LIMIT and,
    with HAS_KEEP, nonzero in KEEP (this batch and KV head's key-keep vector,
    unit stride). The others no query row attends; the masking loops select
    zeros for their V."""
    ok = key_ok & (offs_n < KEY_LIMIT)
    if HAS_KEEP:
        ok = ok & (tl.load(KEEP + offs_n, mask=ok, other=0) != 0)
    return ok


def v_select_mode(has_keep: bool, key_limit: int, lk: int, pv_fp8: bool) -> int:
    """SELECT_V of the attention kernels (`counted_v`, codes.SELECT_V_*): V as
    stored (FP8 V^T has the keys that do not count zeroed already, and without
    a keep vector or limit every key counts), zeros for the V of keys from
    key_limit on, or also for those the keep vector marks 0."""
    if pv_fp8 or not (has_keep or key_limit < lk):
        return SELECT_V_NONE.value
    return (SELECT_V_KEEP if has_keep else SELECT_V_LIMIT).value


def collapse_expanded_heads(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V expanded over heads with stride 0 (e.g. a repeated single KV head) become one head: no copy."""
    if k.shape[1] > 1 and k.stride(1) == 0 and v.stride(1) == 0:
        return k[:, :1], v[:, :1]
    return k, v


@triton.jit
def split_by_masking(r0s, r0e, r1s, r1e, kv_start, kv_end, u_lo, u_hi):
    """Split one precision class's two key ranges [r0s, r0e), [r1s, r1e),
    clipped to [kv_start, kv_end), into the parts that need no masking
    ([u_lo, u_hi)) and those that do. Returns two unmasked ranges, then four
    masked ones, as twelve bounds."""
    r0s, r0e = intersect(r0s, r0e, kv_start, kv_end)
    r1s, r1e = intersect(r1s, r1e, kv_start, kv_end)
    a0, a1 = intersect(r0s, r0e, u_lo, u_hi)
    b0, b1 = intersect(r1s, r1e, u_lo, u_hi)
    c0, c1 = intersect(r0s, r0e, kv_start, u_lo)
    d0, d1 = intersect(r0s, r0e, u_hi, kv_end)
    e0, e1 = intersect(r1s, r1e, kv_start, u_lo)
    f0, f1 = intersect(r1s, r1e, u_hi, kv_end)
    return a0, a1, b0, b1, c0, c1, d0, d1, e0, e1, f0, f1


@triton.jit
def block_counts(r0s, r0e, r1s, r1e, r2s, r2e, r3s, r3e, BLOCK_N: tl.constexpr):
    """Key blocks in each of four [start, end) ranges, visited as one loop."""
    return (tl.cdiv(r0e - r0s, BLOCK_N), tl.cdiv(r1e - r1s, BLOCK_N),
            tl.cdiv(r2e - r2s, BLOCK_N), tl.cdiv(r3e - r3s, BLOCK_N))


@triton.jit
def block_start(i, n0, n1, n2, r0s, r1s, r2s, r3s, BLOCK_N: tl.constexpr):
    """First key of the loop's i-th block: the ranges' blocks one after another."""
    j1 = i - n0
    j2 = j1 - n1
    j3 = j2 - n2
    start = tl.where(j1 < 0, r0s + i * BLOCK_N, r1s + j1 * BLOCK_N)
    start = tl.where(j2 < 0, start, r2s + j2 * BLOCK_N)
    start = tl.where(j3 < 0, start, r3s + j3 * BLOCK_N)
    return tl.multiple_of(start, BLOCK_N)
