"""DMACache: generation through the quantized KV cache (dma_compile.hf)."""

import pytest
import torch
from tiny_models import causal_lm

import dma_compile.hf
from dma_compile import AttentionPolicy

EXACT = AttentionPolicy.preset("exact")
FP8 = EXACT.replace(tile=32, cache_k="mxfp8_e4m3", cache_v="mxfp8_e4m3", recent_tokens=4)


def teacher_forced(model, ids, prefix, cache):
    """Logits of positions prefix-1 .. end: prefill the prefix, then one token at a time."""
    out = [model(ids[:, :prefix], **dma_compile.hf.cache_kwargs(model, cache), use_cache=True).logits[:, -1:]]
    for i in range(prefix, ids.shape[1] - 1):
        out.append(model(ids[:, i : i + 1], **dma_compile.hf.cache_kwargs(model, cache), use_cache=True).logits)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_uncompressed_cache_matches_sdpa(family, seed):
    dma_compile.hf.register(EXACT, impl="reference")
    sdpa, dma = causal_lm(family, "sdpa", seed), causal_lm(family, "dma", seed)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected = sdpa(ids).logits[:, 23:-1]
        cache = dma_compile.hf.DMACache(dma, EXACT)
        out = teacher_forced(dma, ids, 24, cache)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4, msg=f"seed {seed}")
    assert cache.get_seq_length() == 39


def test_fp8_cache_is_close_and_generate_runs(seed):
    dma_compile.hf.register(EXACT, impl="reference")
    sdpa, dma = causal_lm("llama", "sdpa", seed), causal_lm("llama", "dma", seed)
    ids = torch.randint(0, 97, (1, 50), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected = sdpa(ids).logits[:, 9:-1]
        out = teacher_forced(dma, ids, 10, dma_compile.hf.DMACache(dma, FP8))
        err = ((out - expected).norm() / expected.norm()).item()
        assert 0 < err < 0.05, f"seed {seed}: {err}"
        cache = dma_compile.hf.DMACache(dma, FP8)
        tokens = dma.generate(ids[:, :10], **dma_compile.hf.cache_kwargs(dma, cache), max_new_tokens=30,
                              min_new_tokens=30, do_sample=False, pad_token_id=0)
    # Past the 32 sink tokens and the 4 recent ones, the cache holds quantized tokens.
    layer = cache.layers[0].store
    assert tokens.shape == (1, 40) and layer.max_length == 39 and layer.k_scales is not None


def test_padded_batch_generation_matches_sdpa(seed):
    dma_compile.hf.register(EXACT, impl="reference")
    sdpa, dma = causal_lm("llama", "sdpa", seed), causal_lm("llama", "dma", seed)
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out = dma.generate(ids, **dma_compile.hf.cache_kwargs(dma, dma_compile.hf.DMACache(dma, EXACT)), **kwargs)
        assert torch.equal(out, sdpa.generate(ids, **kwargs)), f"seed {seed}"


def test_needs_the_dma_attention(seed):
    with pytest.raises(ValueError, match="attn_implementation='dma'"):
        dma_compile.hf.DMACache(causal_lm("llama", "sdpa", seed))



def test_rotating_cache_generates_close_to_exact(seed):
    """A rotating MXFP4-K cache through transformers (keys stored rotated,
    each step's query rotated): close to exact decoding, and not the same
    numbers as the unrotated cache."""
    policy = EXACT.replace(tile=32, cache_k="mxfp4_e2m1", cache_v="mxfp8_e4m3", recent_tokens=4,
                           rotate="signed_hadamard")
    dma_compile.hf.register(EXACT, impl="reference")
    dma = causal_lm("llama", "dma", seed)
    ids = torch.randint(0, 97, (1, 50), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        cache = dma_compile.hf.DMACache(dma, policy)
        out = teacher_forced(dma, ids, 10, cache)
        unrotated = teacher_forced(dma, ids, 10, dma_compile.hf.DMACache(dma, policy.replace(rotate="none")))
        exact = dma(ids).logits[:, 9:-1]
    assert cache.layers[0].store.rotate == "signed_hadamard"
    assert not torch.equal(out, unrotated)
    err = ((out - exact).norm() / exact.norm()).item()
    assert 0 < err < 0.1, f"seed {seed}: {err}"
