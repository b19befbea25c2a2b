"""Batch invariance (docs/semantics.md, "Which keys count"): a sequence's
outputs do not depend on its padding or on the other sequences of its batch,
bit for bit, for the reference and the interpreted sm90 and sm100 kernels (on
a GPU, the compiled ones), at the op and through a tiny Llama.

The padding is on the right, as a key-padding mask combined with the causal
one: precision tiles are counted from position 0 (docs/semantics.md), so left
padding moves a sequence's tiles and changes its numbers by design.
"""

import os

import pytest
import torch
from tiny_models import causal_lm

import dma_compile.hf
from dma_compile import AttentionPolicy, dma_attention

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
IMPLS = ["reference", "sm90", "sm100"]
HOPPER = AttentionPolicy.preset("hopper_input_pv").replace(tile=32)
POLICIES = {"hopper": HOPPER, "paper_folded_fp8pv": AttentionPolicy(tile=32, mx_mode="folded", pv="fp8"),
            # Balancing reads Q's channel maxima: pad rows must not enter them.
            "paper_balanced_rotated": AttentionPolicy(tile=32, mx_mode="folded", rotate="signed_hadamard",
                                                      balance_qk=True)}
LENGTHS = (40, 29)


def _padded_inputs(seed, hq=2, hkv=1, d=32):
    g = torch.Generator().manual_seed(seed)
    b, length = len(LENGTHS), max(LENGTHS)
    q = torch.randn(b, hq, length, d, generator=g).to(torch.bfloat16)
    # An offset on K: smoothing has something to remove.
    k = (torch.randn(b, hkv, length, d, generator=g) + 0.5).to(torch.bfloat16)
    v = torch.randn(b, hkv, length, d, generator=g).to(torch.bfloat16)
    valid = torch.arange(length)[None, :] < torch.tensor(LENGTHS)[:, None]
    mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None] & valid[:, None, None, :]
    return q, k, v, valid, mask


def _garbage_in_padding(x, valid, seed):
    g = torch.Generator().manual_seed(seed + 1)
    noise = torch.randn(x.shape, generator=g) * 300
    noise[..., ::5, 1] = float("nan")
    noise[..., 1::7, 2] = float("inf")
    return torch.where(valid[:, None, :, None], x, noise.to(x.dtype))


def _run(impl, q, k, v, policy, **kw):
    kw = {name: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for name, t in kw.items()}
    return dma_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), policy=policy, impl=impl, **kw).cpu()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_pad_content_does_not_move_valid_rows(impl, policy, seed):
    q, k, v, valid, mask = _padded_inputs(seed)
    out = _run(impl, q, k, v, policy, attn_mask=mask)
    q2, k2, v2 = (_garbage_in_padding(x, valid, seed) for x in (q, k, v))
    out2 = _run(impl, q2, k2, v2, policy, attn_mask=mask)
    rows = valid[:, None, :, None].expand(out.shape)
    assert torch.isfinite(out[rows]).all()
    assert torch.equal(out[rows], out2[rows]), f"seed {seed}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("policy", POLICIES.values(), ids=POLICIES.keys())
def test_sequence_alone_equals_it_in_a_padded_batch(impl, policy, seed):
    q, k, v, valid, mask = _padded_inputs(seed)
    batch = _run(impl, q, k, v, policy, attn_mask=mask)
    for i, n in enumerate(LENGTHS):
        alone = _run(impl, q[i:i + 1, :, :n], k[i:i + 1, :, :n], v[i:i + 1, :, :n], policy, is_causal=True)
        assert torch.equal(alone[0], batch[i, :, :n]), f"sequence {i}, seed {seed}"


@pytest.mark.parametrize("impl", IMPLS)
def test_pad_tokens_do_not_move_valid_logits(impl, seed):
    """A tiny random-weight Llama (one layer, head_dim 32, GQA) through
    attn_implementation="dma": other pad token ids leave the valid tokens'
    logits bit-identical."""
    dma_compile.hf.register(HOPPER, impl=impl)
    model = causal_lm("llama", "dma", seed, num_layers=1).to(DEVICE, torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (len(LENGTHS), max(LENGTHS)), generator=g)
    valid = torch.arange(ids.shape[1])[None, :] < torch.tensor(LENGTHS)[:, None]
    other_ids = torch.where(valid, ids, torch.randint(0, 97, ids.shape, generator=g))
    assert not torch.equal(ids, other_ids)
    with torch.no_grad():
        logits = model(ids.to(DEVICE), attention_mask=valid.long().to(DEVICE)).logits.cpu()
        other = model(other_ids.to(DEVICE), attention_mask=valid.long().to(DEVICE)).logits.cpu()
    assert torch.isfinite(logits[valid]).all()
    assert torch.equal(logits[valid], other[valid]), f"seed {seed}"
