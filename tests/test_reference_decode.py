"""Reference decode through a quantized KV cache: exact where nothing is
quantized, formats.py's rounding where it is."""

import pytest
import torch
import torch.nn.functional as F

from dma_compile.formats import fake_quantize
from dma_compile.policy import AttentionPolicy
from dma_compile.reference import cache_position_is_high, cached_values, decode_attention_reference

QUANTIZED = AttentionPolicy(tile=32, cache_k="mxfp4_e2m1", cache_v="mxfp8_e4m3", recent_tokens=8)


def _inputs(b, hq, hkv, t, length, d, dtype=torch.bfloat16):
    q = torch.randn(b, hq, t, d, dtype=dtype)
    k = (torch.randn(b, hkv, length, d) + 0.5 * torch.randn(1, hkv, 1, d)).to(dtype)
    return q, k, torch.randn(b, hkv, length, d, dtype=dtype)


def _sdpa_rows(q, k, v, lengths):
    """Float64 SDPA per sequence, the T queries at the end (bottom-right causal)."""
    outs = []
    for i, n in enumerate(lengths.tolist()):
        t = q.shape[2]
        keep = torch.ones(t, n, dtype=torch.bool).tril(diagonal=n - t)
        outs.append(F.scaled_dot_product_attention(
            q[i : i + 1].double(), k[i : i + 1, :, :n].double(), v[i : i + 1, :, :n].double(),
            attn_mask=keep, enable_gqa=True,
        ))
    return torch.cat(outs)


@pytest.mark.parametrize("t", [1, 3])
def test_exact_when_no_token_is_quantized(t, seed):
    q, k, v = _inputs(3, 9, 3, t, 45, 64)
    lengths = torch.tensor([45, 20, 33])
    # The all-"none" cache holds every token as given; a quantized one holds no
    # quantized token while a sequence fits its 32 sinks and 8 recent tokens.
    out = decode_attention_reference(q, k, v, lengths, policy=QUANTIZED.replace(cache_k="none", cache_v="none"))
    torch.testing.assert_close(out.double(), _sdpa_rows(q, k, v, lengths), atol=2e-2, rtol=2e-2)
    short = torch.tensor([40, 20, 33])
    out = decode_attention_reference(q, k, v, short, policy=QUANTIZED)
    torch.testing.assert_close(out.double(), _sdpa_rows(q, k, v, short), atol=2e-2, rtol=2e-2)


def test_quantized_positions_use_formats_rounding(seed):
    q, k, v = _inputs(2, 4, 2, 2, 70, 32)
    lengths = torch.tensor([70, 51])
    high = cache_position_is_high(lengths, 70, QUANTIZED)
    assert high[0, :32].all() and high[0, 62:].all() and not high[0, 32:62].any()
    assert high[1, 43:].all() and not high[1, 32:43].any()
    kc = cached_values(k, lengths, "mxfp4_e2m1", QUANTIZED)
    vc = cached_values(v, lengths, "mxfp8_e4m3", QUANTIZED)
    h = high[:, None, :, None]
    assert torch.equal(kc, torch.where(h, k.float(), fake_quantize(k, "mxfp4_e2m1")))
    assert torch.equal(vc, torch.where(h, v.float(), fake_quantize(v, "mxfp8_e4m3", folded=True)))
    # The decode output is exact attention over those values (rows' own lengths honoured).
    out = decode_attention_reference(q, k, v, lengths, policy=QUANTIZED)
    expected = _sdpa_rows(q, kc, vc, lengths)
    torch.testing.assert_close(out.double(), expected, atol=1e-2, rtol=1e-2)
    assert not torch.allclose(out.double(), _sdpa_rows(q, k, v, lengths), atol=1e-3, rtol=0)


def test_window_and_sinks_reduce_the_error(seed):
    q, k, v = _inputs(1, 4, 1, 1, 160, 64)
    # Keys near the query carry most of the attention when they resemble it.
    k[:, :, -8:] = (q[:, :1, :, :] * 2).to(k.dtype)
    exact = decode_attention_reference(q, k, v, policy=AttentionPolicy(tile=32)).float()
    err = {}
    for name, pol in {"none": QUANTIZED.replace(sink_tiles=0, recent_tokens=0), "window": QUANTIZED}.items():
        err[name] = (decode_attention_reference(q, k, v, policy=pol).float() - exact).norm() / exact.norm()
    assert err["window"] < err["none"]


def test_teacher_forced_pass_equals_step_by_step_decode(seed):
    from dma_compile.reference import teacher_forced_decode_reference

    q, k, v = _inputs(2, 4, 2, 60, 60, 32, dtype=torch.float32)
    prefix = 20
    out = teacher_forced_decode_reference(q, k, v, prefix, policy=QUANTIZED)
    steps = []
    for i in range(60):
        if i < prefix:
            n = torch.tensor([i + 1, i + 1])
            steps.append(decode_attention_reference(q[:, :, i : i + 1], k[:, :, : i + 1], v[:, :, : i + 1], n,
                                                    policy=QUANTIZED.replace(cache_k="none", cache_v="none")))
        else:
            steps.append(decode_attention_reference(q[:, :, i : i + 1], k[:, :, : i + 1], v[:, :, : i + 1],
                                                    policy=QUANTIZED))
    torch.testing.assert_close(out, torch.cat(steps, dim=2), rtol=1e-5, atol=1e-5)
