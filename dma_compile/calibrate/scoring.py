"""Scoring: the error of one layer's attention output under a candidate policy.

`LayerScorer` holds a layer's captured windows (Q, K, V as SDPA saw them) and
gives a policy's relative L2 error against exact attention. Its output is
the reference's (`dma_compile.reference`): the tile classes, the quantized
scores and FP8 P·V come from the reference's own functions; only the
softmax runs one query tile at a time, so that a candidate can be given up
on as soon as its error exceeds a budget, and each format's score matrix is
computed once per window and shared by every candidate.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from dma_compile.balancing import balance_exponents, balanced_operands
from dma_compile.policy import AttentionPolicy
from dma_compile.reference import (
    P_FP8_SCALE,
    format_scores,
    fp8_probabilities,
    fp8_values,
    score_is_high,
    smoothed_keys,
)


class LayerScorer:
    """Errors of one layer's DMA output against exact attention, over the
    captured windows. The score matrix of each QK^T format is computed once
    per window and reused by every candidate."""

    def __init__(self, windows: Sequence[tuple]):
        if not windows:
            raise ValueError("LayerScorer needs at least one captured window")
        self.windows = [(q, k, v, scale) for q, k, v, scale in windows]
        self._exact = [self._exact_output(*w) for w in self.windows]
        self._ref_sq = max(sum(float(e.square().sum()) for e in self._exact), 1e-30)
        self._scores: dict[tuple, torch.Tensor] = {}
        self._value_cache: dict[tuple, tuple] = {}
        self._masks: dict[tuple, torch.Tensor] = {}
        self._errors: dict[str, dict] = {}

    @property
    def head_dim(self) -> int:
        """The layer's query/key head_dim."""
        return self.windows[0][0].shape[-1]

    @staticmethod
    def _exact_output(q, k, v, scale):
        out = F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
        return out.to(q.dtype).float()

    def _format_scores(self, index: int, fmt: str, policy: AttentionPolicy) -> torch.Tensor:
        balanced = policy.balance_qk and fmt != "none"
        key = (index, fmt, policy.scale_rule, policy.mx_mode, policy.smooth_k, policy.rotate, balanced)
        if key not in self._scores:
            q, k, _, scale = self.windows[index]
            scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
            qc, kc = q.float(), smoothed_keys(k, policy, None, torch.float32)
            if balanced:
                # Causal windows without padding: every key and query row counts.
                qc, kc = balanced_operands(qc, kc, balance_exponents(qc, kc, None, None))
            scores = format_scores(qc, kc, fmt, policy, scale, q.dtype, k.dtype)
            # Masked once here rather than per candidate (the reference selects -inf there: the same values).
            lq, lk = scores.shape[-2:]
            future = torch.ones(lq, lk, dtype=torch.bool, device=scores.device).triu(1)
            self._scores[key] = scores.masked_fill_(future, float("-inf"))
        return self._scores[key]

    def _values(self, index: int, pv: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """V as P·V consumes it, expanded to the query heads, and its fp8 scale."""
        key = (index, pv)
        if key not in self._value_cache:
            q, _, v, _ = self.windows[index]
            group = q.shape[1] // v.shape[1]
            if pv == "fp8":
                v8, v_scale = fp8_values(v, None, torch.float32)
                self._value_cache[key] = (v8.repeat_interleave(group, dim=1), v_scale.repeat_interleave(group, dim=1))
            else:
                self._value_cache[key] = (v.float().repeat_interleave(group, dim=1), None)
        return self._value_cache[key]

    def _high_mask(self, lq: int, lk: int, policy: AttentionPolicy, device) -> torch.Tensor:
        """Bool (lq, lk): True where a score runs in the high format."""
        key = (lq, lk, policy.tile, policy.diag_tiles, policy.sink_tiles)
        if key not in self._masks:
            self._masks[key] = score_is_high(lq, lk, policy, True, device)
        return self._masks[key]

    def _row_tiles(self, index: int, policy: AttentionPolicy):
        """Yield (r0, r1, output rows r0..r1-1) of the policy's causal attention
        for window `index`, one query tile at a time over the keys it can see:
        the reference's math from the reference's own pieces (masked keys
        contribute exact zeros, so at most the summation order differs)."""
        q, _, v, _ = self.windows[index]
        lq, lk = q.shape[-2], v.shape[-2]
        s_hi = self._format_scores(index, policy.hi, policy)
        s_lo = None
        if policy.lo != policy.hi:
            s_lo = self._format_scores(index, policy.lo, policy)
            high = self._high_mask(lq, lk, policy, q.device)
        values, v_scale = self._values(index, policy.pv)
        for r0 in range(0, lq, policy.tile):
            r1 = min(r0 + policy.tile, lq)
            # Causal, top-left: rows r0..r1-1 see keys 0..r1-1 at most.
            seen = min(r1, lk)
            scores = s_hi[..., r0:r1, :seen]
            if s_lo is None:
                scores = scores.clone()
            else:
                scores = torch.where(high[r0:r1, :seen], scores, s_lo[..., r0:r1, :seen])
            # P over all lk keys (zeros past `seen`), as the reference sums it:
            # a shorter sum may round its last bit differently.
            p = scores.new_zeros(*scores.shape[:-1], lk)
            p[..., :seen] = scores.sub_(scores.amax(dim=-1, keepdim=True)).exp_()
            row_sum = p.sum(dim=-1, keepdim=True)
            if policy.pv == "fp8":
                tile_out = torch.matmul(fp8_probabilities(p), values) * (v_scale / P_FP8_SCALE)
            else:
                tile_out = torch.matmul(p.to(v.dtype).float(), values)
            yield r0, r1, (tile_out / row_sum).to(q.dtype)

    def output(self, index: int, policy: AttentionPolicy) -> torch.Tensor:
        """The policy's causal attention output for window `index` (the reference's)."""
        return torch.cat([rows for _, _, rows in self._row_tiles(index, policy)], dim=-2)

    def errors(self, policy: AttentionPolicy, give_up_above: float | None = None) -> dict:
        """{"rel_l2", "worst_row", "complete"} of the policy over all windows.

        With `give_up_above`, scoring stops as soon as the error is known to
        exceed it (the squared error only grows row by row, against the
        squared norm of all exact outputs); "rel_l2" is then a lower bound and
        "complete" False. Results are memoized; a lower bound is recomputed
        only when it no longer settles the question asked.
        """
        key = policy.to_string()
        known = self._errors.get(key)
        if known is not None and (known["complete"] or (give_up_above is not None and known["rel_l2"] > give_up_above)):
            return known
        limit_sq = math.inf if give_up_above is None else (give_up_above**2) * self._ref_sq
        err_sq = worst = 0.0
        complete = True
        for index, exact in enumerate(self._exact):
            for r0, r1, rows in self._row_tiles(index, policy):
                ref = exact[..., r0:r1, :]
                diff = rows.float() - ref
                row_err = diff.norm(dim=-1)
                err_sq += float(row_err.square().sum())
                row_ref = ref.norm(dim=-1).clamp_min(torch.finfo(torch.float32).tiny)
                worst = max(worst, float((row_err / row_ref).max()))
                if err_sq > limit_sq:
                    complete = False
                    break
            if not complete:
                break
        self._errors[key] = {"rel_l2": math.sqrt(err_sq / self._ref_sq), "worst_row": worst, "complete": complete}
        return self._errors[key]

    def release(self) -> None:
        self._scores.clear()
        self._value_cache.clear()
        self._masks.clear()

