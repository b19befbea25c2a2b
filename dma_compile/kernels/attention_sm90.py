"""DMA attention kernel for Hopper (sm_90): fused, online softmax, one launch.

Each program owns BLOCK_M query rows of one (batch, head) and walks the key
blocks that are not fully masked. Which blocks run in which precision comes
from the policy's precision tiles (docs/semantics.md): BLOCK_M and BLOCK_N
divide the tile, so a block never straddles two tiles, and the key blocks of
one class form at most two key ranges per query tile (sink + diagonal band in
the high format, the rest in the low one). Every class runs in four loops of
compile-time shape:

    low format  x {no masking, masking}, high format x {no masking, masking}

"masking" covers causal masking, the key tail and explicit masks; the mask is
read only for blocks its classification (kernels.masks) marks partial. QK^T
runs on bf16/fp16 tensor cores for "none" and exact MX (dequantized by the
quantization pass) and on fp8 tensor cores for folded MX, with one power of
two per query row and key column. Softmax is online in fp32 with exp2; P·V
runs in V's dtype or in FP8 (e4m3(P * 256) against e4m3 V^T with a
per-channel scale).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dma_compile.kernels import Unsupported
from dma_compile.kernels.masks import CELL, classify_mask
from dma_compile.kernels.quantize import (
    HW_CVT,
    INTERPRET,
    Operand,
    _pow2,
    _to_dtype,
    _to_f32,
    _to_e4m3,
    kv_statistics,
    quantize_tokens,
    quantize_values_fp8,
)
from dma_compile.kernels.schedule import (
    block_counts,
    block_start,
    collapse_expanded_heads,
    key_range,
    precision_band,
    split_by_masking,
)
from dma_compile.policy import AttentionPolicy

HEAD_DIMS = (32, 64, 128, 256)
LOG2E = 1.4426950408889634
# Autotuning compiles and times every config once per shape bucket;
# DMA_AUTOTUNE=0 takes each head_dim's first config instead.
AUTOTUNE = os.environ.get("DMA_AUTOTUNE", "1") != "0"

KIND_16BIT = 0  # "none" and exact MX: bf16/fp16 tensor cores
KIND_FP8 = 1  # folded MX: e4m3 tensor cores, per-row and per-column powers of two
MASK_NONE, MASK_BOOL, MASK_ADD = 0, 1, 2


@triton.jit
def _dot_nt(a, b, HW_CVT: tl.constexpr):
    """a @ b^T in fp32 (the interpreter multiplies bf16 wrongly: it goes through fp32)."""
    if HW_CVT:
        r = tl.dot(a, tl.trans(b))
    else:
        r = tl.dot(_to_f32(a, HW_CVT), tl.trans(_to_f32(b, HW_CVT)))
    return r


@triton.jit
def _dot_acc(a, b, acc, HW_CVT: tl.constexpr):
    if HW_CVT:
        r = tl.dot(a, b, acc)
    else:
        r = tl.dot(_to_f32(a, HW_CVT), _to_f32(b, HW_CVT), acc)
    return r


@triton.jit
def _row_scales(QA, rows, row_ok, sm_scale, KIND: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per-row factor of the scores: softmax scale * log2(e), times 2^A for folded Q."""
    if KIND == 1:
        qa = tl.load(QA + rows, mask=row_ok, other=0)
        r = _pow2(tl.minimum(tl.maximum(qa, -126), 127)) * sm_scale
    else:
        r = tl.full([BLOCK_M], 1.0, tl.float32) * sm_scale
    return r


@triton.jit
def _attend(
    acc, l_i, m_i, q, q_scale,
    K, KA, sk_n, sk_d, V, sv_n, sv_d, MASK, sm_m, sm_n,
    offs_m, Lq, Lk,
    r0s, r0e, r1s, r1e, r2s, r2e, r3s, r3e,
    KIND: tl.constexpr, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr,
    PV_FP8: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    HW_CVT: tl.constexpr,
):
    """Online-softmax update over the key blocks of up to four [start, end) key ranges."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_dv = tl.arange(0, HEAD_DIM_V)
    arange_n = tl.arange(0, BLOCK_N)
    n0c, n1c, n2c, n3c = block_counts(r0s, r0e, r1s, r1e, r2s, r2e, r3s, r3e, BLOCK_N)
    row_ok = offs_m < Lq
    for i in range(0, n0c + n1c + n2c + n3c):
        offs_n = block_start(i, n0c, n1c, n2c, r0s, r1s, r2s, r3s, BLOCK_N) + arange_n
        if MASKED:
            key_ok = offs_n < Lk
            k = tl.load(K + offs_n[:, None] * sk_n + offs_d[None, :] * sk_d, mask=key_ok[:, None], other=0.0)
        else:
            k = tl.load(K + offs_n[:, None] * sk_n + offs_d[None, :] * sk_d)
        qk = _dot_nt(q, k, HW_CVT)
        if KIND == 1:
            if MASKED:
                ka = tl.load(KA + offs_n, mask=key_ok, other=0)
            else:
                ka = tl.load(KA + offs_n)
            qk = qk * _pow2(tl.minimum(tl.maximum(ka, -126), 127))[None, :]
        if MASKED:
            s = qk * q_scale[:, None]
            valid = key_ok[None, :]
            if IS_CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None])
            if MASK_KIND != 0:
                mptr = MASK + offs_m[:, None].to(tl.int64) * sm_m + offs_n[None, :] * sm_n
                mok = row_ok[:, None] & key_ok[None, :]
                if MASK_KIND == 1:
                    valid = valid & (tl.load(mptr, mask=mok, other=0) != 0)
                else:
                    s = s + _to_f32(tl.load(mptr, mask=mok, other=0.0), HW_CVT) * 1.4426950408889634
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # Rows with every key so far masked keep m = -inf; subtract 0 there.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - m_use[:, None])
            alpha = tl.math.exp2(m_i - m_use)
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * q_scale)
            p = tl.math.exp2(qk * q_scale[:, None] - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if PV_FP8:
            if MASKED:
                vt = tl.load(V + offs_dv[:, None] * sv_d + offs_n[None, :] * sv_n, mask=key_ok[None, :], other=0.0)
            else:
                vt = tl.load(V + offs_dv[:, None] * sv_d + offs_n[None, :] * sv_n)
            acc = tl.dot(_to_e4m3(p * 256.0, HW_CVT), tl.trans(vt), acc)
        else:
            if MASKED:
                v = tl.load(V + offs_n[:, None] * sv_n + offs_dv[None, :] * sv_d, mask=key_ok[:, None], other=0.0)
            else:
                v = tl.load(V + offs_n[:, None] * sv_n + offs_dv[None, :] * sv_d)
            acc = _dot_acc(_to_dtype(p, V.dtype.element_ty, HW_CVT), v, acc, HW_CVT)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _dma_attention_kernel(
    Q_HI, QA_HI, sqh_b, sqh_h, sqh_m, sqh_d,
    K_HI, KA_HI, skh_b, skh_h, skh_n, skh_d,
    Q_LO, QA_LO, sql_b, sql_h, sql_m, sql_d,
    K_LO, KA_LO, skl_b, skl_h, skl_n, skl_d,
    V, sv_b, sv_h, sv_n, sv_d, VSCALE,
    O, so_b, so_h, so_m, so_d,
    MASK, sm_b, sm_h, sm_m, sm_n,
    SUMM, ss_b, ss_h, ss_r,
    sm_scale, Hq, Hk, Lq, Lk, SINK_TILES, DIAG_TILES,
    LQ_BUCKET, LK_BUCKET,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, TILE: tl.constexpr,
    HI_KIND: tl.constexpr, LO_KIND: tl.constexpr, ONE_CLASS: tl.constexpr,
    PV_FP8: tl.constexpr, IS_CAUSAL: tl.constexpr, MASK_KIND: tl.constexpr, CELL: tl.constexpr,
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
        m0, Lq, Lk, SUMM + b64 * ss_b + h.to(tl.int64) * ss_h, ss_r, IS_CAUSAL, MASK_KIND != 0, CELL, BLOCK_M, BLOCK_N
    )
    sink_end, band_s, band_e = precision_band(m0, Lq, Lk, SINK_TILES, DIAG_TILES, TILE, IS_CAUSAL, ONE_CLASS)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_V], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    v_base = V + b64 * sv_b + hk.to(tl.int64) * sv_h
    mask_base = MASK + b64 * sm_b + h.to(tl.int64) * sm_h

    # Low format: [sink_end, band_s) and [band_e, kv_end).
    a0, a1, b0, b1, c0, c1, d0, d1, e0, e1, f0, f1 = split_by_masking(
        sink_end, band_s, band_e, kv_end, kv_start, kv_end, u_lo, u_hi
    )
    q = tl.load(Q_LO + b64 * sql_b + h.to(tl.int64) * sql_h + offs_m[:, None] * sql_m + offs_d[None, :] * sql_d,
                mask=row_ok[:, None], other=0.0)
    q_scale = _row_scales(QA_LO + pid_bh.to(tl.int64) * Lq, offs_m, row_ok, sm_scale, LO_KIND, BLOCK_M)
    k_base = K_LO + b64 * skl_b + hk.to(tl.int64) * skl_h
    ka_base = KA_LO + (b64 * Hk + hk) * Lk
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q, q_scale, k_base, ka_base, skl_n, skl_d, v_base, sv_n, sv_d, mask_base, sm_m, sm_n,
        offs_m, Lq, Lk, a0, a1, b0, b1, 0, 0, 0, 0,
        LO_KIND, False, IS_CAUSAL, MASK_KIND, PV_FP8, BLOCK_N, HEAD_DIM, HEAD_DIM_V, HW_CVT)
    acc, l_i, m_i = _attend(
        acc, l_i, m_i, q, q_scale, k_base, ka_base, skl_n, skl_d, v_base, sv_n, sv_d, mask_base, sm_m, sm_n,
        offs_m, Lq, Lk, c0, c1, d0, d1, e0, e1, f0, f1,
        LO_KIND, True, IS_CAUSAL, MASK_KIND, PV_FP8, BLOCK_N, HEAD_DIM, HEAD_DIM_V, HW_CVT)

    if not ONE_CLASS:
        # High format: [0, sink_end) and [band_s, band_e).
        a0, a1, b0, b1, c0, c1, d0, d1, e0, e1, f0, f1 = split_by_masking(
            0, sink_end, band_s, band_e, kv_start, kv_end, u_lo, u_hi
        )
        q = tl.load(Q_HI + b64 * sqh_b + h.to(tl.int64) * sqh_h + offs_m[:, None] * sqh_m + offs_d[None, :] * sqh_d,
                    mask=row_ok[:, None], other=0.0)
        q_scale = _row_scales(QA_HI + pid_bh.to(tl.int64) * Lq, offs_m, row_ok, sm_scale, HI_KIND, BLOCK_M)
        k_base = K_HI + b64 * skh_b + hk.to(tl.int64) * skh_h
        ka_base = KA_HI + (b64 * Hk + hk) * Lk
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, q_scale, k_base, ka_base, skh_n, skh_d, v_base, sv_n, sv_d, mask_base, sm_m, sm_n,
            offs_m, Lq, Lk, a0, a1, b0, b1, 0, 0, 0, 0,
            HI_KIND, False, IS_CAUSAL, MASK_KIND, PV_FP8, BLOCK_N, HEAD_DIM, HEAD_DIM_V, HW_CVT)
        acc, l_i, m_i = _attend(
            acc, l_i, m_i, q, q_scale, k_base, ka_base, skh_n, skh_d, v_base, sv_n, sv_d, mask_base, sm_m, sm_n,
            offs_m, Lq, Lk, c0, c1, d0, d1, e0, e1, f0, f1,
            HI_KIND, True, IS_CAUSAL, MASK_KIND, PV_FP8, BLOCK_N, HEAD_DIM, HEAD_DIM_V, HW_CVT)

    offs_dv = tl.arange(0, HEAD_DIM_V)
    if PV_FP8:
        v_scale = tl.load(VSCALE + (b64 * Hk + hk) * HEAD_DIM_V + offs_dv)
        acc = acc * (v_scale * (1.0 / 256.0))[None, :]
    # A row with every key masked has l = 0 and outputs zeros, as SDPA.
    empty = l_i == 0.0
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
    o_ptr = O + b64 * so_b + h.to(tl.int64) * so_h + offs_m[:, None] * so_m + offs_dv[None, :] * so_d
    tl.store(o_ptr, _to_dtype(out, O.dtype.element_ty, HW_CVT), mask=row_ok[:, None])


def _config(bm, bn, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages)


# Per head_dim (the larger of D and Dv), best first; (32, 32) serves 32-token tiles.
_CONFIGS = {
    64: [_config(128, 128, 8, 3), _config(128, 64, 4, 3)],
    128: [_config(128, 64, 8, 3), _config(128, 128, 8, 3)],
    256: [_config(64, 64, 8, 2), _config(64, 32, 4, 2)],
}
_SMALL_TILE = [_config(32, 32, 4, 3)]


def _configs_for(head_dim: int, tile: int) -> list[triton.Config]:
    configs = _CONFIGS[max(64, head_dim)]
    fitting = [c for c in configs if tile % c.kwargs["BLOCK_M"] == 0 and tile % c.kwargs["BLOCK_N"] == 0]
    return fitting or _SMALL_TILE


def _prune(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    wanted = _configs_for(max(args["HEAD_DIM"], args["HEAD_DIM_V"]), args["TILE"])
    keys = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in wanted}
    return [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in keys]


_ALL_CONFIGS = [c for cs in _CONFIGS.values() for c in cs] + _SMALL_TILE
_dma_attention_tuned = triton.autotune(
    _ALL_CONFIGS,
    key=["HEAD_DIM", "HEAD_DIM_V", "TILE", "HI_KIND", "LO_KIND", "ONE_CLASS", "PV_FP8", "IS_CAUSAL", "MASK_KIND",
         "LQ_BUCKET", "LK_BUCKET"],
    prune_configs_by={"early_config_prune": _prune},
)(_dma_attention_kernel)

# Block sizes under the interpreter: small, and smaller than the tests' 32-token tile.
_INTERPRET_META = {"BLOCK_M": 16, "BLOCK_N": 16}


def _kind(fmt: str, policy: AttentionPolicy) -> int:
    return KIND_FP8 if fmt != "none" and policy.mx_mode == "folded" else KIND_16BIT


def _check(q, v, scale, policy: AttentionPolicy) -> None:
    if q.device.type != "cuda" and not INTERPRET:
        raise Unsupported(
            f"the sm90 kernel needs CUDA tensors, got {q.device.type} (TRITON_INTERPRET=1 runs it on CPU for testing)"
        )
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise Unsupported(f"the sm90 kernel takes bfloat16 or float16 inputs, got {q.dtype}")
    for name, dim in (("q, k", q.shape[-1]), ("v", v.shape[-1])):
        if dim not in HEAD_DIMS:
            raise Unsupported(f"{name}: the sm90 kernel supports head_dim in {list(HEAD_DIMS)}, got {dim}")
    if scale <= 0:
        raise Unsupported(f"scale: the sm90 kernel needs a positive softmax scale, got {scale}")
    uses_fp8 = policy.pv == "fp8" or any(_kind(f, policy) == KIND_FP8 for f in policy.formats)
    if q.device.type == "cuda" and uses_fp8 and torch.cuda.get_device_capability(q.device) < (8, 9):
        raise Unsupported("fp8 tensor cores (folded MX or pv='fp8') need compute capability 8.9 or newer")


def _class_operands(q, k, policy: AttentionPolicy, key_mean) -> dict[str, tuple[Operand, Operand]]:
    """(Q, K) operands of each format the policy uses, from one quantization pass each."""
    mx_formats = tuple(f for f in policy.formats if f != "none")
    want_none = "none" in policy.formats
    q_ops = quantize_tokens(q, mx_formats, policy.mx_mode, policy.scale_rule)
    k_ops = quantize_tokens(
        k, mx_formats, policy.mx_mode, policy.scale_rule, mean=key_mean, write_none=want_none and key_mean is not None
    )
    if want_none:
        q_ops["none"] = Operand(q)
        k_ops.setdefault("none", Operand(k))
    return {f: (q_ops[f], k_ops[f]) for f in policy.formats}


@dataclass
class QuantizedInputs:
    """What the quantization pass produces for one call: the (Q, K) operands of
    the high and low formats, V (or e4m3 V^T) with its per-channel scales."""

    q_hi: Operand
    k_hi: Operand
    q_lo: Operand
    k_lo: Operand
    v: torch.Tensor
    v_strides: tuple[int, int, int, int]  # batch, head, key, channel
    v_scales: torch.Tensor | None
    out_dtype: torch.dtype


def quantize_inputs(q, k, v, policy: AttentionPolicy) -> QuantizedInputs:
    """The quantization pass: K statistics, then Q, K (and V) in the kernel's layouts.

    k and v must already have their stride-0 heads collapsed (`schedule.collapse_expanded_heads`).
    """
    stats = kv_statistics(k, v, key_mean=policy.smooth_k, value_scale=policy.pv == "fp8")
    ops = _class_operands(q, k, policy, stats.key_mean)
    (q_hi, k_hi), (q_lo, k_lo) = ops[policy.hi], ops[policy.lo]
    if policy.pv == "fp8":
        vt = quantize_values_fp8(v, stats.value_exponents)
        return QuantizedInputs(q_hi, k_hi, q_lo, k_lo, vt, (vt.stride(0), vt.stride(1), vt.stride(3), vt.stride(2)),
                               stats.value_scales, q.dtype)
    return QuantizedInputs(q_hi, k_hi, q_lo, k_lo, v, tuple(v.stride()), None, q.dtype)


def attention_from_quantized(
    qi: QuantizedInputs, shape: tuple[int, int, int, int, int, int, int], attn_mask, is_causal: bool, scale: float,
    policy: AttentionPolicy, config: triton.Config | None = None,
) -> torch.Tensor:
    """The attention kernel alone. shape: (B, Hq, Hkv, Lq, Lk, D, Dv)."""
    b, hq, hk, lq, lk, d, dv = shape
    ref = qi.q_lo.values
    out = torch.empty(b, hq, lq, dv, dtype=qi.out_dtype, device=ref.device)
    if attn_mask is None:
        mask_kind = MASK_NONE
        mask_args = (ref, 0, 0, 0, 0, ref, 0, 0, 0)
    else:
        info = classify_mask(attn_mask, b, hq, lq, lk)
        mask_kind = MASK_BOOL if info.is_bool else MASK_ADD
        mask_args = (info.values, *info.values.stride(), info.summary, *info.summary_strides)

    def operand_args(op: Operand):
        x = op.values
        return (x, op.exponents if op.exponents is not None else x, *x.stride())

    args = (
        *operand_args(qi.q_hi), *operand_args(qi.k_hi), *operand_args(qi.q_lo), *operand_args(qi.k_lo),
        qi.v, *qi.v_strides, qi.v_scales if qi.v_scales is not None else qi.v,
        out, *out.stride(), *mask_args,
        scale * LOG2E, hq, hk, lq, lk, policy.sink_tiles, policy.diag_tiles,
        triton.next_power_of_2(lq), triton.next_power_of_2(lk),
    )
    meta = dict(
        HEAD_DIM=d, HEAD_DIM_V=dv, TILE=policy.tile,
        HI_KIND=_kind(policy.hi, policy), LO_KIND=_kind(policy.lo, policy), ONE_CLASS=policy.hi == policy.lo,
        PV_FP8=policy.pv == "fp8", IS_CAUSAL=bool(is_causal), MASK_KIND=mask_kind, CELL=CELL, HW_CVT=HW_CVT,
    )
    if INTERPRET:
        grid = (triton.cdiv(lq, _INTERPRET_META["BLOCK_M"]), b * hq)
        _dma_attention_kernel[grid](*args, **meta, **_INTERPRET_META)
        return out
    grid = lambda m: (triton.cdiv(lq, m["BLOCK_M"]), b * hq)  # noqa: E731
    if AUTOTUNE and config is None:
        _dma_attention_tuned[grid](*args, **meta)
    else:
        config = config or _configs_for(max(d, dv), policy.tile)[0]
        _dma_attention_kernel[grid](
            *args, **meta, **config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages
        )
    return out


def attention_sm90(
    q, k, v, attn_mask, is_causal: bool, scale: float | None, policy: AttentionPolicy,
    config: triton.Config | None = None,
) -> torch.Tensor:
    """DMA attention on validated SDPA-style inputs (see ops.dma_attention).

    config: run this block configuration instead of the autotuned one (tests).
    """
    b, hq, lq, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    _check(q, v, scale, policy)
    k, v = collapse_expanded_heads(k, v)
    shape = (b, hq, k.shape[1], lq, k.shape[2], d, v.shape[-1])
    return attention_from_quantized(quantize_inputs(q, k, v, policy), shape, attn_mask, is_causal, scale, policy, config)
