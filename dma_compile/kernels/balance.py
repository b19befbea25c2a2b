"""The Q/K balancing factors of `AttentionPolicy.balance_qk`, for the kernels' quantization passes.

dma_compile.balancing defines the exponents (`balance_exponents`: integer
arithmetic on the floats' exponents, the same on every device); here the
same exponents come from reductions on the call's device over the
keys the kernels count (`key_keep`, `key_limit`, as `quantize.kv_statistics`
takes them), and are handed to the token passes as per-(batch, head) powers
of two, which they fold into the rotation's sign vector
(`hadamard.transform_arguments`).

The channel maxima come from one Triton reduction per tensor
(`channel_extremes`: many programs per head, each over a chunk of rows,
accumulating element-wise in registers; their partial results are a few
values per channel, combined by torch), reading Q and K once in their own
dtype: |Q|'s maxima per query head, then over each KV head's group;
smoothed K's from K's finite extremes and the statistics' mean,
max|k - m| = max(k_max - m, m - k_min), which float32 rounds exactly as the
reference's element-wise |k - m| (rounding is monotonic).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dma_compile.balancing import counted_queries, exponents_from_maxima
from dma_compile.kernels import launch
from dma_compile.kernels.numerics import HW_CVT, to_f32
from dma_compile.policy import AttentionPolicy
from dma_compile.reference import diagonal_offset

# Rows per program of `channel_extremes` (a multiple of BLOCK_ROWS), and per loop step.
CHUNK_ROWS = 1024
BLOCK_ROWS = 32


@triton.jit
def _channel_extremes_kernel(
    X, sx_b, sx_h, sx_l, sx_d, ROWS, sr_b, sr_h, H, GROUP, L, CHUNK, N_CHUNKS, TOP, BOTTOM,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_L: tl.constexpr,
    ABSOLUTE: tl.constexpr, HAS_ROWS: tl.constexpr, HW_CVT: tl.constexpr,
):
    """Chunk program_id(0) of the rows of (batch, head) program_id(1): per
    channel, over the finite values of the rows that ROWS (at head // GROUP)
    keeps, the max of |x| (ABSOLUTE; 0 where none) or the max and the min
    of x (-inf and +inf where none). Element-wise in registers in the loop,
    one cross-thread reduction after it."""
    pid_c = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    top = tl.full([BLOCK_L, D_PAD], 0.0 if ABSOLUTE else float("-inf"), tl.float32)
    bottom = tl.full([BLOCK_L, D_PAD], float("inf"), tl.float32)
    src = X + b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h
    start = pid_c * CHUNK
    for l0 in range(start, tl.minimum(start + CHUNK, L), BLOCK_L):
        r = l0 + tl.arange(0, BLOCK_L)
        ok = r < L
        if HAS_ROWS:
            kept = tl.load(ROWS + b.to(tl.int64) * sr_b + (h // GROUP).to(tl.int64) * sr_h + r, mask=ok, other=0)
            ok = ok & (kept != 0)
        ok2 = ok[:, None] & d_ok[None, :]
        x = to_f32(tl.load(src + r[:, None].to(tl.int64) * sx_l + d[None, :] * sx_d, mask=ok2, other=0.0), HW_CVT)
        use = ok2 & (tl.abs(x) < float("inf"))
        if ABSOLUTE:
            top = tl.maximum(top, tl.where(use, tl.abs(x), 0.0))
        else:
            top = tl.maximum(top, tl.where(use, x, float("-inf")))
            bottom = tl.minimum(bottom, tl.where(use, x, float("inf")))
    out = (pid_bh * N_CHUNKS + pid_c) * D + d
    tl.store(TOP + out, tl.max(top, axis=0), mask=d_ok)
    if not ABSOLUTE:
        tl.store(BOTTOM + out, tl.min(bottom, axis=0), mask=d_ok)


def channel_extremes(x: torch.Tensor, rows: torch.Tensor | None = None, absolute: bool = False,
                     chunk: int = CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per (batch, head, channel) of x (B, H, R, D), over dim -2, the finite
    values of the rows that `rows` (B, Hr, R) keeps (Hr dividing H: head h
    reads rows[:, h // (H // Hr)]; None: every row): the max of |x|
    (absolute; 0 where none), or the max and the min of x (-inf / +inf
    where none), float32 (B, H, D); the min is None when absolute."""
    b, h, length, d = x.shape
    if chunk % BLOCK_ROWS:
        raise ValueError(f"chunk must be a multiple of {BLOCK_ROWS}, got {chunk}")
    n_chunks = max(1, launch.cdiv(length, chunk))
    top = torch.empty(b * h, n_chunks, d, dtype=torch.float32, device=x.device)
    bottom = top if absolute else torch.empty_like(top)
    if rows is not None:
        rows = rows.to(torch.uint8)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
    placeholder = rows if rows is not None else top
    launch.launch(_channel_extremes_kernel, (n_chunks, b * h),
           x, x.stride(0), x.stride(1), x.stride(2), x.stride(3),
           placeholder, placeholder.stride(0) if rows is not None else 0,
           placeholder.stride(1) if rows is not None else 0,
           h, h // (rows.shape[1] if rows is not None else h), length, chunk, n_chunks, top, bottom,
           D=d, D_PAD=launch.next_power_of_2(d), BLOCK_L=BLOCK_ROWS, ABSOLUTE=absolute, HAS_ROWS=rows is not None,
           HW_CVT=HW_CVT, num_warps=4)
    top = top.amax(dim=1).view(b, h, d)
    return top, None if absolute else bottom.amin(dim=1).view(b, h, d)


def counted_from_arguments(
    key_keep: torch.Tensor | None, key_limit: int | None, b: int, hkv: int, lk: int, device
) -> torch.Tensor | None:
    """Bool (B, Hkv, Lk) of the keys that count, from the passes' arguments (None: all)."""
    counted = None if key_keep is None else (key_keep != 0).expand(b, hkv, lk)
    if key_limit is not None:
        below = (torch.arange(lk, device=device) < key_limit).expand(b, hkv, lk)
        counted = below if counted is None else counted & below
    return counted


def _query_maxima(q: torch.Tensor, q_counted: torch.Tensor | None, hkv: int) -> torch.Tensor:
    """max |q| per (batch, KV head, channel) over the finite values of the
    counted query rows of every query head of the KV head, float32 (B, Hkv, 1, D)."""
    b, hq, _, d = q.shape
    per_head, _ = channel_extremes(q, q_counted, absolute=True)
    return per_head.view(b, hkv, hq // hkv, d).amax(dim=2, keepdim=True)


def _key_maxima(k: torch.Tensor, counted: torch.Tensor | None, mean: torch.Tensor | None) -> torch.Tensor:
    """max |k - mean| (mean: None for 0) per (batch, KV head, channel) over
    the finite values of the counted keys, float32 (B, Hkv, 1, D); -inf where none."""
    top, bottom = (t.unsqueeze(-2) for t in channel_extremes(k, counted))
    if mean is not None:
        m = mean.unsqueeze(-2)
        return torch.maximum(top - m, m - bottom)
    return torch.maximum(top, -bottom)


def balance_factors(
    q: torch.Tensor,
    k: torch.Tensor,
    policy: AttentionPolicy,
    is_causal: bool,
    key_keep: torch.Tensor | None = None,
    key_limit: int | None = None,
    key_mean: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q's factors (B, Hq, D), K's (B, Hkv, D)), float32 powers of two: Q's
    channels are multiplied by them, (smoothed) K's by theirs, the inverse.
    key_mean: K's mean (B, Hkv, D) from the statistics launch, which a
    smoothing policy needs (`quantize.kv_statistics`, equal to `reference.key_mean`).

    Torch operations combine the reductions' results, so a call that
    balances is never replayed from an earlier one's launches (`launch.forbid_replay`)."""
    if policy.smooth_k and key_mean is None:
        raise ValueError("balance_factors: a policy that smooths K needs key_mean")
    launch.forbid_replay()
    b, hq, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    counted = counted_from_arguments(key_keep, key_limit, b, hkv, lk, q.device)
    q_counted = counted_queries(counted, lq, lk, diagonal_offset(lq, lk, is_causal))
    a_q = _query_maxima(q, q_counted, hkv)
    a_k = _key_maxima(k, counted, key_mean if policy.smooth_k else None)
    factors = torch.ldexp(torch.ones((), device=q.device), exponents_from_maxima(a_q, a_k).float())[:, :, 0]
    return factors.repeat_interleave(hq // hkv, dim=1).contiguous(), (1.0 / factors).contiguous()
