"""The Q/K balancing factors of `AttentionPolicy.balance_qk`, for the kernels' quantization passes.

dma_compile.balancing defines the exponents (`balance_exponents`: integer
arithmetic on the floats' exponents, the same on every device); here the
same exponents come from torch reductions on the call's device over the
keys the kernels count (`key_keep`, `key_limit`, as `quantize.kv_statistics`
takes them), and are handed to the token passes as per-(batch, head) powers
of two, which they fold into the rotation's sign vector
(`hadamard.transform_arguments`).

The reductions read Q and K in their own dtype and never materialise
float32 copies: |Q|'s channel maxima per query head, then over each KV
head's group; smoothed K's from K's finite extremes and the statistics'
mean, max|k - m| = max(k_max - m, m - k_min), which float32 rounds exactly
as the reference's element-wise |k - m| (rounding is monotonic).
"""

from __future__ import annotations

import torch

from dma_compile.balancing import counted_queries, exponents_from_maxima
from dma_compile.kernels import launch
from dma_compile.policy import AttentionPolicy
from dma_compile.reference import diagonal_offset


def counted_from_arguments(
    key_keep: torch.Tensor | None, key_limit: int | None, b: int, hkv: int, lk: int, device
) -> torch.Tensor | None:
    """Bool (B, Hkv, Lk) of the keys that count, from the passes' arguments (None: all)."""
    counted = None if key_keep is None else (key_keep != 0).expand(b, hkv, lk)
    if key_limit is not None:
        below = (torch.arange(lk, device=device) < key_limit).expand(b, hkv, lk)
        counted = below if counted is None else counted & below
    return counted


def _channel_extreme(x: torch.Tensor, rows: torch.Tensor | None, largest: bool) -> torch.Tensor:
    """The per-channel max (or min) over dim -2 of x (B, H, R, D), over the
    finite values of the rows `rows` (B, H, R) keeps; -inf (+inf) where none."""
    fill = float("-inf") if largest else float("inf")
    x = torch.nan_to_num(x, nan=fill, posinf=fill, neginf=fill)
    if rows is not None:
        x.masked_fill_(~rows[..., None], fill)
    return x.amax(dim=-2, keepdim=True) if largest else x.amin(dim=-2, keepdim=True)


def _query_maxima(q: torch.Tensor, q_counted: torch.Tensor | None, hkv: int) -> torch.Tensor:
    """max |q| per (batch, KV head, channel) over the finite values of the
    counted query rows of every query head of the KV head, float32 (B, Hkv, 1, D)."""
    b, hq, _, d = q.shape
    magnitude = torch.nan_to_num(q.abs(), nan=0.0, posinf=0.0)
    if q_counted is not None:
        magnitude.masked_fill_(~q_counted.repeat_interleave(hq // hkv, dim=1)[..., None], 0.0)
    per_head = magnitude.amax(dim=-2)
    return per_head.view(b, hkv, hq // hkv, d).amax(dim=2, keepdim=True).float()


def _key_maxima(k: torch.Tensor, counted: torch.Tensor | None, mean: torch.Tensor | None) -> torch.Tensor:
    """max |k - mean| (mean: None for 0) per (batch, KV head, channel) over
    the finite values of the counted keys, float32 (B, Hkv, 1, D); -inf where none."""
    top = _channel_extreme(k, counted, largest=True).float()
    bottom = _channel_extreme(k, counted, largest=False).float()
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

    Torch operations, not recorded launches: a call that balances is never
    replayed from an earlier one's launches (`launch.forbid_replay`)."""
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
