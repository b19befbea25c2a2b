"""The Q/K balancing factors of `AttentionPolicy.balance_qk`, for the kernels' quantization passes.

dma_compile.balancing defines the exponents (`balance_exponents`: integer
arithmetic on the floats' exponents, the same on every device); here they
are computed with torch on the call's device from the keys the kernels
count (`key_keep`, `key_limit`, as `quantize.kv_statistics` takes them) and
handed to the token passes as per-(batch, head) powers of two, which they
fold into the rotation's sign vector (`hadamard.transform_arguments`).
"""

from __future__ import annotations

import torch

from dma_compile.kernels import launch
from dma_compile.policy import AttentionPolicy
from dma_compile.balancing import balance_exponents, counted_queries
from dma_compile.reference import diagonal_offset, key_mean


def counted_from_arguments(
    key_keep: torch.Tensor | None, key_limit: int | None, b: int, hkv: int, lk: int, device
) -> torch.Tensor | None:
    """Bool (B, Hkv, Lk) of the keys that count, from the passes' arguments (None: all)."""
    counted = None if key_keep is None else (key_keep != 0).expand(b, hkv, lk)
    if key_limit is not None:
        below = (torch.arange(lk, device=device) < key_limit).expand(b, hkv, lk)
        counted = below if counted is None else counted & below
    return counted


def balance_factors(
    q: torch.Tensor,
    k: torch.Tensor,
    policy: AttentionPolicy,
    is_causal: bool,
    key_keep: torch.Tensor | None = None,
    key_limit: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q's factors (B, Hq, D), K's (B, Hkv, D)), float32 powers of two: Q's
    channels are multiplied by them, (smoothed) K's by theirs, the inverse.

    Torch operations, not recorded launches: a call that balances is never
    replayed from an earlier one's launches (`launch.forbid_replay`)."""
    launch.forbid_replay()
    b, hq, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    counted = counted_from_arguments(key_keep, key_limit, b, hkv, lk, q.device)
    kc = k.float()
    if policy.smooth_k:
        kc = kc - key_mean(k, counted)
    q_counted = counted_queries(counted, lq, lk, diagonal_offset(lq, lk, is_causal))
    exponents = balance_exponents(q, kc, counted, q_counted)
    factors = torch.ldexp(torch.ones((), device=q.device), exponents.float())[:, :, 0]
    return factors.repeat_interleave(hq // hkv, dim=1).contiguous(), (1.0 / factors).contiguous()
