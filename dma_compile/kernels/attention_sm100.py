"""Blackwell (sm_100) DMA attention: QK^T on block-scaled tensor cores.

The structure is the Hopper kernel's (`attention_sm90`): each program owns
BLOCK_M query rows of one (batch, head); BLOCK_M and BLOCK_N divide the
policy's tile, so a block never straddles two precision tiles, and each class
walks its key ranges (sink and diagonal band in the high format, the rest in
the low one; docs/semantics.md) in one loop without masking and one with
(causal, key tail, partial blocks of an explicit mask, read only there). What
differs is QK^T, chosen per class at compile time:

- MX, mx_mode "exact": `tl.dot_scaled` on the payloads and E8M0 scales that
  `quantize_mx` writes, which Triton lowers to tcgen05.mma kind::mxf8f6f4 /
  kind::mxf4 with block scales on sm_100 when BLOCK_M is 128 (tile >= 128),
  and to an exact bf16 emulation otherwise (smaller tiles, older GPUs);
- MX, mx_mode "folded": e4m3 payloads and one power of two per token
  (`quantize.quantize_tokens`), an fp8 `tl.dot` scaled per row and column;
- "none": `tl.dot` in the input dtype (fp32 inputs: full fp32, no tf32).

Softmax is online in fp32 with exp2; P·V runs in V's dtype or in e4m3 with
V's per-channel scales. `compile_sm100` compiles the kernel for an sm_100
target without a GPU, so its PTX can be checked where there is no B200.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dma_compile.kernels import Unsupported
from dma_compile.kernels.balance import balance_factors
from dma_compile.kernels.codes import (
    KIND_16BIT,
    KIND_FOLDED,
    KIND_MX,
    LOG2E,
    MASK_ADDITIVE,
    MASK_BOOL,
    MASK_NONE,
    SELECT_V_KEEP,
    SELECT_V_NONE,
)
from dma_compile.kernels.limits import LIMITS
from dma_compile.kernels.launch import LAUNCH_OPTIONS, cdiv
from dma_compile.kernels.masks import CELL, classify_mask, counted_key_arguments
from dma_compile.kernels.numerics import (
    HW_CVT,
    INTERPRET,
    TRITON_VERSION,
    pow2_wide,
    to_dtype,
    to_e4m3,
    to_f32,
)
from dma_compile.kernels.output import empty_output
from dma_compile.kernels.quantize import (
    key_keep_arguments,
    kv_statistics,
    quantize_tokens,
    quantize_values_fp8,
)
from dma_compile.kernels.quantize_mx import quantize_payloads
from dma_compile.kernels.schedule import (
    block_counts,
    block_start,
    collapse_expanded_heads,
    counted_v,
    key_range,
    precision_band,
    split_by_masking,
    v_select_mode,
)
from dma_compile.policy import AttentionPolicy

# tl.dot_scaled's names of the element formats.
DOT_SCALED_FORMAT = {"mxfp8_e4m3": "e4m3", "mxfp8_e5m2": "e5m2", "mxfp4_e2m1": "e2m1"}
# Triton 3.6 fails to compile a zero-initialised tl.dot_scaled in a loop for
# sm_100 (3.9 does not): older versions get a zero it cannot see (see _qk).
RUNTIME_ZERO_ACC = TRITON_VERSION < (3, 9)


@triton.jit
def _dot_input(a, b, HW_CVT: tl.constexpr):
    """a @ b in fp32 for operands in the input dtype; fp32 operands stay fp32
    (no tf32). The interpreter cannot multiply bf16: it gets exact fp32 copies."""
    if not HW_CVT:
        r = tl.dot(to_f32(a, HW_CVT), to_f32(b, HW_CVT), input_precision="ieee")
    elif a.dtype == tl.float32:
        r = tl.dot(a, b, input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r


@triton.jit
def _load_q(Q, QS, s_l, offs_m, row_ok, D: tl.constexpr, KIND: tl.constexpr, FMT: tl.constexpr):
    """One class's Q block: values or payload [BLOCK_M, width] and its scales:
    E8M0 [BLOCK_M, DK // 32] (KIND 1), per-row powers of two (KIND 2), or none.
    Q and QS point at this (batch, head)."""
    # MXFP4 MMAs reduce over at least 64 elements: a head_dim of 32 is padded
    # with zero elements of scale 1, which add nothing.
    PAD: tl.constexpr = (KIND == KIND_MX) & (FMT == "e2m1") & (D < 64)
    DK: tl.constexpr = 64 if PAD else D
    W: tl.constexpr = DK // 2 if FMT == "e2m1" else DK
    w = tl.arange(0, W)
    ok = row_ok[:, None] & (w[None, :] < D // 2) if PAD else row_ok[:, None]
    q = tl.load(Q + offs_m[:, None].to(tl.int64) * s_l + w[None, :], mask=ok, other=0)
    if KIND == KIND_MX:
        nb = tl.arange(0, DK // 32)
        ok = row_ok[:, None] & (nb[None, :] < D // 32) if PAD else row_ok[:, None]
        # Rows past Lq get scale 1 (127): their payload is zero and they are never stored.
        qs = tl.load(QS + offs_m[:, None].to(tl.int64) * (D // 32) + nb[None, :], mask=ok, other=127)
    elif KIND == KIND_FOLDED:
        q = q.to(tl.float8e4nv, bitcast=True)
        qs = pow2_wide(tl.load(QS + offs_m, mask=row_ok, other=0))
    else:
        qs = 0.0
    return q, qs


@triton.jit
def _qk(q, qs, K, KS, s_l, offs_n, key_ok, zero,
        D: tl.constexpr, KIND: tl.constexpr, FMT: tl.constexpr, MASKED: tl.constexpr,
        RUNTIME_ZERO_ACC: tl.constexpr, HW_CVT: tl.constexpr):
    """Unscaled scores Q_c K_c^T [BLOCK_M, BLOCK_N] in fp32 for one key block."""
    PAD: tl.constexpr = (KIND == KIND_MX) & (FMT == "e2m1") & (D < 64)
    DK: tl.constexpr = 64 if PAD else D
    W: tl.constexpr = DK // 2 if FMT == "e2m1" else DK
    w = tl.arange(0, W)
    # K^T [W, BLOCK_N]; e2m1 stays packed along the reduction dimension.
    k_ptrs = K + offs_n[None, :].to(tl.int64) * s_l + w[:, None]
    if PAD:
        kt = tl.load(k_ptrs, mask=key_ok[None, :] & (w[:, None] < D // 2), other=0)
    elif MASKED:
        kt = tl.load(k_ptrs, mask=key_ok[None, :], other=0)
    else:
        kt = tl.load(k_ptrs)
    if KIND == KIND_MX:
        nb = tl.arange(0, DK // 32)
        ks_ptrs = KS + offs_n[:, None].to(tl.int64) * (D // 32) + nb[None, :]
        if PAD:
            ks = tl.load(ks_ptrs, mask=key_ok[:, None] & (nb[None, :] < D // 32), other=127)
        elif MASKED:
            ks = tl.load(ks_ptrs, mask=key_ok[:, None], other=127)
        else:
            ks = tl.load(ks_ptrs)
        if RUNTIME_ZERO_ACC:
            s = tl.dot_scaled(q, qs, FMT, kt, ks, FMT, acc=tl.zeros([q.shape[0], offs_n.shape[0]], tl.float32) + zero)
        else:
            s = tl.dot_scaled(q, qs, FMT, kt, ks, FMT)
    elif KIND == KIND_FOLDED:
        if MASKED:
            ka = tl.load(KS + offs_n, mask=key_ok, other=0)
        else:
            ka = tl.load(KS + offs_n)
        s = tl.dot(q, kt.to(tl.float8e4nv, bitcast=True)) * qs[:, None] * pow2_wide(ka)[None, :]
    else:
        s = _dot_input(q, kt, HW_CVT)
    return s


@triton.jit
def _attend(
    acc, l_i, m_i, q, qs, offs_m, row_ok, qk_scale,
    K, KS, sk_l, V, sv_l, sv_d, MASK, sm_q, sm_k, KEEP, KEY_LIMIT, Lk,
    r0s, r0e, r1s, r1e, r2s, r2e, r3s, r3e,
    BLOCK_N: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, KIND: tl.constexpr, FMT: tl.constexpr,
    MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, PV_FP8: tl.constexpr,
    SELECT_V: tl.constexpr, RUNTIME_ZERO_ACC: tl.constexpr, HW_CVT: tl.constexpr,
):
    """Online softmax and P·V over the key blocks of up to four [start, end) ranges of one class.

    Masked scores are selected to -inf (a NaN score of a masked key stays out
    of the row); with SELECT_V the masking loop also selects zeros for the V
    of keys no row attends (as attention_sm90._attend)."""
    dv = tl.arange(0, DV)
    arange_n = tl.arange(0, BLOCK_N)
    n0, n1, n2, n3 = block_counts(r0s, r0e, r1s, r1e, r2s, r2e, r3s, r3e, BLOCK_N)
    # Only Triton < 3.9 reads it (see _qk); a product with 0.0 is not folded away.
    zero = qk_scale * 0.0
    for i in range(0, n0 + n1 + n2 + n3):
        offs_n = block_start(i, n0, n1, n2, r0s, r1s, r2s, r3s, BLOCK_N) + arange_n
        key_ok = offs_n < Lk
        s = _qk(q, qs, K, KS, sk_l, offs_n, key_ok, zero, D, KIND, FMT, MASKED, RUNTIME_ZERO_ACC, HW_CVT)
        s = s * qk_scale
        if MASKED:
            keep = key_ok[None, :]
            if IS_CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None])
            if MASK_KIND != MASK_NONE:
                m_ptrs = MASK + offs_m[:, None].to(tl.int64) * sm_q + offs_n[None, :].to(tl.int64) * sm_k
                m_ok = row_ok[:, None] & key_ok[None, :]
                if MASK_KIND == MASK_BOOL:
                    keep = keep & (tl.load(m_ptrs, mask=m_ok, other=0) != 0)
                else:
                    bias = to_f32(tl.load(m_ptrs, mask=m_ok, other=0.0), HW_CVT)
                    keep = keep & (bias != float("-inf"))
                    s = s + bias * LOG2E
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with nothing attended so far keeps max -inf: subtract 0 there (p = 0).
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = m_new
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v_ptrs = V + offs_n[:, None].to(tl.int64) * sv_l + dv[None, :] * sv_d
        if MASKED:
            v = tl.load(v_ptrs, mask=key_ok[:, None], other=0.0)
            if SELECT_V != SELECT_V_NONE:
                v = tl.where(counted_v(KEEP, offs_n, key_ok, KEY_LIMIT, SELECT_V == SELECT_V_KEEP)[:, None], v, 0.0)
        else:
            v = tl.load(v_ptrs)
        if PV_FP8 and HW_CVT:
            acc = tl.dot(to_e4m3(p * 256.0, HW_CVT), v, acc)
        elif PV_FP8:
            # The interpreter reads e4m3's NaN code as 480: widen through to_f32.
            acc = tl.dot(to_f32(to_e4m3(p * 256.0, HW_CVT), HW_CVT), to_f32(v, HW_CVT), acc)
        else:
            acc += _dot_input(to_dtype(p, V.dtype.element_ty, HW_CVT), v, HW_CVT)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _dma_attention_sm100_kernel(
    QH, sqh_b, sqh_h, sqh_l, QHS,
    KH, skh_b, skh_h, skh_l, KHS,
    QL, sql_b, sql_h, sql_l, QLS,
    KL, skl_b, skl_h, skl_l, KLS,
    V, sv_b, sv_h, sv_l, sv_d, VSCALE,
    O, so_b, so_h, so_l,
    MASK, sm_b, sm_h, sm_q, sm_k,
    SUMM, ss_b, ss_h, ss_r,
    KEEP, skp_b, skp_h, KEY_LIMIT,
    qk_scale, Hq, Hk, Lq, Lk, SINK_TILES, DIAG_TILES,
    TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    HI_KIND: tl.constexpr, HI_FMT: tl.constexpr, LO_KIND: tl.constexpr, LO_FMT: tl.constexpr,
    ONE_CLASS: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, PV_FP8: tl.constexpr,
    SELECT_V: tl.constexpr,
    CELL: tl.constexpr, RUNTIME_ZERO_ACC: tl.constexpr, HW_CVT: tl.constexpr,
):
    tl.static_assert(TILE % BLOCK_M == 0)
    tl.static_assert(TILE % BLOCK_N == 0)
    # Longest rows first: with causal masking the last query blocks do the most work.
    m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    pid_bh = tl.program_id(1)
    b = pid_bh // Hq
    h = pid_bh % Hq
    hk = h // (Hq // Hk)
    b64 = b.to(tl.int64)
    h64 = h.to(tl.int64)
    hk64 = hk.to(tl.int64)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < Lq

    kv_start, kv_end, u_lo, u_hi = key_range(
        m0, Lq, Lk, SUMM + b64 * ss_b + h64 * ss_h, ss_r, IS_CAUSAL, MASK_KIND != MASK_NONE, CELL,
        BLOCK_M, BLOCK_N
    )
    sink_end, band_s, band_e = precision_band(m0, Lq, Lk, SINK_TILES, DIAG_TILES, TILE, IS_CAUSAL, ONE_CLASS)

    acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    v_base = V + b64 * sv_b + hk64 * sv_h
    mask_base = MASK + b64 * sm_b + h64 * sm_h
    keep_base = KEEP + b64 * skp_b + hk64 * skp_h
    # MX scales (D // 32 per token) and folded exponents (one per token) are contiguous.
    LO_SW: tl.constexpr = D // 32 if LO_KIND == KIND_MX else 1
    HI_SW: tl.constexpr = D // 32 if HI_KIND == KIND_MX else 1
    q_tokens = pid_bh.to(tl.int64) * Lq
    k_tokens = (b64 * Hk + hk64) * Lk

    # Low format: [sink_end, band_s) and [band_e, kv_end).
    a0, a1, b0, b1, c0, c1, d0, d1, e0, e1, f0, f1 = split_by_masking(
        sink_end, band_s, band_e, kv_end, kv_start, kv_end, u_lo, u_hi
    )
    q, qs = _load_q(QL + b64 * sql_b + h64 * sql_h, QLS + q_tokens * LO_SW, sql_l, offs_m, row_ok,
                    D, LO_KIND, LO_FMT)
    k_base = KL + b64 * skl_b + hk64 * skl_h
    ks_base = KLS + k_tokens * LO_SW
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q, qs, offs_m, row_ok, qk_scale, k_base, ks_base, skl_l, v_base, sv_l, sv_d,
        mask_base, sm_q, sm_k, keep_base, KEY_LIMIT, Lk, a0, a1, b0, b1, 0, 0, 0, 0,
        BLOCK_N, D, DV, LO_KIND, LO_FMT, False, IS_CAUSAL, MASK_KIND, PV_FP8, SELECT_V, RUNTIME_ZERO_ACC, HW_CVT)
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q, qs, offs_m, row_ok, qk_scale, k_base, ks_base, skl_l, v_base, sv_l, sv_d,
        mask_base, sm_q, sm_k, keep_base, KEY_LIMIT, Lk, c0, c1, d0, d1, e0, e1, f0, f1,
        BLOCK_N, D, DV, LO_KIND, LO_FMT, True, IS_CAUSAL, MASK_KIND, PV_FP8, SELECT_V, RUNTIME_ZERO_ACC, HW_CVT)

    if not ONE_CLASS:
        # High format: [0, sink_end) and [band_s, band_e).
        a0, a1, b0, b1, c0, c1, d0, d1, e0, e1, f0, f1 = split_by_masking(
            0, sink_end, band_s, band_e, kv_start, kv_end, u_lo, u_hi
        )
        q, qs = _load_q(QH + b64 * sqh_b + h64 * sqh_h, QHS + q_tokens * HI_SW, sqh_l, offs_m, row_ok,
                        D, HI_KIND, HI_FMT)
        k_base = KH + b64 * skh_b + hk64 * skh_h
        ks_base = KHS + k_tokens * HI_SW
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, qs, offs_m, row_ok, qk_scale, k_base, ks_base, skh_l, v_base, sv_l, sv_d,
            mask_base, sm_q, sm_k, keep_base, KEY_LIMIT, Lk, a0, a1, b0, b1, 0, 0, 0, 0,
            BLOCK_N, D, DV, HI_KIND, HI_FMT, False, IS_CAUSAL, MASK_KIND, PV_FP8, SELECT_V, RUNTIME_ZERO_ACC, HW_CVT)
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, qs, offs_m, row_ok, qk_scale, k_base, ks_base, skh_l, v_base, sv_l, sv_d,
            mask_base, sm_q, sm_k, keep_base, KEY_LIMIT, Lk, c0, c1, d0, d1, e0, e1, f0, f1,
            BLOCK_N, D, DV, HI_KIND, HI_FMT, True, IS_CAUSAL, MASK_KIND, PV_FP8, SELECT_V, RUNTIME_ZERO_ACC, HW_CVT)

    dv = tl.arange(0, DV)
    if PV_FP8:
        # O = (P8 @ V8) * s_v / (256 l), s_v per channel.
        acc = acc * (tl.load(VSCALE + (b64 * Hk + hk64) * DV + dv) * (1.0 / 256.0))[None, :]
    # A row with every key masked has l = 0 and outputs zeros, as SDPA.
    empty = l_i == 0.0
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
    o_ptrs = O + b64 * so_b + h64 * so_h + offs_m[:, None].to(tl.int64) * so_l + dv[None, :]
    tl.store(o_ptrs, to_dtype(out, O.dtype.element_ty, HW_CVT), mask=row_ok[:, None])


@dataclass
class _ClassOperands:
    """Q and K of one precision class as the kernel reads them.

    q, k: values in the input dtype (KIND_16BIT), or uint8 bytes of e4m3 values
    (KIND_FOLDED) or of MX payloads (KIND_MX), last dimension contiguous;
    q_scales, k_scales: E8M0 scales (KIND_MX), int32 per-token exponents
    (KIND_FOLDED), unused otherwise.
    """

    kind: int
    fmt: str
    q: torch.Tensor
    q_scales: torch.Tensor
    k: torch.Tensor
    k_scales: torch.Tensor


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _class_operands(q, k, key_mean, policy: AttentionPolicy, balance=(None, None)) -> dict[str, _ClassOperands]:
    """Q and K of every format the policy uses, from one quantization pass
    each; balance: Q's and K's balancing factors (`balance.balance_factors`) or Nones."""
    mx = tuple(f for f in policy.formats if f != "none")
    q_balance, k_balance = balance
    smoothed_none = "none" in policy.formats and key_mean is not None
    ops: dict[str, _ClassOperands] = {}
    if policy.mx_mode == "folded":
        q_mx = quantize_tokens(q, mx, "folded", policy.scale_rule, rotate=policy.rotate, balance=q_balance)
        k_mx = quantize_tokens(k, mx, "folded", policy.scale_rule, mean=key_mean, write_none=smoothed_none,
                               rotate=policy.rotate, balance=k_balance)
        for f in mx:
            # As bytes: a masked load from an fp8 pointer takes no fill value.
            ops[f] = _ClassOperands(KIND_FOLDED.value, "e4m3", q_mx[f].values.view(torch.uint8), q_mx[f].exponents,
                                    k_mx[f].values.view(torch.uint8), k_mx[f].exponents)
        k_none = k_mx["none"].values if smoothed_none else None
    else:
        q_mx = quantize_payloads(q, mx, policy.scale_rule, rotate=policy.rotate, balance=q_balance)
        k_mx = quantize_payloads(k, mx, policy.scale_rule, mean=key_mean, write_none=smoothed_none,
                                 rotate=policy.rotate, balance=k_balance)
        for f in mx:
            ops[f] = _ClassOperands(KIND_MX.value, DOT_SCALED_FORMAT[f], q_mx[f].payload, q_mx[f].scales,
                                    k_mx[f].payload, k_mx[f].scales)
        k_none = k_mx["none"] if smoothed_none else None
    if "none" in policy.formats:
        q_plain = _unit_last(q)
        k_plain = k_none if k_none is not None else _unit_last(k)
        ops["none"] = _ClassOperands(KIND_16BIT.value, "none", q_plain, q_plain, k_plain, k_plain)
    return ops


def default_block_sizes(tile: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): 128 x 128 (128 x 64 from head_dim 256), capped by the tile.

    Triton lowers tl.dot_scaled to the block-scaled tcgen05.mma only with
    BLOCK_M = 128; smaller tiles run its exact emulation.
    """
    return min(128, tile), min(128 if head_dim <= 128 else 64, tile)


def _num_warps(block_m: int) -> int:
    return 8 if block_m >= 128 else 4


def _check_supported(q, v, policy: AttentionPolicy) -> None:
    LIMITS["sm100"].check(q, v, None)
    if INTERPRET:
        if q.device.type != "cpu":
            raise Unsupported(f"under TRITON_INTERPRET=1 the sm100 kernel takes CPU tensors, got {q.device.type}")
        if policy.mx_mode == "exact" and policy.uses_mx and not _interpreter_has_dot_scaled():
            raise Unsupported(
                f"Triton {triton.__version__}'s interpreter has no tl.dot_scaled, which exact MX needs "
                "(Triton 3.9's has it)"
            )
    elif q.device.type != "cuda":
        raise Unsupported(
            f"the sm100 kernel needs CUDA tensors, got {q.device.type} (TRITON_INTERPRET=1 runs it on CPU for testing)"
        )
    if q.shape[0] * q.shape[1] > 65535:
        raise Unsupported(f"q: the sm100 kernel serves batch * heads <= 65535, got {q.shape[0] * q.shape[1]}")
    uses_fp8 = policy.pv == "fp8" or (policy.mx_mode == "folded" and policy.uses_mx)
    if q.device.type == "cuda" and uses_fp8 and torch.cuda.get_device_capability(q.device) < (8, 9):
        raise Unsupported("fp8 tensor cores (folded MX or pv='fp8') need compute capability 8.9 or newer")


def _interpreter_has_dot_scaled() -> bool:
    from triton.runtime.interpreter import InterpreterBuilder

    return hasattr(InterpreterBuilder, "create_dot_scaled")


def _launch_arguments(q, k, v_op, v_strides, v_scales, out, mask, mask_strides, summary, summary_strides,
                      mask_kind, ops_hi: _ClassOperands, ops_lo: _ClassOperands, is_causal, scale,
                      policy: AttentionPolicy, block_m, block_n, key_keep=None, key_limit=None) -> tuple[dict, dict]:
    """The kernel's runtime arguments and constexprs by name, shared by the
    launch and `compile_sm100`. v_strides: V's (batch, head, key, channel)
    strides, whatever its memory layout; key_keep, key_limit: the keys that
    count (`masks.counted_key_arguments`)."""
    hq, lq, d = q.shape[1], q.shape[2], q.shape[3]
    hk, lk = k.shape[1], k.shape[2]
    tile = policy.tile
    n_q_tiles, n_k_tiles = cdiv(lq, tile), cdiv(lk, tile)
    args = {}
    for suffix, ops in (("H", ops_hi), ("L", ops_lo)):
        s = suffix.lower()
        args[f"Q{suffix}"], args[f"Q{suffix}S"] = ops.q, ops.q_scales
        args[f"sq{s}_b"], args[f"sq{s}_h"], args[f"sq{s}_l"] = ops.q.stride()[:3]
        args[f"K{suffix}"], args[f"K{suffix}S"] = ops.k, ops.k_scales
        args[f"sk{s}_b"], args[f"sk{s}_h"], args[f"sk{s}_l"] = ops.k.stride()[:3]
    args["V"], args["VSCALE"] = v_op, v_scales
    args["sv_b"], args["sv_h"], args["sv_l"], args["sv_d"] = v_strides
    args["O"] = out
    args["so_b"], args["so_h"], args["so_l"] = out.stride()[:3]
    args["MASK"] = mask
    args["sm_b"], args["sm_h"], args["sm_q"], args["sm_k"] = mask_strides
    args["SUMM"] = summary
    args["ss_b"], args["ss_h"], args["ss_r"] = summary_strides
    pv_fp8 = policy.pv == "fp8"
    keep, args["skp_b"], args["skp_h"], has_keep = key_keep_arguments(key_keep, q.shape[0], hk, lk, out)
    args["KEEP"], args["KEY_LIMIT"] = keep, lk if key_limit is None else key_limit
    select_v = v_select_mode(has_keep, args["KEY_LIMIT"], lk, pv_fp8)
    args.update(
        qk_scale=scale * LOG2E.value, Hq=hq, Hk=hk, Lq=lq, Lk=lk,
        # Clamped so that the tile products stay in int32; larger counts mean the same.
        SINK_TILES=min(policy.sink_tiles, n_k_tiles),
        DIAG_TILES=min(policy.diag_tiles, n_q_tiles + n_k_tiles + 1),
    )
    constexprs = dict(
        TILE=tile, BLOCK_M=block_m, BLOCK_N=block_n, D=d, DV=out.shape[-1],
        HI_KIND=ops_hi.kind, HI_FMT=ops_hi.fmt, LO_KIND=ops_lo.kind, LO_FMT=ops_lo.fmt,
        ONE_CLASS=policy.hi == policy.lo, IS_CAUSAL=bool(is_causal), MASK_KIND=mask_kind,
        PV_FP8=pv_fp8, SELECT_V=select_v, CELL=CELL, RUNTIME_ZERO_ACC=RUNTIME_ZERO_ACC, HW_CVT=HW_CVT,
    )
    return args, constexprs


def attention_sm100(q, k, v, attn_mask, is_causal: bool, scale: float | None, policy: AttentionPolicy,
                    *, block_m: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """DMA attention on validated SDPA-style inputs (see `dma_compile.ops`).

    block_m, block_n: the kernel's block sizes, powers of two from 16 that
    divide policy.tile (default: `default_block_sizes`). Raises Unsupported
    for calls the kernel cannot serve.
    """
    _check_supported(q, v, policy)
    b, hq, lq, d = q.shape
    k, v = collapse_expanded_heads(k, v)
    lk, dv = k.shape[2], v.shape[-1]
    default_m, default_n = default_block_sizes(policy.tile, max(d, dv))
    block_m, block_n = block_m or default_m, block_n or default_n
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        if size < CELL or size & (size - 1) or policy.tile % size:
            raise ValueError(
                f"{name} must be a power of two >= {CELL} that divides policy.tile={policy.tile}, got {size}"
            )
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)

    info = classify_mask(attn_mask, b, hq, lq, lk) if attn_mask is not None else None
    key_keep, key_limit = counted_key_arguments(info, is_causal, lq, lk, k.shape[1])
    stats = kv_statistics(k, v, key_mean=policy.smooth_k, value_scale=policy.pv == "fp8",
                          key_keep=key_keep, key_limit=key_limit)
    balance = (None, None)
    if policy.balance_qk and policy.uses_mx:
        balance = balance_factors(q, k, policy, is_causal, key_keep, key_limit, stats.key_mean)
    ops = _class_operands(q, k, stats.key_mean, policy, balance)
    if policy.pv == "fp8":
        v_op = quantize_values_fp8(v, stats.value_exponents, key_keep, key_limit)
        # Stored (B, H, Dv, L_pad): the keys are the contiguous dimension.
        v_strides = (v_op.stride(0), v_op.stride(1), v_op.stride(3), v_op.stride(2))
        v_scales = stats.value_scales
    else:
        v_op, v_strides, v_scales = v, v.stride(), v
    out = empty_output(b, hq, lq, dv, q.dtype, q.device)
    if info is None:
        mask_kind, mask, mask_strides, summary, summary_strides = MASK_NONE.value, out, (0,) * 4, out, (0,) * 3
    else:
        mask_kind = (MASK_BOOL if info.is_bool else MASK_ADDITIVE).value
        mask, mask_strides = info.values, info.values.stride()
        summary, summary_strides = info.summary, info.summary_strides
    args, constexprs = _launch_arguments(
        q, k, v_op, v_strides, v_scales, out, mask, mask_strides, summary, summary_strides, mask_kind,
        ops[policy.hi], ops[policy.lo], is_causal, scale, policy, block_m, block_n, key_keep, key_limit)
    grid = (cdiv(lq, block_m), b * hq)
    _dma_attention_sm100_kernel[grid](**args, **constexprs, num_warps=_num_warps(block_m), num_stages=2,
                                      **LAUNCH_OPTIONS)
    return out


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# The block-scaled tensor-core MMA in PTX: Triton 3.6 writes
# "...kind::mxf8f6f4.block_scale.scale_vec::1X", Triton 3.9 "...block_scale.block32".
BLOCK_SCALED_MMA = re.compile(r"tcgen05\.mma\.cta_group::[12]\.kind::(?:mxf8f6f4|mxf4nvf4|mxf4)\.block_scale[\w.:]*")


def _placeholder_operands(b, hq, hk, length, d, dtype, policy: AttentionPolicy) -> dict[str, _ClassOperands]:
    """Meta tensors shaped and typed like `_class_operands`' results."""
    def meta(*shape, dtype=torch.uint8):
        return torch.empty(*shape, dtype=dtype, device="meta")

    ops = {}
    for f in policy.formats:
        if f == "none":
            q, k = meta(b, hq, length, d, dtype=dtype), meta(b, hk, length, d, dtype=dtype)
            ops[f] = _ClassOperands(KIND_16BIT.value, "none", q, q, k, k)
        elif policy.mx_mode == "folded":
            ops[f] = _ClassOperands(KIND_FOLDED.value, "e4m3", meta(b, hq, length, d), meta(b, hq, length, dtype=torch.int32),
                                    meta(b, hk, length, d), meta(b, hk, length, dtype=torch.int32))
        else:
            width = d // 2 if f == "mxfp4_e2m1" else d
            ops[f] = _ClassOperands(KIND_MX.value, DOT_SCALED_FORMAT[f], meta(b, hq, length, width),
                                    meta(b, hq, length, d // 32), meta(b, hk, length, width),
                                    meta(b, hk, length, d // 32))
    return ops


def compile_sm100(policy: AttentionPolicy, *, dtype: str = "bfloat16", head_dim: int = 128, is_causal: bool = False,
                  mask: str | None = None, capability: int = 100, block_m: int | None = None,
                  block_n: int | None = None):
    """Compile the attention kernel for CUDA compute capability `capability`
    (100: B200, sm_100a) on any machine, GPU or not.

    Arguments are specialised as a launch on (1, 8, 4096, head_dim) queries
    and (1, 2, 4096, head_dim) keys and values would be; mask: None, "bool"
    or "additive" (broadcast over heads). Returns Triton's compiled kernel:
    `.asm` holds "ttgir", "ptx" and "cubin". Needs TRITON_INTERPRET unset.
    """
    from dma_compile.kernels.target_compile import compile_for_target

    torch_dtype = _DTYPES[dtype]
    b, hq, hk, length, d = 1, 8, 2, 4096, head_dim
    default_m, default_n = default_block_sizes(policy.tile, d)
    block_m, block_n = block_m or default_m, block_n or default_n

    def meta(*shape, dtype=torch_dtype):
        return torch.empty(*shape, dtype=dtype, device="meta")

    q, k, out = meta(b, hq, length, d), meta(b, hk, length, d), empty_output(b, hq, length, d, torch_dtype, "meta")
    if policy.pv == "fp8":
        v_op = meta(b, hk, d, length, dtype=torch.float8_e4m3fn)
        v_strides = (v_op.stride(0), v_op.stride(1), v_op.stride(3), v_op.stride(2))
        v_scales = meta(b, hk, d, dtype=torch.float32)
    else:
        v_op = meta(b, hk, length, d)
        v_strides, v_scales = v_op.stride(), v_op
    mask_kind = {None: MASK_NONE, "bool": MASK_BOOL, "additive": MASK_ADDITIVE}[mask].value
    if mask_kind:
        m = meta(b, 1, length, length, dtype=torch.uint8 if mask == "bool" else torch_dtype)
        mask_strides = m.expand(b, hq, length, length).stride()
        summary = meta(b, 1, length // CELL, 4, dtype=torch.int32)
        summary_strides = (summary.stride(0), 0, summary.stride(2))
    else:
        m, mask_strides, summary, summary_strides = out, (0,) * 4, out, (0,) * 3
    args, constexprs = _launch_arguments(
        q, k, v_op, v_strides, v_scales, out, m, mask_strides, summary, summary_strides, mask_kind,
        *(_placeholder_operands(b, hq, hk, length, d, torch_dtype, policy)[f] for f in (policy.hi, policy.lo)),
        is_causal, 1.0 / math.sqrt(d), policy, block_m, block_n)
    return compile_for_target(_dma_attention_sm100_kernel, {**args, **constexprs}, capability,
                              num_warps=_num_warps(block_m), num_stages=2)


def block_scaled_mma_instructions(ptx: str) -> dict[str, int]:
    """How often each block-scaled tcgen05.mma variant occurs in PTX text."""
    counts: dict[str, int] = {}
    for match in BLOCK_SCALED_MMA.finditer(ptx):
        counts[match.group(0)] = counts.get(match.group(0), 0) + 1
    return counts
