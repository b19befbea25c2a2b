"""Block classification of explicit attention masks, cached per mask tensor.

One pass over a boolean (True = attend) or additive mask records, for every
cell of `CELL` query rows and each distinct (batch, head) of the mask, in
units of `CELL`-key cells:

- `[ns_lo, ns_hi)`: the key cells holding any attended key (the rest of the
  row is skipped);
- `[f_lo, f_hi)`: the first run of key cells whose keys are all attended
  (additive: all exactly 0), which the attention kernel runs without reading
  the mask.

Everything else in `[ns_lo, ns_hi)` is read from the mask. The attention
kernel combines the cells under one of its blocks, so the classification does
not depend on its block sizes. The same pass marks, per (batch, head) of the
mask, the keys that some query row attends: those that count for K's mean and
V's FP8 scales (reference.counted_keys). A classification is cached against
the mask tensor (a weak reference plus its version counter), so every layer
of one forward pass reuses it and the mask is read once per forward.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dma_compile.kernels.launch import LAUNCH_OPTIONS, cdiv
from dma_compile.kernels.numerics import HW_CVT, to_f32

CELL = 16
_CHUNK = 256


@triton.jit
def _classify_kernel(
    M, sm_b, sm_h, sm_q, sm_k, OUT, KEEP, MH, N_ROWS, Lq, Lk, N_KCELLS,
    CELL: tl.constexpr, CHUNK: tl.constexpr, IS_BOOL: tl.constexpr, HW_CVT: tl.constexpr,
):
    rc = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // MH
    h = bh % MH
    NC: tl.constexpr = CHUNK // CELL
    rows = rc * CELL + tl.arange(0, CELL)
    row_ok = rows < Lq
    src = M + b.to(tl.int64) * sm_b + h.to(tl.int64) * sm_h + rows[:, None].to(tl.int64) * sm_q
    big = N_KCELLS
    ns_lo = tl.full([], 0, tl.int32) + big
    ns_hi = tl.full([], 0, tl.int32)
    f_lo = tl.full([], 0, tl.int32) + big
    f_hi = tl.full([], 0, tl.int32) + big
    for c0 in range(0, Lk, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        ok = row_ok[:, None] & (cols < Lk)[None, :]
        vals = tl.load(src + cols[None, :].to(tl.int64) * sm_k, mask=ok, other=0)
        if IS_BOOL:
            attend = (vals != 0) & ok
            masked = (vals == 0) & ok
        else:
            vals = to_f32(vals, HW_CVT)
            # NaN counts as attended and not zero: its blocks are read, so it propagates.
            attend = (vals != float("-inf")) & ok
            masked = (vals != 0.0) & ok
        any_attend = tl.max(tl.max(tl.reshape(attend.to(tl.int32), (CELL, NC, CELL)), axis=2), axis=0)
        any_masked = tl.max(tl.max(tl.reshape(masked.to(tl.int32), (CELL, NC, CELL)), axis=2), axis=0)
        # Any row of this cell attends the key: max over programs (cells of
        # rows). Marks only go from 0 to 1, so a plain read first spares the
        # atomics of keys another program has marked already (most of them).
        key_any = tl.max(attend.to(tl.int32), axis=0)
        keep_ptrs = KEEP + bh.to(tl.int64) * Lk + cols
        unmarked = tl.load(keep_ptrs, mask=cols < Lk, other=1) == 0
        tl.atomic_max(keep_ptrs, key_any, mask=(cols < Lk) & (key_any > 0) & unmarked)
        idx = c0 // CELL + tl.arange(0, NC)
        nonskip = any_attend > 0
        full = nonskip & (any_masked == 0)
        ns_lo = tl.minimum(ns_lo, tl.min(tl.where(nonskip, idx, big), axis=0))
        ns_hi = tl.maximum(ns_hi, tl.max(tl.where(nonskip, idx + 1, 0), axis=0))
        f_lo = tl.minimum(f_lo, tl.min(tl.where(full, idx, big), axis=0))
        f_hi = tl.minimum(f_hi, tl.min(tl.where((~full) & (idx > f_lo), idx, big), axis=0))
    no_full = f_lo == big
    f_lo = tl.where(no_full, 0, f_lo)
    f_hi = tl.where(no_full, 0, f_hi)
    i = tl.arange(0, 4)
    packed = tl.where(i == 0, ns_lo, tl.where(i == 1, ns_hi, tl.where(i == 2, f_lo, f_hi)))
    tl.store(OUT + (bh * N_ROWS + rc) * 4 + i, packed)


@dataclass
class MaskInfo:
    """A mask ready for the attention kernel.

    values: the mask expanded to (B, Hq, Lq, Lk) as a view (stride 0 on the
    broadcast dimensions; bool viewed as uint8); summary: (mB, mH, n_rows, 4)
    int32 [ns_lo, ns_hi, f_lo, f_hi] per row cell; summary_strides: its
    (batch, head, row) strides with 0 where the mask broadcasts; key_keep:
    (mB, mH, Lk) int32, 1 where some query row attends the key.
    """

    values: torch.Tensor
    is_bool: bool
    summary: torch.Tensor
    summary_strides: tuple[int, int, int]
    key_keep: torch.Tensor

    def kept_keys(self, hkv: int) -> torch.Tensor:
        """(mB, 1 or hkv, Lk) int32: 1 where a query row of any query head
        reading the KV head attends the key (mB, mH broadcast as the mask)."""
        mb, mh, lk = self.key_keep.shape
        if mh == 1:
            return self.key_keep
        return self.key_keep.reshape(mb, hkv, mh // hkv, lk).amax(dim=2)


@dataclass
class _Entry:
    ref: weakref.ref
    version: int
    signature: tuple
    info: MaskInfo


_cache: dict[int, _Entry] = {}


def _drop(key: int, ref: weakref.ref) -> None:
    entry = _cache.get(key)
    if entry is not None and entry.ref is ref:
        del _cache[key]


def _version(mask: torch.Tensor) -> int | None:
    # Inference tensors keep no version counter: their classification is not cached.
    try:
        return mask._version
    except RuntimeError:
        return None


def _classify(mask: torch.Tensor, b: int, hq: int, lq: int, lk: int) -> MaskInfo:
    m = mask
    while m.dim() < 4:
        m = m.unsqueeze(0)
    mb, mh = m.shape[0], m.shape[1]
    n_rows = 1 if m.shape[2] == 1 else cdiv(lq, CELL)
    distinct = m.expand(mb, mh, lq, lk)
    is_bool = mask.dtype == torch.bool
    if is_bool:
        distinct = distinct.view(torch.uint8)
    summary = torch.empty(mb, mh, n_rows, 4, dtype=torch.int32, device=mask.device)
    key_keep = torch.zeros(mb, mh, lk, dtype=torch.int32, device=mask.device)
    _classify_kernel[(n_rows, mb * mh)](
        distinct, *distinct.stride(), summary, key_keep, mh, n_rows, lq if n_rows > 1 else 1, lk, cdiv(lk, CELL),
        CELL=CELL, CHUNK=_CHUNK, IS_BOOL=is_bool, HW_CVT=HW_CVT, num_warps=4, **LAUNCH_OPTIONS,
    )
    values = m.expand(b, hq, lq, lk)
    if is_bool:
        values = values.view(torch.uint8)
    strides = (
        summary.stride(0) if mb > 1 else 0,
        summary.stride(1) if mh > 1 else 0,
        summary.stride(2) if n_rows > 1 else 0,
    )
    return MaskInfo(values, is_bool, summary, strides, key_keep)


def counted_key_arguments(
    info: MaskInfo | None, is_causal: bool, lq: int, lk: int, hkv: int
) -> tuple[torch.Tensor | None, int | None]:
    """(key_keep, key_limit), the arguments of `quantize.kv_statistics` and
    `quantize.quantize_values_fp8` that select the keys counting for K's mean
    and V's FP8 scales (reference.counted_keys), for a kernel's call with the
    classification `info` of its mask (None without one) and hkv KV heads."""
    key_keep = info.kept_keys(hkv) if info is not None else None
    return key_keep, (lq if is_causal and lq < lk else None)


def classify_mask(mask: torch.Tensor, b: int, hq: int, lq: int, lk: int) -> MaskInfo:
    """Classify `mask` (broadcastable to (b, hq, lq, lk)), reusing a cached result
    while the same tensor object is passed again unmodified."""
    version = _version(mask)
    capturing = mask.is_cuda and torch.cuda.is_current_stream_capturing()
    cacheable = version is not None and not capturing
    signature = (tuple(mask.shape), mask.stride(), mask.data_ptr(), mask.dtype, b, hq, lq, lk)
    key = id(mask)
    if cacheable:
        entry = _cache.get(key)
        if entry is not None and entry.ref() is mask and entry.version == version and entry.signature == signature:
            return entry.info
    info = _classify(mask, b, hq, lq, lk)
    if cacheable:
        ref = weakref.ref(mask, lambda r, key=key: _drop(key, r))
        _cache[key] = _Entry(ref, version, signature, info)
    return info
