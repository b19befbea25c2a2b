"""Balancing Q and K per channel before MX quantization (`AttentionPolicy.balance_qk`).

A channel where K is large and Q small (or the reverse) spends one operand's
MX range on values the other makes small. Multiplying Q's channel j and
dividing K's by the same 2^e[j] leaves every score unchanged,
(Q 2^e)(K 2^-e)^T = Q K^T, and lets both channel ranges meet halfway, as
SmoothQuant balances activations against weights. Powers of two keep the
scaling exact; the exponents come from integer arithmetic on the floats'
exponents, the same on every device, so the reference and the kernels'
passes quantize identical values. The statistics leave out what the mask
leaves out (pad keys and their queries): a sequence's outputs do not depend
on its padding.
"""

from __future__ import annotations

import torch

# Balance exponents stay within this many binades: far beyond any real model's
# channel ratios, and ldexp by them cannot overflow a value that was finite.
MAX_BALANCE_EXPONENT = 64


def counted_queries(counted: torch.Tensor | None, lq: int, lk: int, offset: int) -> torch.Tensor | None:
    """Bool (B, Hkv, Lq): the query rows whose diagonal key position (row +
    offset, `reference.diagonal_offset`) is a counted key (counted: (B, Hkv,
    Lk), `reference.counted_keys`), so a pad token's query counts exactly
    when its key does; None when every key counts."""
    if counted is None:
        return None
    pos = torch.arange(lq, device=counted.device) + offset
    inside = (pos >= 0) & (pos < lk)
    return counted[:, :, pos.clamp(0, lk - 1)] & inside


def _channel_amax(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """Per-channel max |x| over dim -2 of x (B, H, R, D), finite values of the
    rows kept by `rows` (B, H, R) only."""
    use = torch.isfinite(x) if rows is None else torch.isfinite(x) & rows[..., None]
    return torch.where(use, x.abs(), 0.0).amax(dim=-2, keepdim=True)


def _floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) of positive a, exactly (from the float's exponent)."""
    return torch.frexp(a)[1] - 1


def balance_exponents(
    qc: torch.Tensor, kc: torch.Tensor, counted: torch.Tensor | None, q_counted: torch.Tensor | None
) -> torch.Tensor:
    """Int32 (B, Hkv, 1, D) exponents e of `AttentionPolicy.balance_qk`: Q's
    channel j is multiplied, (smoothed) K's divided, by 2^e[j].

    e = floor((floor(log2 amax_K) - floor(log2 amax_Q) + 1) / 2): the two
    channel ranges meet halfway, rounded to a power of two so that scaling
    is exact. amax_K over the finite values of the counted keys, amax_Q over
    those of the counted query rows (`counted_queries`) of every query head
    of the KV head; 0 where either has none. Integer arithmetic on the
    floats' exponents: the same on every device."""
    b, hq, lq, d = qc.shape
    hkv = kc.shape[1]
    q_rows = qc.reshape(b, hkv, (hq // hkv) * lq, d)
    rows = None if q_counted is None else q_counted.repeat(1, 1, hq // hkv)
    # Maxima of 16-bit values are exact in float32, which frexp takes.
    return exponents_from_maxima(_channel_amax(q_rows, rows).float(), _channel_amax(kc, counted).float())


def exponents_from_maxima(a_q: torch.Tensor, a_k: torch.Tensor) -> torch.Tensor:
    """`balance_exponents` from the channel maxima of |Q| and |K| (float32,
    (B, Hkv, 1, D)); 0 where either is not positive."""
    e = torch.div(_floor_log2(a_k) - _floor_log2(a_q) + 1, 2, rounding_mode="floor")
    e = torch.where((a_q > 0) & (a_k > 0), e, 0)
    return e.clamp(-MAX_BALANCE_EXPONENT, MAX_BALANCE_EXPONENT).to(torch.int32)


def balanced_operands(
    qc: torch.Tensor, kc: torch.Tensor, exponents: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Q times and K divided by 2^exponents (`balance_exponents`), exactly."""
    group = qc.shape[1] // kc.shape[1]
    e = exponents.to(qc.dtype)
    return torch.ldexp(qc, e.repeat_interleave(group, dim=1)), torch.ldexp(kc, -e)
