"""KV-cache token formats: encoding and decoding agree with formats.py's rounding."""

import pytest
import torch

from dma_compile import cache_formats
from dma_compile.formats import fake_quantize


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4_e2m1"])
@pytest.mark.parametrize("scale_rule", ["rceil", "floor"])
def test_round_trip_is_formats_rounding(fmt, scale_rule, seed):
    # Magnitudes spread over many binades per token, so the folding's re-rounding matters.
    x = (torch.randn(3, 2, 17, 64) * torch.exp2(torch.randint(-12, 12, (3, 2, 17, 64)).float())).bfloat16()
    payload, scales = cache_formats.encode(x, fmt, scale_rule)
    assert payload.dtype == torch.uint8 and scales.dtype == torch.uint8
    assert payload.shape[-1] == cache_formats.payload_shape(fmt, 64)[0]
    assert scales.shape == ((3, 2, 17) if fmt == "mxfp8_e4m3" else (3, 2, 17, 2))
    expected = fake_quantize(x, fmt, scale_rule, folded=fmt == "mxfp8_e4m3")
    torch.testing.assert_close(cache_formats.decode(payload, scales, fmt, 64), expected, rtol=0, atol=0)


def test_none_keeps_the_input():
    x = torch.randn(2, 5, 32, dtype=torch.float16)
    payload, scales = cache_formats.encode(x, "none")
    assert scales is None and torch.equal(cache_formats.decode(payload, scales, "none", 32), x.float())


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4_e2m1"])
def test_nonfinite_tokens_read_nan_others_untouched(fmt):
    x = torch.randn(4, 64)
    x[1, 3] = float("nan")
    x[2, 40] = float("inf")
    out = cache_formats.decode(*cache_formats.encode(x, fmt), fmt, 64)
    assert torch.isnan(out[1, :32]).all() and torch.isnan(out[2, 32:]).all()
    assert torch.isfinite(out[[0, 3]]).all()


def test_bytes_per_token():
    assert cache_formats.bytes_per_token("none", 128, torch.bfloat16) == 256
    assert cache_formats.bytes_per_token("mxfp8_e4m3", 128, torch.bfloat16) == 129
    assert cache_formats.bytes_per_token("mxfp4_e2m1", 128, torch.bfloat16) == 68
    with pytest.raises(ValueError, match="multiple of 32"):
        cache_formats.payload_shape("mxfp4_e2m1", 48)
    with pytest.raises(ValueError, match="cache format must be one of"):
        cache_formats.encode(torch.zeros(1, 32), "int8")


def test_e4m3_values_are_stored_in_key_blocks(seed):
    """V in e4m3 from head_dim 128 sits in blocks of KEY_BLOCK tokens,
    channel-major, so each channel's keys are contiguous; every other store
    goes token after token."""
    kb = cache_formats.KEY_BLOCK
    assert cache_formats.payload_store_shape("mxfp8_e4m3", "v", 128, 70) == (3, 128, kb)
    assert cache_formats.payload_store_shape("mxfp8_e4m3", "v", 64, 70) == (70, 64)
    assert cache_formats.payload_store_shape("mxfp8_e4m3", "k", 128, 70) == (70, 128)
    assert cache_formats.payload_store_shape("mxfp4_e2m1", "k", 128, 70) == (70, 64)
    enc = torch.randint(0, 256, (2, 3, 40, 128), dtype=torch.uint8)
    positions = torch.arange(5, 45)
    store = torch.zeros(2, 3, 2, 128, kb, dtype=torch.uint8)
    cache_formats.write_tokens(store, enc, positions)
    p, c = 33, 17
    assert store[1, 2, p // kb, c, p % kb] == enc[1, 2, p - 5, c]
    assert torch.equal(cache_formats.tokens(store)[:, :, 5:45], enc)
    assert not cache_formats.tokens(store)[:, :, :5].any()
    # Token by token into chosen sequences, as appends of different lengths write.
    store.zero_()
    batch_index, at = torch.tensor([0, 1, 1]), torch.tensor([31, 32, 63])
    cache_formats.write_tokens(store, enc[batch_index, :, torch.arange(3)], at, batch_index)
    tokens = cache_formats.tokens(store)
    for i, (b, pos) in enumerate(zip(batch_index.tolist(), at.tolist())):
        assert torch.equal(tokens[b, :, pos], enc[b, :, i])
    assert int(tokens.bool().any(dim=-1).sum()) == 3 * 3
