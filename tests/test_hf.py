"""attn_implementation="dma" for uncompiled transformers models (dma_compile.hf)."""

import logging

import pytest
import torch
from tiny_models import causal_lm

import dma_compile.hf
from dma_compile import AttentionPolicy, ModelPolicy

EXACT = AttentionPolicy.preset("exact")
LOSSY = AttentionPolicy(tile=32, hi="mxfp4_e2m1", lo="mxfp4_e2m1")


def padded_batch(seed, length=45):
    ids = torch.randint(0, 97, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    return ids, mask


def test_exact_policy_matches_sdpa_with_padding_and_generation(seed):
    assert dma_compile.hf.register(EXACT, impl="reference") == "dma"
    sdpa, dma = causal_lm("llama", "sdpa", seed), causal_lm("llama", "dma", seed)
    ids, mask = padded_batch(seed)
    with torch.no_grad():
        expected, out = sdpa(ids, attention_mask=mask).logits, dma(ids, attention_mask=mask).logits
        valid = mask.bool()
        torch.testing.assert_close(out[valid], expected[valid], rtol=1e-5, atol=1e-5, msg=f"seed {seed}")
        # Prefill then single-token decode steps through the KV cache.
        generate = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(dma.generate(ids, **generate), sdpa.generate(ids, **generate)), f"seed {seed}"


@pytest.mark.parametrize("lossy_layer", [0, 1])
def test_each_layer_gets_its_policy(seed, lossy_layer):
    """Only the layer given the lossy policy departs from SDPA."""
    dma_compile.hf.register(ModelPolicy(default=EXACT, layers={lossy_layer: LOSSY}), impl="reference")
    ids, _ = padded_batch(seed, length=80)
    with torch.no_grad():
        expected = causal_lm("llama", "sdpa", seed)(ids, output_hidden_states=True).hidden_states
        out = causal_lm("llama", "dma", seed)(ids, output_hidden_states=True).hidden_states
    errors = [((o - e).norm() / e.norm()).item() for o, e in zip(out[1:], expected[1:])]
    assert all(err < 1e-5 for err in errors[:lossy_layer]), f"seed {seed}: {errors}"
    assert errors[lossy_layer] > 1e-3, f"seed {seed}: {errors}"


def test_dropout_runs_sdpa_and_logs_why(seed, caplog):
    dma_compile.hf.register(AttentionPolicy(tile=32), impl="reference")
    dma_compile.hf._log_fallback_once.cache_clear()  # reasons are logged once per process
    sdpa = causal_lm("llama", "sdpa", seed, attention_dropout=0.3).train()
    dma = causal_lm("llama", "dma", seed, attention_dropout=0.3).train()
    ids, mask = padded_batch(seed)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="dma_compile.hf"):
        torch.manual_seed(seed)
        expected = sdpa(ids, attention_mask=mask).logits
        torch.manual_seed(seed)
        out = dma(ids, attention_mask=mask).logits
    assert torch.equal(out, expected), f"seed {seed}"
    assert sum("dropout > 0" in r.getMessage() for r in caplog.records) == 1


def test_register_rejects_unknown_impl():
    with pytest.raises(ValueError, match="impl must be one of"):
        dma_compile.hf.register(impl="triton")


def test_unknown_impl_is_refused():
    with pytest.raises(ValueError, match="impl must be one of .* got 'flash'"):
        dma_compile.hf.register(None, impl="flash")


def test_decode_steps_go_straight_to_sdpa(seed, monkeypatch):
    """With impl="auto", queries shorter than the policy's min_q_len run
    transformers' SDPA path without entering the op (which would route them
    there too); longer ones still run the op."""
    import dma_compile.ops  # noqa: F401 (defines torch.ops.dma.attention)

    dma_compile.hf.register(AttentionPolicy(tile=32, min_q_len=8), impl="auto")
    calls = []
    op = torch.ops.dma.attention
    monkeypatch.setattr(torch.ops.dma, "attention", lambda *args: calls.append(args[0].shape[2]) or op(*args))
    sdpa, dma = causal_lm("llama", "sdpa", seed), causal_lm("llama", "dma", seed)
    ids, _ = padded_batch(seed, length=20)
    # min_new_tokens: a random model may otherwise draw its end-of-sequence token first.
    generate = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        dma_ids = dma.generate(ids[:1], **generate)
        step = dma(ids[:1, :5]).logits
        expected_step = sdpa(ids[:1, :5]).logits
    assert calls and set(calls) == {20}, calls  # the prefill of every layer, no decode step
    assert dma_ids.shape[1] == 23
    assert torch.equal(step, expected_step), f"seed {seed}"
