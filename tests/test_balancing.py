"""Q/K balancing (dma_compile.balancing): the exponents' rule, exactness, and the reference with it on."""

import torch

from dma_compile.balancing import balance_exponents, balanced_operands
from dma_compile.policy import AttentionPolicy
from dma_compile.reference import dma_attention_reference


def test_balance_exponents_meet_halfway():
    """e = floor((floor(log2 amax_K) - floor(log2 amax_Q) + 1) / 2) per channel;
    0 where either operand has no finite nonzero value; only counted keys
    and query rows enter the maxima."""
    q = torch.ones(1, 2, 3, 6)
    k = torch.ones(1, 1, 4, 6)
    q[..., 0], k[..., 0] = 1.0, 8.0       # log2 ratio 3 -> 2
    q[..., 1], k[..., 1] = 1.0, 4.0       # 2 -> 1
    q[..., 2], k[..., 2] = 8.0, 1.5       # -3 -> -1
    q[..., 3], k[..., 3] = 0.0, 5.0       # Q has nothing -> 0
    k[0, 0, 2, 4] = float("inf")          # not finite: ignored
    k[0, 0, 3, 5] = 64.0                  # not counted below
    counted = torch.tensor([[[True, True, True, False]]])
    e = balance_exponents(q, k, counted, None)
    assert e.dtype == torch.int32 and e.shape == (1, 1, 1, 6)
    assert e.flatten().tolist() == [2, 1, -1, 0, 0, 0]
    assert balance_exponents(q, k, None, None)[0, 0, 0, 5].item() == 3
    rows = torch.tensor([[[True, False, False]]])
    q[0, 1, 1:, 0] = 2.0**10              # rows that do not count
    assert balance_exponents(q, k, counted, rows)[0, 0, 0, 0].item() == 2


def test_balancing_leaves_exact_scores_and_exact_attention_unchanged(seed):
    q = torch.randn(2, 4, 30, 64, dtype=torch.float64) * torch.exp2(torch.randint(-8, 9, (64,))).double()
    k = torch.randn(2, 2, 40, 64, dtype=torch.float64) * torch.exp2(torch.randint(-8, 9, (64,))).double()
    e = balance_exponents(q, k, None, None)
    assert e.abs().max() > 0
    qb, kb = balanced_operands(q, k, e)
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2)
    torch.testing.assert_close(qb @ kb.repeat_interleave(2, 1).transpose(-1, -2), scores, rtol=1e-12, atol=0)
    v = torch.randn(2, 2, 40, 64)
    exact = AttentionPolicy.preset("exact")
    a = dma_attention_reference(q.float(), k.float(), v, policy=exact)
    b = dma_attention_reference(q.float(), k.float(), v, policy=exact.replace(balance_qk=True))
    assert torch.equal(a, b)
