"""dma_compile.calibrate.scoring: LayerScorer gives the reference's output and its error."""

import math
import random

import pytest
import torch
import torch.nn.functional as F

from dma_compile.calibrate import LayerScorer, calibration_windows, candidate_policies, exact_policy
from dma_compile.capture import capture_windows
from dma_compile.policy import AttentionPolicy
from dma_compile.reference import dma_attention_reference
from test_calibrate import tiny_model, tiny_text, tiny_tokenizer


def test_scorer_output_equals_reference(seed):
    # Awkward shapes: 300 tokens (not a multiple of the tile), GQA 4/2, shifted K,
    # channels of Q scaled apart (balancing has something to do).
    q = (torch.randn(1, 4, 300, 64) * 2 * torch.exp2(torch.randint(-3, 4, (64,)).float())).bfloat16()
    k = (torch.randn(1, 2, 300, 64) * 2 + torch.randn(1, 2, 1, 64)).bfloat16()
    v = torch.randn(1, 2, 300, 64).bfloat16()
    scorer = LayerScorer([(q, k, v, None)])
    rng = random.Random(seed)
    policies = rng.sample(candidate_policies("sm100"), 4) + rng.sample(candidate_policies("sm90"), 4)
    balanced = [AttentionPolicy.preset("paper_balanced"), AttentionPolicy.preset("all_mxfp4_balanced"),
                AttentionPolicy.hopper().replace(balance_qk=True)]
    for policy in policies + [AttentionPolicy.paper(), AttentionPolicy.hopper()] + balanced:
        expected = dma_attention_reference(q, k, v, is_causal=True, policy=policy)
        assert torch.equal(scorer.output(0, policy), expected), policy.to_string()


def test_scorer_equals_reference_on_captured_layers(seed):
    """On a model's own Q, K, V (three layers, GQA 6/2, 200 tokens: a partial
    last tile), every candidate family gives the reference's output."""
    model, tok = tiny_model(num_layers=3, seed=seed % 7), tiny_tokenizer()
    ids = calibration_windows(tok, tiny_text(1500, seed=seed), 1, 200)
    captured = capture_windows(model, ids)
    rng = random.Random(seed)
    for layer in range(3):
        (q, k, v, scale), = captured[layer]
        scorer = LayerScorer(captured[layer])
        for policy in rng.sample(candidate_policies("sm100") + candidate_policies("sm90"), 3):
            expected = dma_attention_reference(q, k, v, is_causal=True, scale=scale, policy=policy)
            assert torch.equal(scorer.output(0, policy), expected), (layer, policy.to_string())


def test_scorer_errors_against_exact_attention(seed):
    q, k, v = (torch.randn(1, 4, 200, 32).bfloat16() for _ in range(3))
    scorer = LayerScorer([(q, k, v, None), (q[..., :150, :], k[..., :150, :], v[..., :150, :], 0.3)])
    exact = scorer.errors(exact_policy("sm100"))
    assert exact["rel_l2"] < 1e-2 and exact["complete"]
    coarse_policy = AttentionPolicy.preset("all_mxfp4")
    # Early give-up: a lower bound above the limit, then the full value when asked.
    bound = scorer.errors(coarse_policy, give_up_above=exact["rel_l2"])
    assert not bound["complete"] and bound["rel_l2"] > exact["rel_l2"]
    coarse = scorer.errors(coarse_policy)
    assert coarse["complete"] and coarse["rel_l2"] >= bound["rel_l2"]
    assert coarse["rel_l2"] > 10 * exact["rel_l2"]
    assert coarse["worst_row"] >= coarse["rel_l2"] * 0.5
    err_sq = ref_sq = 0.0
    for i, (wq, wk, wv, scale) in enumerate(scorer.windows):
        exact_out = F.scaled_dot_product_attention(wq.float(), wk.float(), wv.float(), is_causal=True, scale=scale)
        exact_out = exact_out.bfloat16().float()
        err_sq += float((scorer.output(i, coarse_policy).float() - exact_out).square().sum())
        ref_sq += float(exact_out.square().sum())
    assert coarse["rel_l2"] == pytest.approx(math.sqrt(err_sq / ref_sq), rel=1e-5)
    assert scorer.errors(coarse_policy, give_up_above=1e-9) is scorer.errors(coarse_policy)
