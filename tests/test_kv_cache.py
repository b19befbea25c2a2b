"""QuantizedKV storage: appends hold what the reference decode defines."""

import pytest
import torch

from dma_compile.kv_cache import QuantizedKV
from dma_compile.policy import AttentionPolicy
from dma_compile.reference import cached_values, decode_attention_reference

POLICY = AttentionPolicy(tile=32, cache_k="mxfp4_e2m1", cache_v="mxfp8_e4m3", recent_tokens=8)


@pytest.mark.parametrize("policy", [POLICY, POLICY.replace(cache_k="mxfp8_e4m3", recent_tokens=0),
                                    POLICY.replace(cache_k="none", cache_v="none"),
                                    POLICY.replace(cache_v="none", sink_tiles=0)])
def test_appends_in_pieces_hold_the_reference_values(policy, seed):
    b, h, d, n = 3, 2, 64, 75
    k, v = torch.randn(b, h, n, d).bfloat16(), torch.randn(b, h, n, d).bfloat16()
    cache = QuantizedKV(b, h, d, capacity=80, policy=policy, dtype=torch.bfloat16)
    # A ragged prefill (rows take 40, 13, 0 tokens), then pieces of 1, 3 and 25 tokens.
    take = torch.tensor([40, 13, 0])
    cache.append(k[:, :, :40], v[:, :, :40], num_tokens=take)
    written = [k[i, :, : take[i]] for i in range(b)], [v[i, :, : take[i]] for i in range(b)]
    start = take.clone()
    for piece in (1, 3, 25):
        kk = torch.stack([k[i, :, start[i] : start[i] + piece] for i in range(b)])
        vv = torch.stack([v[i, :, start[i] : start[i] + piece] for i in range(b)])
        cache.append(kk, vv)
        for i in range(b):
            written[0][i] = torch.cat([written[0][i], kk[i]], dim=1)
            written[1][i] = torch.cat([written[1][i], vv[i]], dim=1)
        start += piece
    lengths = start.to(torch.int32)
    assert torch.equal(cache.lengths, lengths) and cache.max_length == int(lengths.max())
    ks, vs = cache.values()
    for i in range(b):
        n_i = int(lengths[i])
        want_k = cached_values(written[0][i][None], lengths[i : i + 1], policy.cache_k, policy)
        want_v = cached_values(written[1][i][None], lengths[i : i + 1], policy.cache_v, policy)
        assert torch.equal(ks[i : i + 1, :, :n_i], want_k) and torch.equal(vs[i : i + 1, :, :n_i], want_v)


@pytest.mark.parametrize("policy", [POLICY, POLICY.replace(cache_k="mxfp8_e4m3", recent_tokens=0),
                                    POLICY.replace(cache_k="none", cache_v="none"),
                                    POLICY.replace(cache_v="none", sink_tiles=0),
                                    POLICY.replace(sink_tiles=1, recent_tokens=4)])
@pytest.mark.parametrize("pieces", [(40, 1, 3, 25), (5, 1, 1, 30, 1)])
def test_write_at_holds_what_append_holds(policy, pieces, seed):
    """A static cache's writes (tensor position, no Python state) leave the
    same values as appends: prefills longer and shorter than the sinks and
    the recent window, single tokens, a long chunk after them."""
    b, h, d = 2, 2, 64
    n = sum(pieces)
    k, v = torch.randn(b, h, n, d).bfloat16(), torch.randn(b, h, n, d).bfloat16()
    grown = QuantizedKV(b, h, d, capacity=n + 4, policy=policy, dtype=torch.bfloat16)
    static = QuantizedKV(b, h, d, capacity=n + 4, policy=policy, dtype=torch.bfloat16)
    position = torch.zeros((), dtype=torch.int64)
    for piece in pieces:
        at = int(position)
        grown.append(k[:, :, at : at + piece], v[:, :, at : at + piece])
        static.write_at(k[:, :, at : at + piece], v[:, :, at : at + piece], position)
        position += piece
        assert torch.equal(static.lengths, grown.lengths)
        static.max_length = grown.max_length
        for a, w in zip(static.values(), grown.values()):
            assert torch.equal(a, w)


@pytest.mark.parametrize("policy", [POLICY, POLICY.replace(cache_k="mxfp8_e4m3", recent_tokens=0),
                                    POLICY.replace(cache_k="none", cache_v="none"),
                                    POLICY.replace(sink_tiles=1, recent_tokens=4)])
@pytest.mark.parametrize("pieces", [(40, 1, 3, 25), (5, 1, 1, 30, 1)])
def test_write_at_leaves_out_padding_as_append_does(policy, pieces, seed):
    """A static cache's writes that skip each row's leading padding (skip,
    then offsets) hold what appends of the rows' real tokens hold: the same
    lengths, input-dtype slots and values; rows padded by 0, 3 and more
    than the first piece (a row that keeps nothing of it)."""
    b, h, d = 3, 2, 64
    n = sum(pieces)
    k, v = torch.randn(b, h, n, d).bfloat16(), torch.randn(b, h, n, d).bfloat16()
    pads = torch.tensor([0, 3, pieces[0] + 1])
    grown = QuantizedKV(b, h, d, capacity=n + 4, policy=policy, dtype=torch.bfloat16)
    static = QuantizedKV(b, h, d, capacity=n + 4, policy=policy, dtype=torch.bfloat16)
    position = torch.zeros((), dtype=torch.int64)
    offsets = torch.zeros(b, dtype=torch.long)
    for piece in pieces:
        at = int(position)
        skip = (pads - at).clamp(0, piece)
        real = [torch.cat([k[i, :, at + int(skip[i]) : at + piece], k[i, :, :int(skip[i])]], dim=1) for i in range(b)]
        real_v = [torch.cat([v[i, :, at + int(skip[i]) : at + piece], v[i, :, :int(skip[i])]], dim=1) for i in range(b)]
        grown.append(torch.stack(real), torch.stack(real_v), num_tokens=piece - skip)
        static.write_at(k[:, :, at : at + piece], v[:, :, at : at + piece], position, offsets=offsets, skip=skip)
        position += piece
        offsets += skip
        assert torch.equal(static.lengths, grown.lengths)
        static.max_length = grown.max_length
        if static.hi_k is not None:
            assert torch.equal(static.hi_k, grown.hi_k) and torch.equal(static.hi_v, grown.hi_v)
        for a, w in zip(static.values(), grown.values()):
            for i in range(b):
                assert torch.equal(a[i, :, : grown.lengths[i]], w[i, :, : grown.lengths[i]])


def test_attend_reference_matches_decode_reference(seed):
    k, v = torch.randn(2, 3, 70, 32).half(), torch.randn(2, 3, 70, 32).half()
    q = torch.randn(2, 9, 3, 32).half()
    cache = QuantizedKV(2, 3, 32, capacity=100, policy=POLICY, dtype=torch.float16)
    cache.append(k, v)
    out = cache.attend(q, impl="reference")
    torch.testing.assert_close(out, decode_attention_reference(q, k, v, policy=POLICY), rtol=0, atol=0)


def test_memory_per_token():
    d, policy = 128, AttentionPolicy(cache_k="mxfp8_e4m3", cache_v="mxfp8_e4m3")
    full = QuantizedKV(1, 1, d, 1 << 16, policy.replace(cache_k="none", cache_v="none")).nbytes()
    assert full / QuantizedKV(1, 1, d, 1 << 16, policy).nbytes() > 1.9
    assert full / QuantizedKV(1, 1, d, 1 << 16, policy.replace(cache_k="mxfp4_e2m1")).nbytes() > 2.5


def test_bad_input():
    cache = QuantizedKV(2, 2, 32, capacity=8, policy=POLICY)
    with pytest.raises(ValueError, match="holds 8 tokens"):
        cache.append(torch.zeros(2, 2, 9, 32).bfloat16(), torch.zeros(2, 2, 9, 32).bfloat16())
    with pytest.raises(ValueError, match="head_dim"):
        cache.append(torch.zeros(2, 2, 1, 16).bfloat16(), torch.zeros(2, 2, 1, 16).bfloat16())
    with pytest.raises(ValueError, match="bfloat16"):
        cache.append(torch.zeros(2, 2, 1, 32), torch.zeros(2, 2, 1, 32))
    with pytest.raises(ValueError, match="num_tokens"):
        cache.append(torch.zeros(2, 2, 1, 32).bfloat16(), torch.zeros(2, 2, 1, 32).bfloat16(), torch.tensor([2, 0]))
    with pytest.raises(ValueError, match="capacity must be an int"):
        QuantizedKV(1, 1, 32, capacity=0)


def test_grow_keeps_the_contents(seed):
    cache = QuantizedKV(1, 2, 32, capacity=10, policy=POLICY)
    k, v = torch.randn(1, 2, 10, 32).bfloat16(), torch.randn(1, 2, 10, 32).bfloat16()
    cache.append(k, v)
    before = cache.values()
    cache.grow(30)
    cache.append(k, v)
    after = cache.values()
    assert cache.capacity == 30 and cache.max_length == 20
    assert torch.equal(after[0][:, :, :10], before[0]) and torch.equal(after[1][:, :, :10], before[1])
    with pytest.raises(ValueError, match="capacity must be >="):
        cache.grow(5)


def test_attend_rejects_bad_queries():
    cache = QuantizedKV(2, 2, 32, capacity=8, policy=POLICY)
    cache.append(torch.zeros(2, 2, 2, 32).bfloat16(), torch.zeros(2, 2, 2, 32).bfloat16())
    with pytest.raises(ValueError, match="input dtype"):
        cache.attend(torch.zeros(2, 4, 1, 32).half())
    with pytest.raises(ValueError, match="KV heads"):
        cache.attend(torch.zeros(2, 3, 1, 32).bfloat16())
    with pytest.raises(ValueError, match="query tokens"):
        cache.attend(torch.zeros(2, 4, 3, 32).bfloat16())


@pytest.mark.parametrize("masked", [False, True])
def test_gpu_fallback_sdpa_path_matches_reference(masked, seed):
    """What a GPU runs when the kernel cannot serve a call: SDPA over the
    dequantized cache; with a key-keep vector that leaves sequence 1 no key,
    its rows are zeros."""
    from dma_compile.ops_decode import _dequantized_attention

    cache = QuantizedKV(2, 2, 32, capacity=90, policy=POLICY)
    cache.append(torch.randn(2, 2, 80, 32).bfloat16(), torch.randn(2, 2, 80, 32).bfloat16(), torch.tensor([80, 47]))
    q = torch.randn(2, 4, 3, 32).bfloat16()
    keep = torch.rand(2, 80) < 0.7 if masked else None
    if masked:
        keep[1] = False
    c = cache
    args = (q, c.k_payload, c.k_scales, c.v_payload, c.v_scales, c.hi_k, c.hi_v, c.lengths, keep, c.max_length,
            c.sink, c.recent, c.policy, None)
    out = _dequantized_attention(*args, exact=False).float()
    torch.testing.assert_close(out, _dequantized_attention(*args, exact=True).float(), atol=1e-2, rtol=1e-2)
    assert (out[1] == 0).all() == masked


@pytest.mark.parametrize("kind", ["hadamard", "signed_hadamard"])
def test_rotating_cache_stores_rotated_keys_and_attends_as_the_reference(kind, seed):
    """K is stored rotated (and rounded to its dtype) in every part of the
    cache, queries are rotated once per call, and values() gives K back in the
    model's basis."""
    from dma_compile.rotation import rotate, unrotate

    b, h, d, n = 2, 3, 64, 70
    k = (torch.randn(b, h, n, d) + torch.randn(d) * 2).bfloat16()
    v = torch.randn(b, h, n, d).bfloat16()
    policy = POLICY.replace(rotate=kind)
    cache = QuantizedKV(b, h, d, capacity=80, policy=policy, dtype=torch.bfloat16)
    cache.append(k[:, :, :40], v[:, :, :40])
    cache.append(k[:, :, 40:], v[:, :, 40:])
    rotated = rotate(k, kind).bfloat16()
    assert torch.equal(cache.hi_k[:, :, :32], rotated[:, :, :32])
    ks, vs = cache.values()
    assert torch.equal(ks, unrotate(cached_values(rotated, cache.lengths, policy.cache_k, policy), kind))
    plain = QuantizedKV(b, h, d, capacity=80, policy=POLICY, dtype=torch.bfloat16)
    plain.append(k, v)
    assert torch.equal(vs, plain.values()[1]) and not torch.equal(ks, plain.values()[0])
    # The sinks and recent window are the keys as given, up to two bf16 roundings.
    torch.testing.assert_close(ks[:, :, :32], k[:, :, :32].float(), rtol=2e-2, atol=2e-2)
    q = torch.randn(b, 6, 2, d).bfloat16()
    out = cache.attend(q, impl="reference")
    torch.testing.assert_close(out, decode_attention_reference(q, k, v, policy=policy), rtol=0, atol=0)
    assert not torch.equal(out, plain.attend(q, impl="reference"))


def test_cache_rotates_only_quantized_keys():
    policy = POLICY.replace(cache_k="none", rotate="hadamard")
    cache = QuantizedKV(1, 1, 32, capacity=40, policy=policy, dtype=torch.bfloat16)
    k, v = torch.randn(1, 1, 36, 32).bfloat16(), torch.randn(1, 1, 36, 32).bfloat16()
    cache.append(k, v)
    assert torch.equal(cache.k_payload[:, :, :36], k)
    with pytest.raises(ValueError, match="head_dim must be a power of two for rotate=hadamard"):
        QuantizedKV(1, 1, 96, capacity=8, policy=POLICY.replace(rotate="hadamard"))
