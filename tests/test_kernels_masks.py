"""The mask classification's key-keep marks against the reference's rule for
the keys that count (reference.counted_keys, docs/semantics.md)."""

import pytest
import torch

from dma_compile.kernels.masks import classify_mask, counted_key_arguments
from dma_compile.reference import counted_keys

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("mask_heads", [1, 4])
@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("causal", [False, True])
def test_kept_keys_are_the_reference_counted_keys(mask_heads, kind, causal, seed):
    b, hq, hkv, lq, lk = 2, 4, 2, 37, 300
    keep = torch.rand(b, mask_heads, lq, lk, device=DEVICE) > 0.97  # sparse: many keys no row keeps
    keep[..., 5] = False
    keep[0, -1, 3, 5] = True  # one row of one query head keeps key 5 of batch 0
    mask = keep if kind == "bool" else torch.where(keep, 0.5, float("-inf")).to(torch.bfloat16)
    key_keep, key_limit = counted_key_arguments(classify_mask(mask, b, hq, lq, lk), causal, lq, lk, hkv)
    got = key_keep.expand(b, hkv, lk) != 0
    if key_limit is not None:
        got = got & (torch.arange(lk, device=DEVICE) < key_limit)
    expected = counted_keys(mask, causal, b, hkv, lq, lk, DEVICE)
    assert torch.equal(got, expected), f"seed {seed}"
    # Query head 3 reads KV head 1: only that KV head counts key 5 when the mask has heads.
    assert expected[0, :, 5].tolist() == ([False, True] if mask_heads > 1 else [True, True])
    assert not bool(expected[1, :, 5].any())
    assert (key_limit == lq) == causal
