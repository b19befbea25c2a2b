"""The memory layout of the attention op's output, for every path that makes one.

The op returns (B, Hq, Lq, Dv) laid out in memory as (B, Lq, Hq, Dv), as
FlashAttention's and cuDNN's SDPA outputs are for transformers' inputs: the
model's next step transposes it to (B, Lq, Hq * Dv) without a copy. One rule
for every input layout keeps the fake kernel, which torch.compile plans
strides from, and every real path (kernels, launch replays, the reference,
stock SDPA) in agreement.
"""

from __future__ import annotations

import torch


def empty_output(b: int, hq: int, lq: int, dv: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised (B, Hq, Lq, Dv) output in the op's layout."""
    return torch.empty(b, lq, hq, dv, dtype=dtype, device=device).transpose(1, 2)


def output_like(q: torch.Tensor, dv: int) -> torch.Tensor:
    """The output of a call on q (fake tensors included), uninitialised."""
    b, hq, lq, _ = q.shape
    return q.new_empty((b, lq, hq, dv)).transpose(1, 2)


def in_output_layout(x: torch.Tensor) -> torch.Tensor:
    """x itself where its memory already has the op's layout, else a copy that has it."""
    if x.transpose(1, 2).is_contiguous():
        return x
    return x.transpose(1, 2).contiguous().transpose(1, 2)
