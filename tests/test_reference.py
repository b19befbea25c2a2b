"""The reference DMA attention against exact attention and the tiling rule."""

import math

import pytest
import torch
import torch.nn.functional as F

from dma_compile.formats import E4M3, fake_quantize, round_to_element
from dma_compile.policy import AttentionPolicy
from dma_compile.reference import (
    P_FP8_SCALE,
    diagonal_band,
    dma_attention_reference,
    fp8_probabilities,
    key_tile_is_high,
)

EXACT = AttentionPolicy.preset("exact")
F64 = torch.float64


def rand(*shape, dtype=F64):
    return torch.randn(*shape, dtype=dtype)


def sdpa(q, k, v, **kw):
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1], **kw)


@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize(
    "case",
    [
        dict(hq=4, hkv=4, lq=77, lk=77, is_causal=True),
        dict(hq=6, hkv=2, lq=77, lk=77, is_causal=False),
        dict(hq=4, hkv=1, lq=33, lk=130, is_causal=True),  # top-left causal, Lq < Lk
        dict(hq=4, hkv=2, lq=50, lk=131, mask="bool"),
        dict(hq=2, hkv=2, lq=64, lk=64, mask="additive"),
    ],
)
def test_formats_off_equals_exact_attention(case, smooth, seed):
    b, d = 2, 32
    q, k, v = rand(b, case["hq"], case["lq"], d), rand(b, case["hkv"], case["lk"], d), rand(b, case["hkv"], case["lk"], 24)
    mask = None
    if case.get("mask") == "bool":
        mask = torch.rand(b, 1, case["lq"], case["lk"]) > 0.3
    elif case.get("mask") == "additive":
        mask = torch.randn(1, case["hq"], case["lq"], case["lk"], dtype=F64)
    causal = case.get("is_causal", False)
    pol = EXACT.replace(smooth_k=smooth, tile=32)
    out = dma_attention_reference(q, k, v, mask, causal, None, pol, compute_dtype=F64)
    ref = sdpa(q, k, v, attn_mask=mask, is_causal=causal)
    assert out.shape == ref.shape and out.dtype == F64
    assert (out - ref).abs().max().item() <= 1e-10, f"seed {seed}"


def test_scale_argument(seed):
    q, k, v = rand(1, 2, 40, 64), rand(1, 2, 40, 64), rand(1, 2, 40, 64)
    out = dma_attention_reference(q, k, v, scale=0.3, policy=EXACT, compute_dtype=F64)
    assert (out - sdpa(q, k, v, scale=0.3)).abs().max().item() <= 1e-10


def test_fully_masked_rows_are_zero_like_sdpa():
    q, k, v = rand(1, 1, 8, 32), rand(1, 1, 8, 32), rand(1, 1, 8, 32)
    mask = torch.ones(8, 8, dtype=torch.bool)
    mask[3] = False
    out = dma_attention_reference(q, k, v, mask, policy=EXACT, compute_dtype=F64)
    assert torch.equal(out[0, 0, 3], torch.zeros(32, dtype=F64))
    assert (out - sdpa(q, k, v, attn_mask=mask)).abs().max().item() <= 1e-10


def test_nan_propagates_like_sdpa():
    q, k, v = rand(1, 1, 8, 32, dtype=torch.float32), rand(1, 1, 8, 32, dtype=torch.float32), rand(1, 1, 8, 32, dtype=torch.float32)
    q[0, 0, 2, 5] = float("nan")
    out = dma_attention_reference(q, k, v, policy=AttentionPolicy(tile=32))
    assert torch.isnan(out[0, 0, 2]).all()
    assert torch.isfinite(out[0, 0, [0, 1, 3]]).all()


def test_tile_classes_follow_the_rule():
    # tile 32, 5 x 5 tiles, causal, sink 1, diag 2: query tile i is high on
    # key tiles {0} and {i-1, i}; above the diagonal is masked anyway.
    pol = AttentionPolicy(tile=32, sink_tiles=1, diag_tiles=2)
    high = key_tile_is_high(160, 160, pol, is_causal=True)
    expected_lower = [[1], [1, 1], [1, 1, 1], [1, 0, 1, 1], [1, 0, 0, 1, 1]]
    for i, row in enumerate(expected_lower):
        assert high[i, : i + 1].int().tolist() == row
    # Non-causal: the band is symmetric, |i - j| <= diag - 1.
    high = key_tile_is_high(160, 160, pol.replace(sink_tiles=0), is_causal=False)
    ii, jj = torch.meshgrid(torch.arange(5), torch.arange(5), indexing="ij")
    assert torch.equal(high, (ii - jj).abs() <= 1)


def test_band_is_bottom_right_for_kv_cache_shapes():
    # Decode: one query against 300 cached keys; its band is the last key tile.
    assert diagonal_band(0, 1, 300, 64, 1, is_causal=False) == (4, 4)
    # Chunked prefill: 100 new queries after 200 cached keys (Lk = 300).
    assert diagonal_band(0, 100, 300, 64, 1, is_causal=False) == (3, 4)
    assert diagonal_band(1, 100, 300, 64, 1, is_causal=False) == (4, 4)
    # is_causal is top-left aligned, as in SDPA.
    assert diagonal_band(0, 100, 300, 64, 1, is_causal=True) == (0, 0)
    # Queries whose diagonal lies before key 0 (Lq > Lk) get a negative band.
    assert diagonal_band(0, 300, 100, 64, 1, is_causal=False) == (-4, -3)


def _manual_dma(q, k, v, hi_tiles, tile, hi, lo, causal):
    """Attention whose QK^T uses `hi` on the listed (query tile, key tile) pairs, `lo` elsewhere."""
    lq, lk = q.shape[-2], k.shape[-2]
    s_hi = fake_quantize(q, hi) @ fake_quantize(k, hi).transpose(-1, -2) if hi != "none" else q @ k.transpose(-1, -2)
    s_lo = fake_quantize(q, lo) @ fake_quantize(k, lo).transpose(-1, -2)
    s = s_lo.clone()
    for i, j in hi_tiles:
        s[..., i * tile : (i + 1) * tile, j * tile : (j + 1) * tile] = s_hi[..., i * tile : (i + 1) * tile, j * tile : (j + 1) * tile]
    s = s / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(~torch.ones(lq, lk, dtype=torch.bool).tril(), float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("causal", [True, False])
def test_each_tile_gets_the_policy_precision(causal, seed):
    # MXFP4 vs no quantization changes every score visibly, so any tile in
    # the wrong class moves the output far beyond rounding.
    tile, n = 32, 4
    q, k, v = rand(1, 2, tile * n, 64, dtype=torch.float32), rand(1, 2, tile * n, 64, dtype=torch.float32), rand(1, 2, tile * n, 64, dtype=torch.float32)
    pol = AttentionPolicy(tile=tile, sink_tiles=1, diag_tiles=1, hi="none", lo="mxfp4_e2m1", smooth_k=False)
    # Sink tile 0 and the diagonal tile; the non-causal band is |i - j| <= 0 too.
    hi_tiles = [(i, 0) for i in range(n)] + [(i, i) for i in range(n)]
    expected = _manual_dma(q, k, v, hi_tiles, tile, "none", "mxfp4_e2m1", causal)
    out = dma_attention_reference(q, k, v, is_causal=causal, policy=pol)
    assert (out - expected).abs().max().item() < 1e-5, f"seed {seed}"
    # Moving one tile to the other class is detected.
    wrong = _manual_dma(q, k, v, hi_tiles + [(3, 1)], tile, "none", "mxfp4_e2m1", causal)
    assert (out - wrong).abs().max().item() > 1e-3


def test_quantized_policies_are_close_but_not_exact(seed):
    q, k, v = rand(1, 4, 256, 128, dtype=torch.float32), rand(1, 4, 256, 128, dtype=torch.float32), rand(1, 4, 256, 128, dtype=torch.float32)
    ref = sdpa(q, k, v, is_causal=True)

    def err(policy):
        out = dma_attention_reference(q, k, v, is_causal=True, policy=policy)
        return ((out - ref).norm() / ref.norm()).item()

    e8, e4 = err(AttentionPolicy.preset("all_mxfp8")), err(AttentionPolicy.preset("all_mxfp4"))
    paper = err(AttentionPolicy(tile=64))
    assert 1e-3 < e8 < 0.06 and 0.05 < e4 < 0.3, f"seed {seed}: {e8} {e4}"
    assert e8 < paper < e4, f"seed {seed}"


def test_smoothing_helps_with_outlier_channels(seed):
    q, k, v = rand(1, 2, 256, 64, dtype=torch.float32), rand(1, 2, 256, 64, dtype=torch.float32), rand(1, 2, 256, 64, dtype=torch.float32)
    k[..., :4] += 30.0  # a large shared offset in a few channels
    ref = sdpa(q, k, v, is_causal=True)
    pol = AttentionPolicy.preset("all_mxfp4").replace(tile=64)

    def err(p):
        return ((dma_attention_reference(q, k, v, is_causal=True, policy=p) - ref).norm() / ref.norm()).item()

    assert err(pol.replace(smooth_k=True)) < 0.5 * err(pol.replace(smooth_k=False)), f"seed {seed}"


def test_fp8_pv_close_to_exact(seed):
    q, k, v = rand(1, 2, 200, 64, dtype=torch.float32), rand(1, 2, 200, 64, dtype=torch.float32), rand(1, 2, 200, 64, dtype=torch.float32)
    ref = sdpa(q, k, v, is_causal=True)
    out = dma_attention_reference(q, k, v, is_causal=True, policy=EXACT.replace(pv="fp8"))
    rel = ((out - ref).norm() / ref.norm()).item()
    assert 1e-4 < rel < 0.05, f"seed {seed}: {rel}"


def test_folded_matches_exact_mode_for_e2m1(seed):
    q, k, v = rand(1, 2, 96, 64, dtype=torch.float32), rand(1, 2, 96, 64, dtype=torch.float32), rand(1, 2, 96, 64, dtype=torch.float32)
    pol = AttentionPolicy(tile=32, hi="mxfp4_e2m1", lo="mxfp4_e2m1")
    a = dma_attention_reference(q, k, v, is_causal=True, policy=pol)
    b = dma_attention_reference(q, k, v, is_causal=True, policy=pol.replace(mx_mode="folded"))
    assert (a - b).abs().max().item() < 1e-5, f"seed {seed}"


def test_output_dtype_follows_input():
    q = torch.randn(1, 2, 40, 64, dtype=torch.bfloat16)
    out = dma_attention_reference(q, q, q, is_causal=True, policy=AttentionPolicy(tile=32))
    assert out.dtype == torch.bfloat16 and out.shape == q.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fp8_probabilities_round_as_formats(dtype, seed):
    """fp8_probabilities (torch's e4m3 cast) rounds P * P_FP8_SCALE exactly as
    formats.round_to_element: on every e4m3 value up to the scale, every
    midpoint between two (the ties) and its float32 neighbours, and random P."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite() & (grid >= 0) & (grid <= P_FP8_SCALE)].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9))])
    gen = torch.Generator().manual_seed(seed)
    scaled = torch.cat([grid, near, torch.rand(100_000, generator=gen) * P_FP8_SCALE,
                        torch.exp2(-30 * torch.rand(10_000, generator=gen)) * P_FP8_SCALE])
    p = torch.cat([scaled / P_FP8_SCALE, torch.tensor([0.0, 1.0, float("nan")])]).to(dtype)
    p = torch.cat([p, torch.rand(100_000, generator=gen, dtype=dtype)])
    expected = round_to_element(p * P_FP8_SCALE, E4M3).to(dtype)
    assert torch.equal(fp8_probabilities(p).nan_to_num(-1.0), expected.nan_to_num(-1.0))
