"""Reference DMA attention: the exact math of the method in plain PyTorch.

This module defines the semantics (docs/semantics.md) that every kernel is
tested against. It materialises the whole score matrix, so it is meant for
tests, calibration and CPU runs, not for speed. With both formats "none" it is
exact attention. `decode_attention_reference` defines decode through a
quantized KV cache (dma_compile.cache_formats).
"""

from __future__ import annotations

import math

import torch

from dma_compile import cache_formats
from dma_compile.balancing import balance_exponents, balanced_operands, counted_queries
from dma_compile.formats import E4M3, fake_quantize, rceil_exponent, round_to_element
from dma_compile.policy import AttentionPolicy
from dma_compile.rotation import rotate

# P is multiplied by 2^8 before its e4m3 cast so that it uses e4m3's normal
# range ([2^-6, 448]) instead of flushing small probabilities to zero.
P_FP8_SCALE = 256.0


def diagonal_offset(lq: int, lk: int, is_causal: bool) -> int:
    """Key position of query 0's diagonal: top-left for is_causal (as SDPA),
    bottom-right otherwise (KV-cache prefill and decode)."""
    return 0 if is_causal else lk - lq


def diagonal_band(q_tile: int, lq: int, lk: int, tile: int, diag_tiles: int, is_causal: bool) -> tuple[int, int]:
    """First and last key tile of query tile `q_tile`'s diagonal band."""
    offset = diagonal_offset(lq, lk, is_causal)
    first_row = q_tile * tile
    last_row = min((q_tile + 1) * tile, lq) - 1
    return (first_row + offset) // tile - (diag_tiles - 1), (last_row + offset) // tile + (diag_tiles - 1)


def key_tile_is_high(lq: int, lk: int, policy: AttentionPolicy, is_causal: bool) -> torch.Tensor:
    """Bool (n_q_tiles, n_k_tiles): True where a tile runs in the high format."""
    t = policy.tile
    n_q, n_k = -(-lq // t), -(-lk // t)
    j = torch.arange(n_k)
    bands = torch.tensor([diagonal_band(i, lq, lk, t, policy.diag_tiles, is_causal) for i in range(n_q)])
    bands = bands.reshape(n_q, 2)
    in_band = (j[None, :] >= bands[:, :1]) & (j[None, :] <= bands[:, 1:])
    return in_band | (j[None, :] < policy.sink_tiles)


def quantize_operand(x: torch.Tensor, fmt: str, policy: AttentionPolicy, input_dtype: torch.dtype) -> torch.Tensor:
    """Q or K as the tile format sees it, in float32 (float64 stays float64 for "none").

    MX formats quantize x rotated by `policy.rotate` (in float32,
    dma_compile.rotation), so the result is in the rotated basis; "none"
    keeps x's basis. Products of a Q and a K operand of one format are the
    scores either way."""
    if fmt == "none":
        return x.to(input_dtype).to(x.dtype)
    x_rot = rotate(x.float(), policy.rotate)
    return fake_quantize(x_rot, fmt, policy.scale_rule, folded=policy.mx_mode == "folded").to(x.dtype)


def mask_keeps(attn_mask: torch.Tensor) -> torch.Tensor:
    """Bool: where a boolean mask is True or an additive one is not -inf."""
    return attn_mask if attn_mask.dtype == torch.bool else attn_mask != float("-inf")


def attended(attn_mask: torch.Tensor | None, is_causal: bool, lq: int, lk: int, device) -> torch.Tensor | None:
    """Bool broadcastable to (B, H, Lq, Lk): True where a row's softmax includes
    the key (causal, True in a boolean mask, not -inf in an additive one); None
    if every key is included."""
    keep = torch.ones(lq, lk, dtype=torch.bool, device=device).tril() if is_causal else None
    if attn_mask is not None:
        keep = mask_keeps(attn_mask) if keep is None else keep & mask_keeps(attn_mask)
    return keep


def counted_keys(
    attn_mask: torch.Tensor | None, is_causal: bool, b: int, hkv: int, lq: int, lk: int, device
) -> torch.Tensor | None:
    """Bool (B, Hkv, Lk): the keys K's mean and V's FP8 scales are taken over
    (docs/semantics.md): those the mask keeps for at least one query row of
    any query head reading the KV head, and with is_causal those before Lq.
    None when every key counts."""
    counted = None
    if attn_mask is not None:
        m = mask_keeps(attn_mask)
        while m.dim() < 4:
            m = m.unsqueeze(0)
        per_head = m.expand(*m.shape[:3], lk).any(dim=2)
        if per_head.shape[1] > 1:
            per_head = per_head.reshape(per_head.shape[0], hkv, -1, lk).any(dim=2)
        counted = per_head.expand(b, hkv, lk)
    if is_causal and lq < lk:
        before = (torch.arange(lk, device=device) < lq).expand(b, hkv, lk)
        counted = before if counted is None else counted & before
    return counted


def _usable(x: torch.Tensor, counted: torch.Tensor | None) -> torch.Tensor:
    """Finite elements of counted keys (x: (B, H, Lk, D), counted: (B, H, Lk) or None)."""
    use = torch.isfinite(x)
    return use if counted is None else use & counted[..., None]


def fp8_value_scale(v: torch.Tensor, counted: torch.Tensor | None = None) -> torch.Tensor:
    """Per (batch, head, channel) power-of-two scale for e4m3 V: the smallest
    with amax / scale <= 448, amax over the finite values of the counted keys
    (1 for channels without a nonzero one)."""
    amax = torch.where(_usable(v, counted), v.float().abs(), 0.0).amax(dim=-2, keepdim=True)
    exp = rceil_exponent(torch.where(amax > 0, amax, torch.full_like(amax, E4M3.max_normal)), E4M3.max_normal)
    return torch.ldexp(torch.ones_like(amax), exp.float())


def key_mean(k: torch.Tensor, counted: torch.Tensor | None = None) -> torch.Tensor:
    """K's mean over keys (dim -2, kept) for K smoothing, per channel over the
    finite values of the counted keys (0 where there are none): summed and
    divided in float64, then rounded to float32. The float64 sum of 16-bit
    values is exact or nearly so in any order, so the kernels' chunked sums
    round to the same float32 mean and smoothed keys quantize identically."""
    use = _usable(k, counted)
    total = torch.where(use, k.double(), 0.0).sum(dim=-2, keepdim=True)
    n = use.sum(dim=-2, keepdim=True)
    return torch.where(n > 0, total / n.clamp(min=1), 0.0).float()


def score_is_high(lq: int, lk: int, policy: AttentionPolicy, is_causal: bool, device) -> torch.Tensor:
    """Bool (Lq, Lk): True where a score runs in the high format (`key_tile_is_high` per score)."""
    high = key_tile_is_high(lq, lk, policy, is_causal).to(device)
    return high.repeat_interleave(policy.tile, 0)[:lq].repeat_interleave(policy.tile, 1)[:, :lk]


def smoothed_keys(
    k: torch.Tensor, policy: AttentionPolicy, counted: torch.Tensor | None, compute_dtype: torch.dtype
) -> torch.Tensor:
    """K in `compute_dtype`, less its mean over the counted keys where the policy smooths K."""
    kc = k.to(compute_dtype)
    if policy.smooth_k:
        kc = kc - key_mean(k, counted).to(compute_dtype)
    return kc


def format_scores(
    qc: torch.Tensor,
    kc: torch.Tensor,
    fmt: str,
    policy: AttentionPolicy,
    scale: float,
    q_dtype: torch.dtype,
    k_dtype: torch.dtype,
) -> torch.Tensor:
    """Scaled QK^T (B, Hq, Lq, Lk) as tile format `fmt` computes every score,
    from Q and (smoothed) K in the compute dtype. Quantization is per token,
    so it commutes with the GQA head expansion done afterwards."""
    group = qc.shape[1] // kc.shape[1]
    qf = quantize_operand(qc, fmt, policy, q_dtype)
    kf = quantize_operand(kc, fmt, policy, k_dtype).repeat_interleave(group, dim=1)
    return torch.matmul(qf, kf.transpose(-1, -2)) * scale


def fp8_values(
    v: torch.Tensor, counted: torch.Tensor | None, compute_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements, scale) of V as FP8 P·V reads it, in `compute_dtype`: e4m3
    elements of V / scale, and the per-channel `fp8_value_scale`."""
    vc = v.to(compute_dtype)
    v_scale = fp8_value_scale(v, counted).to(compute_dtype)
    # e4m3 has no Inf: a non-finite V element is NaN there (saturating it would hide it).
    v8 = torch.where(torch.isfinite(vc), round_to_element(vc / v_scale, E4M3).to(compute_dtype), float("nan"))
    return v8, v_scale


def fp8_probabilities(p: torch.Tensor) -> torch.Tensor:
    """P as FP8 P·V reads it: the e4m3 elements of P * P_FP8_SCALE, in p's dtype.

    P lies in [0, 1] (or is NaN), so P * P_FP8_SCALE is within e4m3's range,
    where torch's e4m3 cast rounds to nearest even exactly as
    `round_to_element` does (tests/test_reference.py checks every grid
    midpoint), at a sixth of its cost: calibration rounds a P per candidate.
    """
    return (p * P_FP8_SCALE).to(torch.float8_e4m3fn).to(p.dtype)


def _weighted_values(w: torch.Tensor, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """w @ x where row i sums only over the keys it keeps: a non-finite x
    reaches exactly the rows that keep its key (w is 0 elsewhere, and 0 * NaN
    would be NaN). Kept terms follow IEEE: w * NaN and 0 * Inf are NaN, w * Inf
    is Inf, Inf + -Inf is NaN."""
    finite = torch.isfinite(x)
    out = torch.matmul(w, torch.where(finite, x, 0.0))
    if bool(finite.all()):
        return out
    kept = (torch.ones_like(w, dtype=torch.bool) if keep is None else keep.expand(w.shape)).to(w.dtype)
    positive = kept * (w != 0).to(w.dtype)
    is_nan, is_inf, pos, neg = (t.to(w.dtype) for t in (x.isnan(), x.isinf(), x == float("inf"), x == float("-inf")))
    # Counts of the kept terms that are NaN, +Inf and -Inf in each output element.
    nan = torch.matmul(kept, is_nan) + torch.matmul(kept - positive, is_inf)
    pos_inf, neg_inf = torch.matmul(positive, pos), torch.matmul(positive, neg)
    bad = torch.where(pos_inf > 0, float("inf"), torch.where(neg_inf > 0, float("-inf"), 0.0)).to(w.dtype)
    bad = torch.where((nan > 0) | ((pos_inf > 0) & (neg_inf > 0)), float("nan"), bad)
    return out + bad


def dma_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    policy: AttentionPolicy | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """DMA attention with SDPA's interface; returns a tensor of q's dtype."""
    policy = policy if policy is not None else AttentionPolicy()
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    input_dtype = q.dtype

    counted = counted_keys(attn_mask, is_causal, b, hkv, lq, lk, q.device)
    kc = smoothed_keys(k, policy, counted, compute_dtype)
    qc = q.to(compute_dtype)
    q_mx, k_mx = qc, kc
    if policy.balance_qk and policy.uses_mx:
        q_counted = counted_queries(counted, lq, lk, diagonal_offset(lq, lk, is_causal))
        exponents = balance_exponents(qc, kc, counted, q_counted)
        q_mx, k_mx = balanced_operands(qc, kc, exponents)

    # Scores of each format used, then pick per tile.
    group = hq // hkv
    high = score_is_high(lq, lk, policy, is_causal, q.device)
    scores = None
    for fmt in policy.formats:
        if fmt == "none":
            s = format_scores(qc, kc, fmt, policy, scale, input_dtype, k.dtype)
        else:
            s = format_scores(q_mx, k_mx, fmt, policy, scale, input_dtype, k.dtype)
        if scores is None:
            scores = s
        else:
            scores = torch.where(high, scores, s)

    # Masked scores are selected, not added: a NaN score of a masked key stays out of the row.
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        scores = scores + attn_mask.to(compute_dtype)
    keep = attended(attn_mask, is_causal, lq, lk, q.device)
    if keep is not None:
        scores = torch.where(keep, scores, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    # Rows with every key masked output zeros, as SDPA does.
    row_max = torch.where(torch.isneginf(row_max), torch.zeros_like(row_max), row_max)
    p = torch.exp(scores - row_max)
    row_sum = p.sum(dim=-1, keepdim=True)

    if policy.pv == "fp8":
        v8, v_scale = fp8_values(v, counted, compute_dtype)
        out = _weighted_values(fp8_probabilities(p), v8.repeat_interleave(group, dim=1), keep)
        out = out * (v_scale.repeat_interleave(group, dim=1) / P_FP8_SCALE)
    else:
        pr = p.to(v.dtype).to(compute_dtype)
        out = _weighted_values(pr, v.to(compute_dtype).repeat_interleave(group, dim=1), keep)
    out = torch.where(row_sum == 0, torch.zeros_like(out), out / row_sum)
    return out.to(input_dtype)


def cache_position_is_high(lengths: torch.Tensor, max_len: int, policy: AttentionPolicy) -> torch.Tensor:
    """Bool (B, max_len): True where a cached token stays in the input dtype,
    the first `sink_tiles * tile` tokens and the last `recent_tokens` of each
    sequence (of length `lengths[b]`)."""
    p = torch.arange(max_len, device=lengths.device)
    return (p[None, :] < policy.sink_tiles * policy.tile) | (p[None, :] >= lengths[:, None] - policy.recent_tokens)


def cached_values(x: torch.Tensor, lengths: torch.Tensor, fmt: str, policy: AttentionPolicy) -> torch.Tensor:
    """Float32 K or V (B, H, L, D) as a cache of format `fmt` holds them."""
    stored = cache_formats.decode(*cache_formats.encode(x, fmt, policy.scale_rule), fmt, x.shape[-1])
    high = cache_position_is_high(lengths, x.shape[2], policy)[:, None, :, None]
    return torch.where(high, x.float(), stored)


def decode_keep(
    lengths: torch.Tensor, t: int, max_length: int, key_keep: torch.Tensor | None = None
) -> torch.Tensor:
    """Bool (B, T, max_length): the cached keys query t of each sequence sees,
    keys 0 .. lengths[b] - T + t, less those key_keep[b] (bool (B, >=
    max_length), None: all) leaves out."""
    device = lengths.device
    last = lengths[:, None].long() - t + torch.arange(t, device=device)[None, :]
    keep = torch.arange(max_length, device=device)[None, None, :] <= last[:, :, None]
    if key_keep is not None:
        keep = keep & key_keep[:, None, :max_length].to(device)
    return keep


def decode_attention_math(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
    key_keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention of the newest tokens over a cache, in float32.

    q (B, Hq, T, D) holds the queries of positions lengths[b] - T .. lengths[b] - 1
    of each sequence; k, v (B, Hkv, L, D) its cached keys and values, positions
    from lengths[b] on ignored. Query t sees keys 0 .. lengths[b] - T + t
    that key_keep keeps (`decode_keep`); a query that sees none outputs zeros,
    as SDPA does. Left-out keys never reach a sum, NaN or not.
    """
    b, hq, t, d = q.shape
    group = hq // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    keep = decode_keep(lengths.to(q.device), t, k.shape[2], key_keep)[:, None]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    if key_keep is not None:
        # A left-out key is left out for every query of its sequence: zero it.
        left_out = ~keep.any(dim=2)[..., None]
        kf, vf = kf.masked_fill(left_out, 0.0), vf.masked_fill(left_out, 0.0)
    scores = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~keep, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.where(keep.any(dim=-1, keepdim=True), torch.matmul(p, vf), 0.0)


def rotated_for_cache(q: torch.Tensor, k: torch.Tensor, policy: AttentionPolicy) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as a cache of `policy` sees them: rotated and rounded to their
    dtypes when it rotates (`policy.rotates_cache`), as given otherwise."""
    if not policy.rotates_cache:
        return q, k
    return rotate(q, policy.rotate).to(q.dtype), rotate(k, policy.rotate).to(k.dtype)


def decode_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor | None = None,
    scale: float | None = None,
    policy: AttentionPolicy | None = None,
) -> torch.Tensor:
    """Decode attention through a KV cache of `policy`'s cache formats.

    k, v (B, Hkv, L, D) are the keys and values as written (input dtype);
    lengths (B,) each sequence's cached length, all L when None. The cache keeps
    the sinks and the recent window as given and the other tokens in
    `policy.cache_k` / `cache_v`; softmax and P·V are exact (float32). A
    cache that rotates (`policy.rotates_cache`) holds K rotated and rounded
    to its dtype, and q is rotated and rounded the same way (kv_cache.py).
    Returns q's dtype.
    """
    policy = policy if policy is not None else AttentionPolicy()
    q, k = rotated_for_cache(q, k, policy)
    if lengths is None:
        lengths = torch.full((q.shape[0],), k.shape[2], device=q.device)
    kc = cached_values(k, lengths, policy.cache_k, policy)
    vc = cached_values(v, lengths, policy.cache_v, policy)
    return decode_attention_math(q, kc, vc, lengths, scale).to(q.dtype)


def teacher_forced_decode_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix: int,
    scale: float | None = None,
    policy: AttentionPolicy | None = None,
) -> torch.Tensor:
    """Causal attention over a whole sequence as if it were generated through the cache.

    Query i < prefix is the exact prefill; query i >= prefix is the decode
    step at cached length i + 1 (`decode_attention_reference` with T = 1), all
    in one pass: key p is as the cache holds it then (input dtype when
    p < sinks or p >= i + 1 - recent_tokens; rotated when the cache rotates).
    q (B, Hq, L, D), k, v (B, Hkv, L, D).
    """
    policy = policy if policy is not None else AttentionPolicy()
    b, hq, n, d = q.shape
    group = hq // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    everything = torch.full((b,), n, device=q.device)
    high_policy = policy.replace(sink_tiles=0, recent_tokens=0)
    qd, kd = rotated_for_cache(q, k, policy)
    k_lo = cached_values(kd, everything, policy.cache_k, high_policy).repeat_interleave(group, dim=1)
    v_lo = cached_values(v, everything, policy.cache_v, high_policy).repeat_interleave(group, dim=1)
    kf, vf = kd.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    i = torch.arange(n, device=q.device)[:, None]
    p = torch.arange(n, device=q.device)[None, :]
    quantized = (policy.cache_k, policy.cache_v) != ("none", "none")
    sink, recent = (policy.sink_tiles * policy.tile, policy.recent_tokens) if quantized else (0, 0)
    high = (p < sink) | (p >= i + 1 - recent) | (i < prefix)
    qf = qd.float()
    scores = torch.where(high, qf @ kf.transpose(-1, -2), qf @ k_lo.transpose(-1, -2)) * scale
    if policy.rotates_cache:
        # The prefill rows attend to the keys as given, not through the cache.
        prefill = q.float() @ k.float().repeat_interleave(group, dim=1).transpose(-1, -2) * scale
        scores = torch.where(i < prefix, prefill, scores)
    probs = torch.softmax(scores.masked_fill(p > i, float("-inf")), dim=-1)
    out = (probs * high) @ vf + (probs * ~high) @ v_lo
    return out.to(q.dtype)
