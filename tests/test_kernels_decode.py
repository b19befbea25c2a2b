"""The split-K decode kernel against the reference decode (interpreter on CPU)."""

import pytest
import torch

from dma_compile.kv_cache import QuantizedKV
from dma_compile.policy import AttentionPolicy
from dma_compile.reference import decode_attention_math

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BASE = AttentionPolicy(tile=32, recent_tokens=16)


def _cache(policy, b, hkv, d, lengths, dtype, capacity=None):
    cache = QuantizedKV(b, hkv, d, capacity or int(max(lengths)) + 8, policy, dtype, DEVICE)
    n = int(max(lengths))
    k = (torch.randn(b, hkv, n, d, device=DEVICE) + torch.randn(b, hkv, 1, d, device=DEVICE)).to(dtype)
    v = torch.randn(b, hkv, n, d, device=DEVICE).to(dtype)
    cache.append(k, v, num_tokens=torch.tensor(lengths, device=DEVICE))
    return cache


def _check(cache, q, chunk=None, scale=None):
    from dma_compile.kernels.decode import decode_attention

    c = cache
    out = decode_attention(
        q, c.k_payload, c.k_scales, c.v_payload, c.v_scales, c.hi_k, c.hi_v, c.lengths, c.max_length,
        c.sink, c.recent, c.policy.cache_k, c.policy.cache_v, scale, chunk,
    )
    expected = decode_attention_math(q, *c.values(), c.lengths, scale)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)
    return out


@pytest.mark.parametrize(
    "k_fmt,v_fmt,hq,hkv,d,t,lengths",
    [
        ("mxfp8_e4m3", "mxfp8_e4m3", 9, 3, 64, 1, [100, 37, 61]),   # SmolLM2's GQA, tails, ragged
        ("mxfp4_e2m1", "mxfp8_e4m3", 4, 1, 128, 3, [90, 75]),       # multi-token decode, D128
        ("mxfp4_e2m1", "none", 2, 2, 32, 2, [67]),
        ("none", "none", 6, 2, 64, 3, [50, 13]),
    ],
)
def test_kernel_matches_reference(k_fmt, v_fmt, hq, hkv, d, t, lengths, seed):
    policy = BASE.replace(cache_k=k_fmt, cache_v=v_fmt)
    cache = _cache(policy, len(lengths), hkv, d, lengths, torch.bfloat16)
    q = torch.randn(len(lengths), hq, t, d, device=DEVICE).bfloat16()
    _check(cache, q, chunk=16)


def test_fp16_small_values_and_no_window(seed):
    # fp16 with values far below 1: the V scales must not underflow in P.
    policy = AttentionPolicy(tile=32, sink_tiles=0, recent_tokens=0, cache_k="mxfp8_e4m3", cache_v="mxfp8_e4m3")
    cache = QuantizedKV(2, 1, 32, 64, policy, torch.float16, DEVICE)
    k = torch.randn(2, 1, 40, 32, device=DEVICE).half()
    v = (torch.randn(2, 1, 40, 32, device=DEVICE) * 1e-5).half()
    cache.append(k, v)
    q = torch.randn(2, 2, 1, 32, device=DEVICE).half()
    out = _check(cache, q, chunk=32, scale=0.3)
    assert out.abs().max() > 1e-7


@pytest.mark.parametrize("k_fmt", ["mxfp8_e4m3", "mxfp4_e2m1"])
@pytest.mark.parametrize("q_scale", [3e5, 1e-6])
def test_queries_outside_fp16s_range(k_fmt, q_scale, seed):
    """The quantized keys multiply q in fp16 after a power-of-two scaling per
    row: queries far above fp16's largest value or far below its smallest
    normal one (bf16 holds both) still match the reference."""
    policy = BASE.replace(cache_k=k_fmt, cache_v="mxfp8_e4m3")
    cache = _cache(policy, 2, 1, 64, [90, 57], torch.bfloat16)
    q = (torch.randn(2, 2, 1, 64, device=DEVICE) * q_scale).bfloat16()
    scale = 1.0 / (8.0 * q_scale)
    out = _check(cache, q, chunk=16, scale=scale)
    assert torch.isfinite(out).all()


def test_mxfp4_key_blocks_far_apart_all_count(seed):
    """An MXFP4 key whose first block is 2^20 times its others, met by a
    query 2^-20 times smaller there: every block adds alike to the score. The
    kernel scales each block's product by the block's own scale; scaling the
    elements of the smaller blocks to their token's largest instead would
    flush them in fp16 on the GPU (the interpreter multiplies in float32)."""
    policy = BASE.replace(cache_k="mxfp4_e2m1", cache_v="mxfp8_e4m3")
    b, hkv, d, n = 2, 1, 128, 80
    cache = QuantizedKV(b, hkv, d, n + 8, policy, torch.bfloat16, DEVICE)
    far = torch.ones(d, device=DEVICE)
    far[:32] = 2.0 ** 20
    k = (torch.randn(b, hkv, n, d, device=DEVICE) * far).bfloat16()
    cache.append(k, torch.randn(b, hkv, n, d, device=DEVICE).bfloat16())
    q = (torch.randn(b, 4, 1, d, device=DEVICE) / far).bfloat16()
    out = _check(cache, q, chunk=16)
    # The small blocks carry most of each score: without them the output differs.
    k_kept, v_kept = cache.values()
    first_block_only = decode_attention_math(q, k_kept * (far > 1), v_kept, cache.lengths, None)
    assert (out.float() - first_block_only).abs().max() > 0.1


def test_chunking_does_not_change_the_result(seed):
    policy = BASE.replace(cache_k="mxfp8_e4m3", cache_v="mxfp8_e4m3")
    cache = _cache(policy, 1, 1, 32, [120], torch.bfloat16)
    q = torch.randn(1, 2, 1, 32, device=DEVICE).bfloat16()
    a, b = _check(cache, q, chunk=16), _check(cache, q, chunk=64)
    torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("k_fmt", ["mxfp8_e4m3", "mxfp4_e2m1"])
def test_output_is_batch_invariant(k_fmt, seed):
    """A sequence decoded alone and inside a batch of longer and shorter ones
    gives the same bits: the key split never depends on the batch."""
    policy = BASE.replace(cache_k=k_fmt, cache_v="mxfp8_e4m3")
    lengths = [150, 40, 300]
    k, v = (torch.randn(3, 2, 300, 32, device=DEVICE).bfloat16() for _ in range(2))
    cache = QuantizedKV(3, 2, 32, 308, policy, torch.bfloat16, DEVICE)
    cache.append(k, v, num_tokens=torch.tensor(lengths, device=DEVICE))
    alone = QuantizedKV(1, 2, 32, 160, policy, torch.bfloat16, DEVICE)
    alone.append(k[:1, :, :150], v[:1, :, :150])
    q = torch.randn(3, 4, 1, 32, device=DEVICE).bfloat16()
    together = _check(cache, q)
    torch.testing.assert_close(_check(alone, q[:1]), together[:1], atol=0, rtol=0)


def test_a_launch_config_must_fit_its_steps():
    from dma_compile.kernels.decode import DecodeConfig, decode_attention

    cache = _cache(BASE.replace(cache_k="mxfp8_e4m3", cache_v="mxfp8_e4m3"), 1, 1, 32, [40], torch.bfloat16)
    q = torch.randn(1, 1, 1, 32, device=DEVICE).bfloat16()
    c = cache
    for bad, match in [(DecodeConfig(block_n=24, chunk=48), "block_n"), (DecodeConfig(block_n=16, chunk=40), "chunk"),
                       (DecodeConfig(block_n=16, chunk=64, pieces=-1), "pieces"),
                       (DecodeConfig(block_n=16, chunk=64, pieces=4, min_chunk=48), "min_chunk"),
                       (DecodeConfig(block_n=16, chunk=64, pieces=4), "min_chunk")]:
        with pytest.raises(ValueError, match=match):
            decode_attention(
                q, c.k_payload, c.k_scales, c.v_payload, c.v_scales, c.hi_k, c.hi_v, c.lengths, c.max_length,
                c.sink, c.recent, c.policy.cache_k, c.policy.cache_v, config=bad,
            )


def test_op_door_routes_to_the_kernel(seed):
    policy = BASE.replace(cache_k="mxfp4_e2m1", cache_v="mxfp8_e4m3")
    cache = _cache(policy, 2, 1, 32, [70, 52], torch.bfloat16)
    q = torch.randn(2, 3, 1, 32, device=DEVICE).bfloat16()
    ref = cache.attend(q, impl="reference")
    torch.testing.assert_close(cache.attend(q, impl="triton").float(), ref.float(), atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="impl must be one of"):
        cache.attend(q, impl="cuda")


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp4_e2m1"])
@pytest.mark.parametrize("scale_rule", ["rceil", "floor"])
def test_encode_kernel_is_bit_exact(fmt, scale_rule, seed):
    from dma_compile import cache_formats
    from dma_compile.ops_decode import encode_cache_tokens

    x = (torch.randn(3, 5, 64, device=DEVICE) * torch.exp2(torch.randint(-20, 20, (3, 5, 64), device=DEVICE).float()))
    x = x.bfloat16()
    x[1, 2, 7] = float("nan")
    x[2, 0, 40] = float("inf")
    payload, scales = encode_cache_tokens(x, fmt, scale_rule, impl="triton")
    want_payload, want_scales = cache_formats.encode(x, fmt, scale_rule)
    assert torch.equal(scales, want_scales)
    finite = torch.isfinite(x).all(dim=-1)
    assert torch.equal(payload[finite], want_payload[finite])
    got = cache_formats.decode(payload, scales, fmt, 64)
    want = cache_formats.decode(want_payload, want_scales, fmt, 64)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def test_nan_reaches_exactly_the_rows_that_see_it(seed):
    policy = BASE.replace(cache_k="mxfp8_e4m3", cache_v="mxfp8_e4m3")
    cache = QuantizedKV(2, 2, 32, 80, policy, torch.bfloat16, DEVICE)
    k, v = torch.randn(2, 2, 70, 32, device=DEVICE).bfloat16(), torch.randn(2, 2, 70, 32, device=DEVICE).bfloat16()
    k[0, 1, 40, 3] = float("nan")  # a quantized (middle) token of sequence 0, KV head 1
    cache.append(k, v)
    q = torch.randn(2, 4, 1, 32, device=DEVICE).bfloat16()
    out = cache.attend(q, impl="triton")
    assert out[0, 2:].isnan().all() and not out[0, :2].isnan().any() and not out[1].isnan().any()
    ref = cache.attend(q, impl="reference")
    assert torch.equal(out.isnan(), ref.isnan())


@pytest.mark.parametrize("kind", ["hadamard", "signed_hadamard"])
@pytest.mark.parametrize("k_fmt,d", [("mxfp4_e2m1", 64), ("mxfp8_e4m3", 128)])
def test_rotating_cache_through_the_kernel(kind, k_fmt, d, seed):
    """A rotating cache (rotated K, each query rotated once) through the
    kernel equals the reference decode of the same policy."""
    from dma_compile.reference import decode_attention_reference

    policy = BASE.replace(cache_k=k_fmt, cache_v="mxfp8_e4m3", rotate=kind)
    lengths = [70, 45]
    cache = QuantizedKV(2, 2, d, 80, policy, torch.bfloat16, DEVICE)
    k = (torch.randn(2, 2, 70, d, device=DEVICE) + torch.randn(d, device=DEVICE) * 2).bfloat16()
    v = torch.randn(2, 2, 70, d, device=DEVICE).bfloat16()
    cache.append(k, v, num_tokens=torch.tensor(lengths, device=DEVICE))
    q = torch.randn(2, 4, 1, d, device=DEVICE).bfloat16()
    out = cache.attend(q, impl="triton").float().cpu()
    for i, n in enumerate(lengths):
        want = decode_attention_reference(q[i : i + 1].cpu(), k[i : i + 1, :, :n].cpu(), v[i : i + 1, :, :n].cpu(),
                                          policy=policy).float()
        torch.testing.assert_close(out[i : i + 1], want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["hadamard", "signed_hadamard"])
def test_rotate_tokens_kernel_is_bit_exact(dtype, kind, seed):
    from dma_compile.ops_decode import rotate_tokens

    # Binades per token, within fp16's range (an Inf would make its whole token NaN).
    x = torch.randn(3, 5, 7, 128, device=DEVICE) * torch.exp2(torch.randint(-10, 8, (3, 5, 7, 1), device=DEVICE))
    x = x.to(dtype)
    x[1, 2, 3, 7] = float("nan")
    got, want = rotate_tokens(x, kind, impl="triton"), rotate_tokens(x.cpu(), kind, impl="reference")
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got.cpu().isnan(), want.isnan()) and torch.equal(got.cpu().nan_to_num(), want.nan_to_num())
    assert bool(want[1, 2, 3].isnan().all()) and not bool(want[1, 2, 2].isnan().any())
    assert rotate_tokens(x, "none") is x
    with pytest.raises(ValueError, match="kind must be one of"):
        rotate_tokens(x, "walsh")


def _run_ptx(asm: str, inputs: dict) -> dict:
    """The integer and e4m3-conversion PTX of the decode kernel's inline
    assembly, evaluated on Python ints: registers hold 32 (or 16) bits;
    `cvt.rn.f16x2.e4m3x2` yields the pair of its bytes' values (low byte
    first), read through torch's float8_e4m3fn."""
    regs = dict(inputs)

    def val(x):
        return int(x, 0) if x[0].isdigit() else regs[x]

    for statement in asm.replace("{", " ").replace("}", " ").split(";"):
        parts = statement.replace(",", " ").split()
        if not parts or parts[0] == ".reg":
            continue
        op, dst, *src = parts
        if op == "shl.b32":
            regs[dst] = (val(src[0]) << val(src[1])) & 0xFFFFFFFF
        elif op == "shr.b32":
            regs[dst] = val(src[0]) >> val(src[1])
        elif op == "and.b32":
            regs[dst] = val(src[0]) & val(src[1])
        elif op == "or.b32":
            regs[dst] = val(src[0]) | val(src[1])
        elif op == "mov.b32":
            # mov.b32 {lo, hi}, word
            regs[dst], regs[src[0]] = val(src[1]) & 0xFFFF, val(src[1]) >> 16
        elif op == "cvt.rn.f16x2.e4m3x2":
            pair = torch.tensor([val(src[0]) & 0xFF, val(src[0]) >> 8], dtype=torch.uint8)
            regs[dst] = tuple(pair.view(torch.float8_e4m3fn).float().tolist())
        else:
            raise AssertionError(f"unexpected instruction {op}")
    return regs


def test_e2m1_unpack_assembly_decodes_every_byte():
    """The GPU's e2m1 unpack (inline PTX the interpreter cannot run), checked
    on the CPU: four packed bytes give the even and odd elements of each,
    worth E2M1_UNPACKED_SCALE times the codes' values, for all 256 bytes."""
    from dma_compile.formats import _unpack_e2m1
    from dma_compile.kernels.decode import _E2M1_PAIRS_ASM, E2M1_UNPACKED_SCALE

    # Every byte once, in an order that gives each word four different ones.
    data = torch.randperm(256, generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    expected = _unpack_e2m1(torch.arange(256, dtype=torch.uint8)).reshape(256, 2) * E2M1_UNPACKED_SCALE.value
    for word in data.reshape(64, 4).tolist():
        regs = _run_ptx(_E2M1_PAIRS_ASM.value, {"$4": word[0] | word[1] << 8 | word[2] << 16 | word[3] << 24})
        even = [*regs["$0"], *regs["$1"]]
        odd = [*regs["$2"], *regs["$3"]]
        assert even == expected[word, 0].tolist(), word
        assert odd == expected[word, 1].tolist(), word


@pytest.mark.parametrize("pattern", [(30, None, None, -30, 0, None, 20), (None, None, -40, -40, 0, 40, None)])
def test_value_scales_far_apart_in_one_stream(pattern, seed):
    """Steps of V tokens 2^70 apart, and steps of zero tokens (scale 2^-127)
    next to large ones, in one warp's stream: the split of the value scales
    that keeps P in fp16 (kernels.decode._pv) neither overflows nor loses a
    step."""
    from dma_compile.kernels.decode import DecodeConfig, decode_attention

    policy = BASE.replace(cache_k="mxfp8_e4m3", cache_v="mxfp8_e4m3")
    n = 32 + 64 * len(pattern) + 16
    cache = QuantizedKV(1, 1, 32, n + 8, policy, torch.bfloat16, DEVICE)
    k = torch.randn(1, 1, n, 32, device=DEVICE)
    exps = [0] * 32 + [e for e in pattern for _ in range(64)] + [0] * 16
    factor = torch.tensor([0.0 if e is None else 2.0 ** e for e in exps], device=DEVICE)
    v = torch.randn(1, 1, n, 32, device=DEVICE) * factor[:, None]
    cache.append(k.bfloat16(), v.bfloat16())
    q = torch.randn(1, 2, 1, 32, device=DEVICE).bfloat16()
    c = cache
    config = DecodeConfig(block_n=16, chunk=64 * len(pattern), num_warps=4, num_stages=2)
    out = decode_attention(q, c.k_payload, c.k_scales, c.v_payload, c.v_scales, c.hi_k, c.hi_v, c.lengths,
                           c.max_length, c.sink, c.recent, c.policy.cache_k, c.policy.cache_v, config=config)
    expected = decode_attention_math(q, *c.values(), c.lengths)
    assert out.float().isfinite().all()
    error = (out.float() - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert (error < 1e-2).all(), error


@pytest.mark.parametrize("warps,block_n,chunk", [(1, 16, 32), (2, 16, 64), (4, 32, 128)])
def test_warp_streams_match_reference(warps, block_n, chunk, seed):
    """Each warp keeps its own softmax stream, merged once per program: any
    number of streams, full and masked steps, sinks, the recent window and
    multi-token queries agree with the reference."""
    from dma_compile.kernels.decode import DecodeConfig, decode_attention

    policy = BASE.replace(cache_k="mxfp4_e2m1", cache_v="mxfp8_e4m3")
    c = _cache(policy, 2, 1, 32, [203, 131], torch.bfloat16)
    q = torch.randn(2, 3, 2, 32, device=DEVICE).bfloat16()
    config = DecodeConfig(block_n=block_n, chunk=chunk, num_warps=warps, num_stages=2)
    out = decode_attention(q, c.k_payload, c.k_scales, c.v_payload, c.v_scales, c.hi_k, c.hi_v, c.lengths,
                           c.max_length, c.sink, c.recent, c.policy.cache_k, c.policy.cache_v, config=config)
    torch.testing.assert_close(out.float(), decode_attention_math(q, *c.values(), c.lengths), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("window", [True, False])
def test_split_by_pieces_matches_reference(window, seed):
    """Programs sized from each sequence's own length (`DecodeConfig.pieces`):
    sequences from 1 key to several full-size programs in one batch, with
    and without the sinks and recent window, keep every key once; pieces=0
    (a fixed split) agrees."""
    from dma_compile.kernels.decode import DecodeConfig, decode_attention

    policy = BASE.replace(cache_k="mxfp8_e4m3", cache_v="mxfp8_e4m3")
    if not window:
        policy = policy.replace(sink_tiles=0, recent_tokens=0)
    lengths = [1, 17, 64, 130, 251, 400]
    c = _cache(policy, len(lengths), 2, 32, lengths, torch.bfloat16)
    q = torch.randn(len(lengths), 4, 1, 32, device=DEVICE).bfloat16()
    expected = decode_attention_math(q, *c.values(), c.lengths)
    pieces, fixed = DecodeConfig(block_n=16, chunk=64, pieces=3, min_chunk=16), DecodeConfig(block_n=16, chunk=64)
    # A short cache takes more, smaller programs than a fixed split gives it.
    assert (pieces.programs_per_sequence(100), fixed.programs_per_sequence(100)) == (3, 2)
    for config in (pieces, fixed):
        out = decode_attention(q, c.k_payload, c.k_scales, c.v_payload, c.v_scales, c.hi_k, c.hi_v, c.lengths,
                               c.max_length, c.sink, c.recent, c.policy.cache_k, c.policy.cache_v, config=config)
        torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


def test_programs_per_sequence_bounds_every_shorter_sequence():
    """The grid (`programs_per_sequence` of the batch's longest) holds every
    shorter sequence's programs: the kernel's keys per program, in Python."""
    from triton import cdiv

    from dma_compile.kernels.decode import DecodeConfig

    for config in (DecodeConfig(block_n=16, chunk=64, pieces=3, min_chunk=16),
                   DecodeConfig(block_n=32, chunk=4096, pieces=16, min_chunk=256),
                   DecodeConfig(block_n=32, chunk=4096)):
        for longest in (1, 15, 100, 1000, 5000, 70000):
            grid = config.programs_per_sequence(longest)
            for span in range(1, longest + 1, max(1, longest // 500)):
                keys = config.chunk
                if config.pieces:
                    keys = min(cdiv(cdiv(span, config.pieces), config.min_chunk) * config.min_chunk, keys)
                assert cdiv(span, keys) <= grid, (config, longest, span)


@pytest.mark.parametrize(
    "k_fmt,v_fmt,t",
    [("mxfp8_e4m3", "mxfp8_e4m3", 1), ("mxfp4_e2m1", "mxfp8_e4m3", 2), ("none", "none", 1)],
)
def test_key_keep_leaves_out_keys_as_the_reference(k_fmt, v_fmt, t, seed):
    """A key-keep vector (a padded batch's key mask) leaves its keys out of
    every chunk, the sinks and the recent window included: sequence 0 loses
    its first 20 keys (left padding), sequence 1 random ones, sequence 2 all
    of them (zeros out, as SDPA). A NaN in a left-out key reaches no row."""
    policy = BASE.replace(cache_k=k_fmt, cache_v=v_fmt)
    lengths = [150, 97, 60]
    c = _cache(policy, 3, 2, 32, lengths, torch.bfloat16)
    keep = torch.rand(3, 160, device=DEVICE) < 0.6
    keep[0] = True
    keep[0, :20] = False
    keep[2] = False
    if k_fmt != "none":
        nan_k = torch.full((3, 2, 1, 32), float("nan"), device=DEVICE).bfloat16()
        nan_v = torch.full((3, 2, 1, 32), float("nan"), device=DEVICE).bfloat16()
        c.append(nan_k, nan_v)
        keep[:, 150:] = False
        keep[1, 97] = False
        keep[2, 60] = False
    q = torch.randn(3, 4, t, 32, device=DEVICE).bfloat16()
    out = c.attend(q, impl="triton", key_keep=keep)
    expected = decode_attention_math(q, *c.values(), c.lengths, key_keep=keep)
    assert not out.isnan().any() and not expected.isnan().any()
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)
    assert (out[2] == 0).all()
    kept_all = decode_attention_math(q, *c.values(), c.lengths)
    assert not torch.allclose(expected[0].nan_to_num(), kept_all[0].nan_to_num(), atol=1e-2)


def test_key_keep_is_checked():
    cache = _cache(BASE.replace(cache_k="mxfp8_e4m3", cache_v="mxfp8_e4m3"), 2, 1, 32, [40, 30], torch.bfloat16)
    q = torch.randn(2, 1, 1, 32, device=DEVICE).bfloat16()
    for bad in (torch.ones(2, 39, dtype=torch.bool, device=DEVICE), torch.ones(2, 40, device=DEVICE),
                torch.ones(3, 40, dtype=torch.bool, device=DEVICE), [True] * 40):
        with pytest.raises(ValueError, match="key_keep must be a bool tensor"):
            cache.attend(q, key_keep=bad)


@pytest.mark.parametrize("d", [32, 128])
def test_garbage_past_the_length_reaches_no_row(d, seed):
    """Values past each sequence's length may hold anything, NaN included: in
    key blocks (D128: the rest of the last block, and whole blocks after it)
    the kernel loads whole blocks but zeroes the keys it does not count."""
    from dma_compile import cache_formats

    policy = BASE.replace(cache_k="mxfp8_e4m3", cache_v="mxfp8_e4m3")
    cache = _cache(policy, 2, 1, d, [45, 70], torch.bfloat16, capacity=128)
    assert (cache.v_payload.dim() == 5) == (d >= cache_formats.KEY_BLOCKS_FROM_HEAD_DIM)
    q = torch.randn(2, 2, 1, d, device=DEVICE).bfloat16()
    clean = _check(cache, q)
    tokens = cache_formats.tokens(cache.v_payload).clone()
    for b, length in enumerate(cache.lengths.tolist()):
        tokens[b, :, length:] = 0x7F  # e4m3 NaN
    cache_formats.write_tokens(cache.v_payload, tokens, torch.arange(tokens.shape[2], device=DEVICE))
    assert cache_formats.tokens(cache.v_payload)[0, :, 45:].eq(0x7F).all()
    torch.testing.assert_close(_check(cache, q), clean, atol=0, rtol=0)


def test_values_in_key_blocks_are_checked():
    """A key-block store the kernel cannot read (not contiguous, too short, or
    sinks that split a key block) goes elsewhere (Unsupported)."""
    from dma_compile.kernels import Unsupported
    from dma_compile.kernels.decode import decode_attention

    c = _cache(BASE.replace(cache_k="mxfp8_e4m3", cache_v="mxfp8_e4m3"), 1, 1, 128, [80], torch.bfloat16)
    q = torch.randn(1, 1, 1, 128, device=DEVICE).bfloat16()
    channels_last = c.v_payload.transpose(-1, -2).contiguous().transpose(-1, -2)
    for v_payload, sink, match in [(channels_last, c.sink, "key blocks"), (c.v_payload[:, :, :2], c.sink, "max_length"),
                                   (c.v_payload, 16, "sinks")]:
        with pytest.raises(Unsupported, match=match):
            decode_attention(q, c.k_payload, c.k_scales, v_payload, c.v_scales, c.hi_k, c.hi_v, c.lengths,
                             c.max_length, sink, c.recent, c.policy.cache_k, c.policy.cache_v)
