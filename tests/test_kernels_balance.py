"""The kernels' balancing factors (kernels/balance.py) against the reference's exponents."""

import pytest
import torch

from dma_compile.balancing import balance_exponents, counted_queries
from dma_compile.kernels.balance import BLOCK_ROWS, balance_factors, channel_extremes, counted_from_arguments
from dma_compile.policy import AttentionPolicy
from dma_compile.reference import diagonal_offset, key_mean

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("smooth_k", [True, False])
@pytest.mark.parametrize("is_causal, lq, lk", [(True, 50, 50), (True, 30, 70), (False, 70, 40)])
@pytest.mark.parametrize("masked", [False, True])
def test_factors_are_the_references_exponents(smooth_k, is_causal, lq, lk, masked, seed):
    """Bit for bit, with GQA, channel ranges far apart, NaN and Inf in Q and K
    (left out), keys left out by key_keep and key_limit, a query layout."""
    torch.manual_seed(seed)
    b, hq, hkv, d = 2, 6, 2, 64
    q = (torch.randn(b, lq, hq, d) * torch.exp2(torch.randint(-9, 10, (d,)).float())).to(DEVICE, torch.bfloat16)
    q = q.transpose(1, 2)  # as transformers passes it
    k = (torch.randn(b, hkv, lk, d) * torch.exp2(torch.randint(-9, 10, (d,)).float()) + 3).to(DEVICE, torch.bfloat16)
    q[0, 1, 4, 3], q[1, 5, 2, 7] = float("nan"), float("-inf")
    k[0, 0, 5, 3], k[1, 1, 8, 9], k[0, 1, 1, 1] = float("inf"), float("nan"), float("-inf")
    key_keep = key_limit = None
    if masked:
        key_keep = (torch.rand(b, 1, lk) > 0.3).to(DEVICE, torch.uint8)
        key_limit = lk - 3
        k[:, :, -2:, 11] = 1e30  # only in keys past the limit: must not count
    policy = AttentionPolicy(smooth_k=smooth_k, balance_qk=True)
    counted = counted_from_arguments(key_keep, key_limit, b, hkv, lk, q.device)
    mean = key_mean(k, counted) if smooth_k else None
    fq, fk = balance_factors(q, k, policy, is_causal, key_keep, key_limit, None if mean is None else mean[..., 0, :])
    kc = k.float() - mean if smooth_k else k.float()
    e = balance_exponents(q.float(), kc, counted, counted_queries(counted, lq, lk, diagonal_offset(lq, lk, is_causal)))
    assert e.abs().max() > 1
    expected = torch.exp2(e[:, :, 0].float())
    assert torch.equal(fk, 1.0 / expected), f"seed {seed}"
    assert torch.equal(fq, expected.repeat_interleave(hq // hkv, dim=1)), f"seed {seed}"


def test_smoothing_policy_needs_the_mean():
    q, k = torch.randn(1, 2, 8, 32), torch.randn(1, 1, 8, 32)
    with pytest.raises(ValueError, match="key_mean"):
        balance_factors(q, k, AttentionPolicy(balance_qk=True), True)


@pytest.mark.parametrize("absolute", [False, True])
@pytest.mark.parametrize("d", [64, 96])
def test_channel_extremes_over_chunks_rows_and_groups(absolute, d, seed):
    """Several chunks of rows per head (the last one partial), a head_dim that
    is no power of two, NaN and +-Inf left out, rows kept per group of heads,
    a channel whose every kept value is non-finite, a strided view."""
    torch.manual_seed(seed)
    b, h, hr, length = 2, 6, 3, 3 * BLOCK_ROWS + 7
    x = (torch.randn(b, length, h, d) * 100).to(DEVICE, torch.bfloat16).transpose(1, 2)
    x[0, 1, 5, 3], x[1, 4, 70, 9], x[0, 0, 2, 1] = float("nan"), float("inf"), float("-inf")
    x[1, 2, :, 5] = float("nan")
    rows = (torch.rand(b, hr, length) > 0.4).to(DEVICE)
    top, bottom = channel_extremes(x, rows, absolute=absolute, chunk=BLOCK_ROWS)
    kept = rows.repeat_interleave(h // hr, dim=1)[..., None] & torch.isfinite(x)
    xf = x.float()
    if absolute:
        assert bottom is None
        assert torch.equal(top, torch.where(kept, xf.abs(), 0.0).amax(dim=2))
    else:
        assert torch.equal(top, torch.where(kept, xf, float("-inf")).amax(dim=2))
        assert torch.equal(bottom, torch.where(kept, xf, float("inf")).amin(dim=2))
        assert top[1, 2, 5] == float("-inf") and bottom[1, 2, 5] == float("inf")
    whole, _ = channel_extremes(x, None, absolute=True)
    assert torch.equal(whole, torch.where(torch.isfinite(x), xf.abs(), 0.0).amax(dim=2))


def test_channel_extremes_chunk_must_fit_the_step():
    with pytest.raises(ValueError, match="chunk must be a multiple of"):
        channel_extremes(torch.randn(1, 1, 8, 32), chunk=BLOCK_ROWS + 1)
