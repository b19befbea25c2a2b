"""DMA attention kernel for Hopper (sm_90): fused, online softmax, one launch.

Each program owns BLOCK_M query rows of one (batch, head) and walks the key
blocks that are not fully masked. Which blocks run in which precision comes
from the policy's precision tiles (docs/semantics.md): BLOCK_M and BLOCK_N
divide the tile, so a block never straddles two tiles, and the key blocks of
one class form at most two key ranges per query tile (sink + diagonal band in
the high format, the rest in the low one). The blocks run in three loops of
compile-time shape:

    low format, no masking;  low format, masking;  high format, masking

"masking" covers causal masking, the key tail and explicit masks; the mask is
read only for blocks its classification (kernels.masks) marks partial. The
high format's few blocks (sink and diagonal band) share one masking loop:
a separate unmasked loop for them cost more in pipeline prologues, code size
and registers than the masking it saves (3% at 16k tokens on an H200). QK^T
runs on bf16/fp16 tensor cores for "none" and exact MX (dequantized by the
quantization pass) and on fp8 tensor cores for folded MX, with one power of
two per query row and key column. Softmax is online in fp32 with exp2; P·V
runs in V's dtype or in FP8 (e4m3(P * 256) against e4m3 V^T with a
per-channel scale). K and V reach the kernel as tensor descriptors (bulk
tensor copies on Hopper, which free the registers pointer arithmetic would
hold; keys past Lk read as zeros); Q, the scales and masks as pointers.
"""

from __future__ import annotations

import contextlib
import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dma_compile.kernels import Unsupported, launch
from dma_compile.kernels.balance import balance_factors
from dma_compile.kernels.codes import (
    KIND_16BIT,
    KIND_FOLDED,
    LOG2E,
    MASK_ADDITIVE,
    MASK_BOOL,
    MASK_NONE,
    SELECT_V_KEEP,
    SELECT_V_NONE,
)
from dma_compile.kernels.limits import LIMITS
from dma_compile.kernels.masks import CELL, MaskInfo, classify_mask, counted_key_arguments
from dma_compile.kernels.numerics import (
    HW_CVT,
    INTERPRET,
    to_dtype,
    to_e4m3,
    to_f32,
)
from dma_compile.kernels.output import empty_output
from dma_compile.kernels.quantize import (
    Operand,
    key_keep_arguments,
    kv_statistics,
    launch_tokens,
    plan_tokens,
    quantize_keys_and_values,
    quantize_values_fp8,
)
from dma_compile.kernels.schedule import (
    block_counts,
    block_start,
    collapse_expanded_heads,
    counted_v,
    intersect,
    key_range,
    precision_band,
    split_by_masking,
    v_select_mode,
)
from dma_compile.policy import AttentionPolicy



@triton.jit
def _dot_nt(a, b, HW_CVT: tl.constexpr):
    """a @ b^T in fp32 (the interpreter multiplies bf16 wrongly: it goes through fp32)."""
    if HW_CVT:
        r = tl.dot(a, tl.trans(b))
    else:
        r = tl.dot(to_f32(a, HW_CVT), tl.trans(to_f32(b, HW_CVT)))
    return r


@triton.jit
def _dot_acc(a, b, acc, HW_CVT: tl.constexpr):
    """a @ b + acc in fp32; the interpreter gets fp32 copies (to_f32: it
    multiplies bf16 wrongly and reads e4m3's NaN code as 480)."""
    if HW_CVT:
        r = tl.dot(a, b, acc)
    else:
        r = tl.dot(to_f32(a, HW_CVT), to_f32(b, HW_CVT), acc)
    return r


@triton.jit
def _row_scales(QS, rows, row_ok, sm_scale, KIND: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per-row factor of the scores: softmax scale * log2(e), times 2^A for folded Q."""
    if KIND == KIND_FOLDED:
        r = tl.load(QS + rows, mask=row_ok, other=0.0) * sm_scale
    else:
        r = tl.full([BLOCK_M], 1.0, tl.float32) * sm_scale
    return r


@triton.jit
def _attend(
    acc, l_i, m_i, q, q_scale,
    K, KS, V, b, hk, MASK, sm_m, sm_n, KEEP, KEY_LIMIT,
    offs_m, Lq, Lk,
    r0s, r0e, r1s, r1e, r2s, r2e, r3s, r3e,
    KIND: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    PV_FP8: tl.constexpr, SELECT_V: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, HW_CVT: tl.constexpr,
):
    """Online-softmax update over the key blocks of up to four [start, end) key ranges.

    K and V (or e4m3 V^T) come through tensor descriptors: bulk copies on
    Hopper, with keys past Lk read as zeros. KS holds folded K's per-key
    powers of two as float32, so the loop multiplies without converting.
    With FP8 P·V, P is kept scaled by 256 throughout (exp2 of the score minus
    m - 8): e4m3(P * 256) then needs no multiply, and l carries the same
    factor, which the final division cancels. Masked scores are selected to
    -inf (a NaN score of a masked key stays out of the row); with SELECT_V,
    the masking loops also select zeros for the V of keys no row attends
    (`counted_v`; 1: keys from KEY_LIMIT on, 2: also those KEEP marks 0),
    whose content would otherwise reach the rows through 0 * NaN."""
    P_LOG2: tl.constexpr = 8.0 if PV_FP8 else 0.0
    arange_n = tl.arange(0, BLOCK_N)
    n0c, n1c, n2c, n3c = block_counts(r0s, r0e, r1s, r1e, r2s, r2e, r3s, r3e, BLOCK_N)
    row_ok = offs_m < Lq
    for i in range(0, n0c + n1c + n2c + n3c):
        start = block_start(i, n0c, n1c, n2c, r0s, r1s, r2s, r3s, BLOCK_N)
        offs_n = start + arange_n
        key_ok = offs_n < Lk
        k = K.load([b, hk, start, 0]).reshape(BLOCK_N, HEAD_DIM)
        qk = _dot_nt(q, k, HW_CVT)
        if KIND == KIND_FOLDED:
            if MASKED:
                ks = tl.load(KS + offs_n, mask=key_ok, other=0.0)
            else:
                ks = tl.load(KS + offs_n)
            qk = qk * ks[None, :]
        if MASKED:
            s = qk * q_scale[:, None]
            valid = key_ok[None, :]
            if IS_CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None])
            if MASK_KIND != MASK_NONE:
                mptr = MASK + offs_m[:, None].to(tl.int64) * sm_m + offs_n[None, :] * sm_n
                mok = row_ok[:, None] & key_ok[None, :]
                if MASK_KIND == MASK_BOOL:
                    valid = valid & (tl.load(mptr, mask=mok, other=0) != 0)
                else:
                    bias = to_f32(tl.load(mptr, mask=mok, other=0.0), HW_CVT)
                    valid = valid & (bias != float("-inf"))
                    s = s + bias * LOG2E
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # Rows with every key so far masked keep m = -inf; subtract 0 there.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - (m_use - P_LOG2)[:, None])
            alpha = tl.math.exp2(m_i - m_use)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * q_scale)
            p = tl.math.exp2(qk * q_scale[:, None] - (m_new - P_LOG2)[:, None])
            alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if PV_FP8:
            vt = V.load([b, hk, 0, start]).reshape(HEAD_DIM_V, BLOCK_N)
            acc = _dot_acc(to_e4m3(p, HW_CVT), tl.trans(vt), acc, HW_CVT)
        else:
            v = V.load([b, hk, start, 0]).reshape(BLOCK_N, HEAD_DIM_V)
            if SELECT_V != SELECT_V_NONE and MASKED:
                v = tl.where(counted_v(KEEP, offs_n, key_ok, KEY_LIMIT, SELECT_V == SELECT_V_KEEP)[:, None], v, 0.0)
            acc = _dot_acc(to_dtype(p, V.dtype, HW_CVT), v, acc, HW_CVT)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _dma_attention_kernel(
    Q_HI, QS_HI, sqh_b, sqh_h, sqh_m, sqh_d, K_HI, KS_HI,
    Q_LO, QS_LO, sql_b, sql_h, sql_m, sql_d, K_LO, KS_LO,
    V, VSCALE,
    O, so_b, so_h, so_m, so_d,
    MASK, sm_b, sm_h, sm_m, sm_n,
    SUMM, ss_b, ss_h, ss_r,
    KEEP, skp_b, skp_h, KEY_LIMIT,
    sm_scale, Hq, Hk, Lq, Lk, SINK_TILES, DIAG_TILES,
    LQ_BUCKET, LK_BUCKET,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, TILE: tl.constexpr,
    HI_KIND: tl.constexpr, LO_KIND: tl.constexpr, ONE_CLASS: tl.constexpr,
    PV_FP8: tl.constexpr, SELECT_V: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    CELL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HW_CVT: tl.constexpr,
):
    tl.static_assert(TILE % BLOCK_M == 0)
    tl.static_assert(TILE % BLOCK_N == 0)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    # Longest rows first: with causal masking the last query blocks do the most work.
    m0 = (tl.cdiv(Lq, BLOCK_M) - 1 - pid_m) * BLOCK_M
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // (Hq // Hk)
    b64 = b.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < Lq
    offs_d = tl.arange(0, HEAD_DIM)

    kv_start, kv_end, u_lo, u_hi = key_range(
        m0, Lq, Lk, SUMM + b64 * ss_b + h.to(tl.int64) * ss_h, ss_r, IS_CAUSAL, MASK_KIND != MASK_NONE, CELL,
        BLOCK_M, BLOCK_N
    )
    sink_end, band_s, band_e = precision_band(m0, Lq, Lk, SINK_TILES, DIAG_TILES, TILE, IS_CAUSAL, ONE_CLASS)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    mask_base = MASK + b64 * sm_b + h.to(tl.int64) * sm_h
    keep_base = KEEP + b64 * skp_b + hk.to(tl.int64) * skp_h

    # Low format: [sink_end, band_s) and [band_e, kv_end).
    a0, a1, b0, b1, c0, c1, d0, d1, e0, e1, f0, f1 = split_by_masking(
        sink_end, band_s, band_e, kv_end, kv_start, kv_end, u_lo, u_hi
    )
    q = tl.load(Q_LO + b64 * sql_b + h.to(tl.int64) * sql_h + offs_m[:, None] * sql_m + offs_d[None, :] * sql_d,
                mask=row_ok[:, None], other=0.0)
    q_scale = _row_scales(QS_LO + pid_bh.to(tl.int64) * Lq, offs_m, row_ok, sm_scale, LO_KIND, BLOCK_M)
    ks_base = KS_LO + (b64 * Hk + hk) * Lk
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q, q_scale, K_LO, ks_base, V, b, hk, mask_base, sm_m, sm_n, keep_base, KEY_LIMIT,
        offs_m, Lq, Lk, a0, a1, b0, b1, 0, 0, 0, 0,
        LO_KIND, False, IS_CAUSAL, MASK_KIND, PV_FP8, SELECT_V, BLOCK_N, HEAD_DIM, HEAD_DIM_V, HW_CVT)
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q, q_scale, K_LO, ks_base, V, b, hk, mask_base, sm_m, sm_n, keep_base, KEY_LIMIT,
        offs_m, Lq, Lk, c0, c1, d0, d1, e0, e1, f0, f1,
        LO_KIND, True, IS_CAUSAL, MASK_KIND, PV_FP8, SELECT_V, BLOCK_N, HEAD_DIM, HEAD_DIM_V, HW_CVT)

    if not ONE_CLASS:
        # High format: [0, sink_end) and [band_s, band_e).
        r0s, r0e = intersect(0, sink_end, kv_start, kv_end)
        r1s, r1e = intersect(band_s, band_e, kv_start, kv_end)
        q = tl.load(Q_HI + b64 * sqh_b + h.to(tl.int64) * sqh_h + offs_m[:, None] * sqh_m + offs_d[None, :] * sqh_d,
                    mask=row_ok[:, None], other=0.0)
        q_scale = _row_scales(QS_HI + pid_bh.to(tl.int64) * Lq, offs_m, row_ok, sm_scale, HI_KIND, BLOCK_M)
        ks_base = KS_HI + (b64 * Hk + hk) * Lk
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, q_scale, K_HI, ks_base, V, b, hk, mask_base, sm_m, sm_n, keep_base, KEY_LIMIT,
            offs_m, Lq, Lk, r0s, r0e, r1s, r1e, 0, 0, 0, 0,
            HI_KIND, True, IS_CAUSAL, MASK_KIND, PV_FP8, SELECT_V, BLOCK_N, HEAD_DIM, HEAD_DIM_V, HW_CVT)

    offs_dv = tl.arange(0, HEAD_DIM_V)
    if PV_FP8:
        v_scale = tl.load(VSCALE + (b64 * Hk + hk) * HEAD_DIM_V + offs_dv)
        acc = acc * v_scale[None, :]
    # A row with every key masked has l = 0 and outputs zeros, as SDPA.
    empty = l_i == 0.0
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
    o_ptr = O + b64 * so_b + h.to(tl.int64) * so_h + offs_m[:, None] * so_m + offs_dv[None, :] * so_d
    tl.store(o_ptr, to_dtype(out, O.dtype.element_ty, HW_CVT), mask=row_ok[:, None])


def _set_block_shapes(args: dict) -> None:
    """Point the K and V descriptors at one key block of the launch's BLOCK_N."""
    bn, d, dv = args["BLOCK_N"], args["HEAD_DIM"], args["HEAD_DIM_V"]
    args["K_HI"].block_shape = [1, 1, bn, d]
    args["K_LO"].block_shape = [1, 1, bn, d]
    args["V"].block_shape = [1, 1, dv, bn] if args["PV_FP8"] else [1, 1, bn, dv]


def _config(bm, bn, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages,
                         pre_hook=_set_block_shapes)


# The autotuning candidates per head_dim (the larger of D and Dv), from the
# H200 sweeps in BENCHMARKS.md; (32, 32) serves 32-token tiles. Autotuning
# (launch.AUTOTUNE) times those that divide the policy's tile.
_CONFIGS = {
    64: [_config(128, 128, 4, 3), _config(128, 64, 4, 3), _config(64, 64, 4, 3), _config(128, 128, 8, 3)],
    128: [_config(128, 64, 4, 2), _config(128, 64, 4, 3), _config(128, 128, 8, 3), _config(64, 64, 4, 3)],
    256: [_config(64, 64, 8, 2), _config(64, 32, 4, 2)],
}
_SMALL_TILE = [_config(32, 32, 4, 3)]

# The configuration a call runs without autotuning, as (BLOCK_M, BLOCK_N,
# warps, stages), by (compute capability major, head_dim bucket of
# `_CONFIGS`, P·V in FP8): the autotuned winner of most policies in the H200
# run of BENCHMARKS.md ("Hopper (H200): every policy at the target shapes",
# benchmarks/results/h200_attention_quick.json, which
# tests/test_kernels_sm90_rules.py checks the table against). At D 128 one
# warpgroup over 128 query rows and 64 keys won for every policy, the stage
# count varying with P·V's format; at D 64 the block shape varies with it.
# Unmeasured cases (D 256, other GPUs) take the first candidate, as do tiles
# the rule's blocks do not divide.
_RULES = {
    (9, 64, False): (64, 64, 4, 3),
    (9, 64, True): (128, 128, 4, 3),
    (9, 128, False): (128, 64, 4, 2),
    (9, 128, True): (128, 64, 4, 3),
}


def config_key(config: triton.Config) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) of a configuration."""
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages


def _bucket(head_dim: int) -> int:
    return max(64, head_dim)


def _configs_for(head_dim: int, tile: int) -> list[triton.Config]:
    fitting = [c for c in _CONFIGS[_bucket(head_dim)]
               if tile % c.kwargs["BLOCK_M"] == 0 and tile % c.kwargs["BLOCK_N"] == 0]
    return fitting or _SMALL_TILE


@functools.lru_cache(maxsize=None)
def config_for(capability_major: int, head_dim: int, tile: int, pv_fp8: bool) -> triton.Config:
    """The block configuration of a call without autotuning (`_RULES`): an
    autotuning candidate that divides the tile. head_dim: the larger of D and Dv."""
    candidates = _configs_for(head_dim, tile)
    wanted = _RULES.get((capability_major, _bucket(head_dim), pv_fp8))
    return next((c for c in candidates if config_key(c) == wanted), candidates[0])


def _prune(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    wanted = _configs_for(max(args["HEAD_DIM"], args["HEAD_DIM_V"]), args["TILE"])
    keys = {config_key(c) for c in wanted}
    return [c for c in configs if config_key(c) in keys]


_ALL_CONFIGS = [c for cs in _CONFIGS.values() for c in cs] + _SMALL_TILE
_dma_attention_tuned = triton.autotune(
    _ALL_CONFIGS,
    key=["HEAD_DIM", "HEAD_DIM_V", "TILE", "HI_KIND", "LO_KIND", "ONE_CLASS", "PV_FP8", "IS_CAUSAL", "MASK_KIND",
         "LQ_BUCKET", "LK_BUCKET"],
    prune_configs_by={"early_config_prune": _prune},
)(_dma_attention_kernel)


def tuned_config(capability_major: int, head_dim: int, tile: int, pv_fp8: bool) -> triton.Config | None:
    """The block configuration the latest call of this kind ran: autotuning's
    choice with DMA_COMPILE_AUTOTUNE=1 (None before one), else the rule's.
    The public hook benchmarks report it through."""
    if launch.AUTOTUNE:
        return getattr(_dma_attention_tuned, "best_config", None)
    return config_for(capability_major, head_dim, tile, pv_fp8)

# Block sizes under the interpreter: small, and smaller than the tests' 32-token tile.
_INTERPRET_META = {"BLOCK_M": 16, "BLOCK_N": 16}


def _kind(fmt: str, policy: AttentionPolicy) -> int:
    return (KIND_FOLDED if fmt != "none" and policy.mx_mode == "folded" else KIND_16BIT).value


def _check(q, v, scale, policy: AttentionPolicy) -> None:
    if q.device.type != "cuda" and not INTERPRET:
        raise Unsupported(
            f"the sm90 kernel needs CUDA tensors, got {q.device.type} (TRITON_INTERPRET=1 runs it on CPU for testing)"
        )
    LIMITS["sm90"].check(q, v, scale)
    uses_fp8 = policy.pv == "fp8" or any(_kind(f, policy) == KIND_FOLDED.value for f in policy.formats)
    if q.device.type == "cuda" and uses_fp8 and _capability(q.device) < (8, 9):
        raise Unsupported("fp8 tensor cores (folded MX or pv='fp8') need compute capability 8.9 or newer")


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


@dataclass
class QuantizedInputs:
    """What the quantization pass produces for one call: the (Q, K) operands of
    the high and low formats, and V, or e4m3 V^T (B, H, Dv, L_pad) with its
    per-channel scales when P·V runs in FP8 (v_wgmma_order: its keys in
    `quantize.wgmma_key_order`, for the Gluon kernel); q_quantized False:
    Q as given in both operands, for the Gluon kernel's Q prologue; key_keep and
    key_limit: the keys that count (`masks.counted_key_arguments`), whose V
    the attention kernel keeps (the FP8 V^T has the others zeroed already)."""

    q_hi: Operand
    k_hi: Operand
    q_lo: Operand
    k_lo: Operand
    v: torch.Tensor
    v_scales: torch.Tensor | None
    out_dtype: torch.dtype
    key_keep: torch.Tensor | None = None
    key_limit: int | None = None
    v_wgmma_order: bool = False
    # False: Q is left as given (q_hi and q_lo hold it) for a kernel that quantizes it itself.
    q_quantized: bool = True


# Elements of K and V from which the pass with FP8 P·V takes five launches
# instead of three: small calls are bound by host time and launch gaps, large
# ones by bandwidth, where Q's programs in the statistics launch (beside V's
# statistics) and V^T's beside K's token programs run slower than in launches
# of their own (BENCHMARKS.md, 2026-12-05, "Fewer launches").
FEWEST_LAUNCHES_BELOW = 2**24
# The same for a pass without FP8 P·V, whose only choice is Q's programs in
# the statistics launch (two launches) or in one of their own (three).
Q_BESIDE_STATISTICS_BELOW = 2**62
# `pass_launches` layouts as (FEWEST_LAUNCHES_BELOW, Q_BESIDE_STATISTICS_BELOW):
# the rules above, the fewest launches at every size, the most at every size.
PASS_LAUNCH_LAYOUTS = {"rule": None, "fewest": (2**62, 2**62), "most": (0, 0)}


@contextlib.contextmanager
def pass_launches(layout: str):
    """Within it, the pass takes `layout`'s launches (PASS_LAUNCH_LAYOUTS),
    for benchmarks that time the layouts against each other; calls replayed
    from another layout are not reused (`signature`)."""
    global FEWEST_LAUNCHES_BELOW, Q_BESIDE_STATISTICS_BELOW
    if layout not in PASS_LAUNCH_LAYOUTS:
        raise ValueError(f"layout must be one of {list(PASS_LAUNCH_LAYOUTS)}, got {layout!r}")
    saved = FEWEST_LAUNCHES_BELOW, Q_BESIDE_STATISTICS_BELOW
    if PASS_LAUNCH_LAYOUTS[layout] is not None:
        FEWEST_LAUNCHES_BELOW, Q_BESIDE_STATISTICS_BELOW = PASS_LAUNCH_LAYOUTS[layout]
    try:
        yield
    finally:
        FEWEST_LAUNCHES_BELOW, Q_BESIDE_STATISTICS_BELOW = saved


def quantize_inputs(
    q, k, v, policy: AttentionPolicy, key_keep: torch.Tensor | None = None, key_limit: int | None = None,
    is_causal: bool = False, v_wgmma_order: bool = False, quantize_q: bool = True,
) -> QuantizedInputs:
    """The quantization pass: K's (and V's) statistics and Q, then K (and V),
    in the kernel's layouts, in three launches (five for large calls with
    FP8 P·V, `FEWEST_LAUNCHES_BELOW`; without FP8 P·V, two, or three with
    Q's own from `Q_BESIDE_STATISTICS_BELOW`).

    k and v must already have their stride-0 heads collapsed (`schedule.collapse_expanded_heads`).
    key_keep, key_limit: the keys that count (`masks.counted_key_arguments`; default all).
    is_causal: the call's flag, which places each query row's own key for a
    balancing policy (`balance.balance_factors`, torch operations after the
    statistics launch, whose K mean they take; Q's launch follows them).
    v_wgmma_order: FP8 V^T with its keys in `quantize.wgmma_key_order` (the Gluon kernel's).
    quantize_q: False leaves Q as given, for a kernel that quantizes it in its
    prologue (`attention_sm90_gluon.quantizes_q`: no rotation, no balancing).
    """
    mx_formats = tuple(f for f in policy.formats if f != "none")
    balancing = policy.balance_qk and bool(mx_formats)
    fp8_pv = policy.pv == "fp8"
    if not quantize_q and (balancing or policy.rotate != "none"):
        raise ValueError("quantize_q=False: a rotating or balancing policy's Q must be quantized by the pass")
    # Balancing's factors need K's mean, so Q waits for the statistics.
    below = FEWEST_LAUNCHES_BELOW if fp8_pv else Q_BESIDE_STATISTICS_BELOW
    fewest_launches = not balancing and k.numel() + v.numel() < below
    q_plan = None
    if quantize_q and not balancing:
        q_plan = plan_tokens(q, mx_formats, policy.mx_mode, policy.scale_rule, pow2_scales=True,
                             rotate=policy.rotate)
        if not fewest_launches:
            launch_tokens(q_plan)
    stats = kv_statistics(k, v, key_mean=policy.smooth_k, value_scale=fp8_pv,
                          alongside=q_plan if fewest_launches else None, key_keep=key_keep, key_limit=key_limit)
    k_balance = None
    if balancing:
        q_balance, k_balance = balance_factors(q, k, policy, is_causal, key_keep, key_limit, stats.key_mean)
        q_plan = plan_tokens(q, mx_formats, policy.mx_mode, policy.scale_rule, pow2_scales=True,
                             rotate=policy.rotate, balance=q_balance)
        launch_tokens(q_plan)
    smoothed_none = "none" in policy.formats and stats.key_mean is not None
    k_plan = plan_tokens(k, mx_formats, policy.mx_mode, policy.scale_rule, mean=stats.key_mean,
                         write_none=smoothed_none, pow2_scales=True, rotate=policy.rotate, balance=k_balance)
    if not fp8_pv:
        launch_tokens(k_plan)
        v_op = v
    elif fewest_launches:
        v_op = quantize_keys_and_values(k_plan, v, stats.value_exponents, key_keep, key_limit, v_wgmma_order)
    else:
        launch_tokens(k_plan)
        v_op = quantize_values_fp8(v, stats.value_exponents, key_keep, key_limit, v_wgmma_order)
    q_ops = {"none": Operand(q), **(q_plan.operands if quantize_q else {f: Operand(q) for f in mx_formats})}
    k_ops = {"none": Operand(k), **k_plan.operands}
    q_hi, k_hi, q_lo, k_lo = q_ops[policy.hi], k_ops[policy.hi], q_ops[policy.lo], k_ops[policy.lo]
    return QuantizedInputs(q_hi, k_hi, q_lo, k_lo, v_op, stats.value_scales, q.dtype, key_keep, key_limit,
                           v_wgmma_order and fp8_pv, quantize_q)


def _copyable(x: torch.Tensor) -> torch.Tensor:
    """x itself when a bulk-copy descriptor can address it (16-byte aligned
    base and strides, unit last stride), else a contiguous copy."""
    size = x.element_size()
    strides_ok = all(s > 0 and (s * size) % 16 == 0 for n, s in zip(x.shape[:-1], x.stride()[:-1]) if n > 1)
    if x.data_ptr() % 16 == 0 and x.stride(-1) == 1 and strides_ok:
        return x
    launch.forbid_replay()  # the copy is not one of the recorded launches
    # clone: contiguous() of a contiguous tensor at an unaligned address is that same tensor.
    return x.clone(memory_format=torch.contiguous_format)


def descriptor_geometry(x: torch.Tensor, logical_len: int | None = None) -> tuple[torch.Tensor, list, list]:
    """(tensor, shape, strides) of a 4-d bulk-copy descriptor over x (B, H,
    rows, cols): x itself or a contiguous copy (`_copyable`); logical_len
    shortens the last dimension (V^T's padding) so that reads past it return
    zeros. Shared by the Triton and Gluon Hopper kernels."""
    x = _copyable(x)
    shape = list(x.shape)
    if logical_len is not None:
        shape[-1] = logical_len
    # A unit dimension's stride is never used, but must still be a valid one.
    strides = list(x.stride())
    for i in (2, 1, 0):
        if x.shape[i] == 1:
            strides[i] = strides[i + 1] * x.shape[i + 1]
    return x, shape, strides


def _descriptor(x: torch.Tensor, logical_len: int | None = None) -> TensorDescriptor:
    """A 4-d descriptor over x (`descriptor_geometry`). The block shape is set
    per launch configuration (`_set_block_shapes`)."""
    return TensorDescriptor(*descriptor_geometry(x, logical_len), [1, 1, 16, 16])


def _mask_arguments(attn_mask, b: int, hq: int, lq: int, lk: int, placeholder: torch.Tensor,
                    info: MaskInfo | None = None):
    """(MASK_KIND, the kernel's nine mask arguments) for an explicit mask or
    None; info: the mask's classification, if already at hand."""
    if attn_mask is None:
        return MASK_NONE.value, (placeholder, 0, 0, 0, 0, placeholder, 0, 0, 0)
    info = info if info is not None else classify_mask(attn_mask, b, hq, lq, lk)
    return ((MASK_BOOL if info.is_bool else MASK_ADDITIVE).value,
            (info.values, *info.values.stride(), info.summary, *info.summary_strides))


def _kernel_args(
    qi: QuantizedInputs, out: torch.Tensor, shape: tuple[int, int, int, int, int, int, int], mask_kind: int,
    mask_args: tuple, is_causal: bool, scale: float, policy: AttentionPolicy,
) -> dict:
    """The attention kernel's arguments by name, block sizes left out."""
    b, hq, hk, lq, lk, d, dv = shape

    def operand_args(q_op: Operand, k_op: Operand, k_desc: TensorDescriptor):
        x = q_op.values
        return (x, q_op.scales if q_op.scales is not None else x, *x.stride(), k_desc,
                k_op.scales if k_op.scales is not None else x)

    # One descriptor (and at most one contiguous copy) when both classes read the same K.
    k_lo = _descriptor(qi.k_lo.values)
    k_hi = k_lo if qi.k_hi.values is qi.k_lo.values else _descriptor(qi.k_hi.values)
    pv_fp8 = policy.pv == "fp8"
    args = dict(zip(
        ("Q_HI", "QS_HI", "sqh_b", "sqh_h", "sqh_m", "sqh_d", "K_HI", "KS_HI",
         "Q_LO", "QS_LO", "sql_b", "sql_h", "sql_m", "sql_d", "K_LO", "KS_LO"),
        (*operand_args(qi.q_hi, qi.k_hi, k_hi), *operand_args(qi.q_lo, qi.k_lo, k_lo)),
    ))
    args.update(
        V=_descriptor(qi.v, lk if pv_fp8 else None), VSCALE=qi.v_scales if pv_fp8 else qi.v, O=out,
        so_b=out.stride(0), so_h=out.stride(1), so_m=out.stride(2), so_d=out.stride(3),
    )
    args.update(zip(("MASK", "sm_b", "sm_h", "sm_m", "sm_n", "SUMM", "ss_b", "ss_h", "ss_r"), mask_args))
    keep, skp_b, skp_h, has_keep = key_keep_arguments(qi.key_keep, b, hk, lk, out)
    key_limit = lk if qi.key_limit is None else qi.key_limit
    args.update(KEEP=keep, skp_b=skp_b, skp_h=skp_h, KEY_LIMIT=key_limit,
                SELECT_V=v_select_mode(has_keep, key_limit, lk, pv_fp8))
    args.update(
        sm_scale=scale * LOG2E.value, Hq=hq, Hk=hk, Lq=lq, Lk=lk, SINK_TILES=policy.sink_tiles, DIAG_TILES=policy.diag_tiles,
        LQ_BUCKET=launch.next_power_of_2(lq), LK_BUCKET=launch.next_power_of_2(lk),
        HEAD_DIM=d, HEAD_DIM_V=dv, TILE=policy.tile,
        HI_KIND=_kind(policy.hi, policy), LO_KIND=_kind(policy.lo, policy), ONE_CLASS=policy.hi == policy.lo,
        PV_FP8=pv_fp8, IS_CAUSAL=bool(is_causal), MASK_KIND=mask_kind, CELL=CELL, HW_CVT=HW_CVT,
    )
    return args


def attention_from_quantized(
    qi: QuantizedInputs, shape: tuple[int, int, int, int, int, int, int], attn_mask, is_causal: bool, scale: float,
    policy: AttentionPolicy, config: triton.Config | None = None, mask_info: MaskInfo | None = None,
) -> torch.Tensor:
    """The attention kernel alone. shape: (B, Hq, Hkv, Lq, Lk, D, Dv);
    mask_info: attn_mask's classification, if already at hand."""
    b, hq, hk, lq, lk, d, dv = shape
    out = empty_output(b, hq, lq, dv, qi.out_dtype, qi.q_lo.values.device)
    mask_kind, mask_args = _mask_arguments(attn_mask, b, hq, lq, lk, qi.q_lo.values, mask_info)
    args = _kernel_args(qi, out, shape, mask_kind, mask_args, is_causal, scale, policy)
    if INTERPRET:
        args.update(_INTERPRET_META)
        _set_block_shapes(args)
        launch.launch(_dma_attention_kernel, (launch.cdiv(lq, args["BLOCK_M"]), b * hq), **args)
        return out
    if launch.AUTOTUNE and config is None:
        grid = lambda m: (launch.cdiv(lq, m["BLOCK_M"]), b * hq)  # noqa: E731
        launch.launch(_dma_attention_tuned, grid, **args)
        return out
    config = config or config_for(_capability(out.device)[0], max(d, dv), policy.tile, policy.pv == "fp8")
    args.update(config.kwargs)
    _set_block_shapes(args)
    launch.launch(_dma_attention_kernel, (launch.cdiv(lq, config.kwargs["BLOCK_M"]), b * hq), **args,
                  num_warps=config.num_warps, num_stages=config.num_stages)
    return out


# Call signature -> its launches as a `launch.Replay` (or _NO_REPLAY); cleared when full.
_replays: dict = {}
_NO_REPLAY = object()
_MAX_REPLAYS = 512


def attention_sm90(
    q, k, v, attn_mask, is_causal: bool, scale: float | None, policy: AttentionPolicy,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """DMA attention on validated SDPA-style inputs (see ops.dma_attention).

    config: run this block configuration instead of the rule's or the
    autotuned one (tests). A call without a mask whose signature (shapes,
    strides, 16-byte alignment, dtype, device, flags, policy) was seen before
    replays the launches of its first call (`launch.Replay`): same kernels,
    same arguments, without Triton's per-launch binding.
    """
    if attn_mask is not None or config is not None or INTERPRET:
        return _attention(q, k, v, attn_mask, is_causal, scale, policy, config)
    key = signature(q, k, v, is_causal, scale, policy)
    replay = _replays.get(key)
    if replay is None:
        with launch.recording() as rec:
            out = _attention(q, k, v, None, is_causal, scale, policy, None)
        if len(_replays) >= _MAX_REPLAYS:
            _replays.clear()
        _replays[key] = rec.replay((q, k, v), out) or _NO_REPLAY
        return out
    if replay is _NO_REPLAY:
        return _attention(q, k, v, None, is_causal, scale, policy, None)
    return replay.run((q, k, v))


def signature(q, k, v, is_causal: bool, scale: float | None, policy: AttentionPolicy) -> tuple:
    """What a call without a mask must share with an earlier one to replay its launches
    (the pass's launch layout rule too: benchmarks set it per run)."""
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, q.device, is_causal, scale,
            policy.to_string(), q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16, launch.AUTOTUNE,
            FEWEST_LAUNCHES_BELOW, Q_BESIDE_STATISTICS_BELOW)


def _attention(q, k, v, attn_mask, is_causal: bool, scale: float | None, policy: AttentionPolicy,
               config: triton.Config | None) -> torch.Tensor:
    b, hq, lq, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    _check(q, v, scale, policy)
    k, v = collapse_expanded_heads(k, v)
    hk, lk = k.shape[1], k.shape[2]
    shape = (b, hq, hk, lq, lk, d, v.shape[-1])
    info = classify_mask(attn_mask, b, hq, lq, lk) if attn_mask is not None else None
    qi = quantize_inputs(q, k, v, policy, *counted_key_arguments(info, is_causal, lq, lk, hk), is_causal=is_causal)
    return attention_from_quantized(qi, shape, attn_mask, is_causal, scale, policy, config, info)


# (B, Hq, Hkv, L) of the launch that offline compiles specialise on.
COMPILE_SHAPE = (1, 8, 2, 1024)


def placeholder_inputs(policy: AttentionPolicy, dtype: torch.dtype, head_dim: int,
                       q_quantized: bool = True) -> QuantizedInputs:
    """Small CPU tensors shaped as the quantization pass's output for a
    COMPILE_SHAPE call (not meta tensors: descriptors read a data pointer);
    what offline compiles of the Hopper kernels launch on. q_quantized False:
    Q as given (`quantize_inputs(..., quantize_q=False)`)."""
    b, hq, hk, length = COMPILE_SHAPE
    d = head_dim

    def empty(*shape, dtype=dtype):
        return torch.empty(*shape, dtype=dtype)

    def operand(fmt: str, heads: int) -> Operand:
        if fmt == "none":
            return Operand(empty(b, heads, length, d))
        if policy.mx_mode == "folded":
            return Operand(empty(b, heads, length, d, dtype=torch.float8_e4m3fn),
                           empty(b, heads, length, dtype=torch.int32), empty(b, heads, length, dtype=torch.float32))
        return Operand(empty(b, heads, length, d, dtype=torch.bfloat16))

    if policy.pv == "fp8":
        v, v_scales = empty(b, hk, d, length, dtype=torch.float8_e4m3fn), empty(b, hk, d, dtype=torch.float32)
    else:
        v, v_scales = empty(b, hk, length, d), None
    q_hi, q_lo = (operand(policy.hi, hq), operand(policy.lo, hq)) if q_quantized else (operand("none", hq),) * 2
    return QuantizedInputs(q_hi, operand(policy.hi, hk), q_lo, operand(policy.lo, hk), v, v_scales, dtype,
                           q_quantized=q_quantized)


def compile_sm90(policy: AttentionPolicy, *, dtype: str = "bfloat16", head_dim: int = 128, is_causal: bool = False,
                 mask: str | None = None, config: triton.Config | None = None, capability: int = 90):
    """Compile the attention kernel for CUDA compute capability `capability`
    (90: H100/H200, sm_90a) on any machine, GPU or not.

    Arguments are specialised as a launch on (1, 8, 1024, head_dim) queries
    and (1, 2, 1024, head_dim) keys and values would be; mask: None, "bool"
    or "additive" (broadcast over heads); config: the block configuration
    (default: the one a call on that GPU runs without autotuning,
    `config_for`). Returns Triton's compiled kernel: `.asm` holds "ttgir", "ptx" and
    "cubin". Needs TRITON_INTERPRET unset.
    """
    from dma_compile.kernels.target_compile import compile_for_target

    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    b, hq, hk, length, d = COMPILE_SHAPE + (head_dim,)
    qi = placeholder_inputs(policy, torch_dtype, head_dim)

    def empty(*shape, dtype=torch_dtype):
        return torch.empty(*shape, dtype=dtype)

    out = empty_output(b, hq, length, d, torch_dtype, "cpu")
    if mask is None:
        mask_kind, mask_args = _mask_arguments(None, b, hq, length, length, out)
    else:
        values = empty(b, 1, length, length, dtype=torch.uint8 if mask == "bool" else torch_dtype)
        summary = empty(b, 1, length // CELL, 4, dtype=torch.int32)
        mask_kind = {"bool": MASK_BOOL, "additive": MASK_ADDITIVE}[mask].value
        mask_args = (values, *values.expand(b, hq, length, length).stride(),
                     summary, summary.stride(0), 0, summary.stride(2))
    shape = (b, hq, hk, length, length, d, d)
    args = _kernel_args(qi, out, shape, mask_kind, mask_args, is_causal, 1.0 / math.sqrt(d), policy)
    config = config or config_for(capability // 10, d, policy.tile, policy.pv == "fp8")
    args.update(config.kwargs)
    _set_block_shapes(args)
    return compile_for_target(_dma_attention_kernel, args, capability, config.num_warps, config.num_stages)
