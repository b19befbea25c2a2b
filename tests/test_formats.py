"""MX formats against the OCP Microscaling v1.0 spec."""

import itertools

import pytest
import torch

from dma_compile.formats import (
    E2M1_VALUES,
    ELEMENT,
    FORMATS,
    fake_quantize,
    fold_mx,
    quantize_mx,
    rceil_exponent,
    round_to_element,
    scale_exponents,
)


def grid(fmt):
    """Every non-negative finite value of the element format, from its bit fields."""
    ef = ELEMENT[fmt]
    bias = 2 ** (ef.ebits - 1) - 1
    values = set()
    for e, m in itertools.product(range(2**ef.ebits), range(2**ef.mbits)):
        if e == 0:
            values.add(m / 2**ef.mbits * 2.0 ** (1 - bias))
        else:
            values.add((1 + m / 2**ef.mbits) * 2.0 ** (e - bias))
    return torch.tensor(sorted(v for v in values if v <= ef.max_normal))


@pytest.mark.parametrize("fmt", FORMATS)
def test_grid_values_are_fixed_points(fmt):
    g = grid(fmt)
    assert g.max().item() == ELEMENT[fmt].max_normal
    both = torch.cat([g, -g])
    assert torch.equal(round_to_element(both, fmt), both)


def test_e2m1_grid_is_the_spec_table():
    assert grid("mxfp4_e2m1").tolist() == list(E2M1_VALUES)


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_to_nearest_ties_to_even(fmt):
    g = grid(fmt)
    mid = (g[:-1] + g[1:]) / 2
    below, above = g[:-1], g[1:]
    out = round_to_element(mid, fmt)
    # Ties go to the neighbour whose last mantissa bit is zero.
    ef = ELEMENT[fmt]
    codes = torch.arange(len(g))
    even = codes % 2 == 0
    expect = torch.where(even[:-1], below, above)
    assert torch.equal(out, expect)
    # Off-tie values go to the nearest neighbour.
    eps = (above - below) / 8
    assert torch.equal(round_to_element(mid - eps, fmt), below)
    assert torch.equal(round_to_element(mid + eps, fmt), above)
    assert ef.max_normal == g[-1].item()


def test_e2m1_ties_examples():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0])
    assert round_to_element(x, "mxfp4_e2m1").tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_saturation_and_nan(fmt):
    m = ELEMENT[fmt].max_normal
    x = torch.tensor([m * 1.01, m * 100, float("inf"), -float("inf"), float("nan")])
    out = round_to_element(x, fmt)
    assert out[:4].tolist() == [m, m, m, -m]
    assert torch.isnan(out[4])


@pytest.mark.parametrize("fmt,dtype", [("mxfp8_e4m3", torch.float8_e4m3fn), ("mxfp8_e5m2", torch.float8_e5m2)])
def test_fp8_rounding_matches_torch_casts(fmt, dtype, seed):
    x = torch.randn(50_000) * torch.exp(torch.randn(50_000) * 6)
    m = ELEMENT[fmt].max_normal
    assert torch.equal(round_to_element(x, fmt), x.clamp(-m, m).to(dtype).float()), f"seed {seed}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_scale_rules(fmt, seed):
    ef = ELEMENT[fmt]
    x = torch.randn(64, 32 * 4) * torch.exp(torch.randn(64, 1) * 4)
    amax = x.reshape(64, 4, 32).abs().amax(-1)
    floor = scale_exponents(x, fmt, "floor")
    assert torch.equal(floor, torch.floor(torch.log2(amax)).int() - ef.emax), f"seed {seed}"
    rceil = scale_exponents(x, fmt, "rceil")
    scale = torch.ldexp(torch.ones_like(amax), rceil.float())
    assert (amax / scale <= ef.max_normal).all(), f"seed {seed}"
    assert (amax / (scale / 2) > ef.max_normal).all(), f"seed {seed}: rceil is not the smallest scale"


def test_rceil_exact_boundary():
    # amax equal to max_normal * 2^k needs exactly 2^k; one ulp more needs 2^(k+1).
    amax = torch.tensor([448.0 * 4, torch.nextafter(torch.tensor(448.0 * 4), torch.tensor(1e9)).item()])
    assert rceil_exponent(amax, 448.0).tolist() == [2, 3]


def test_floor_clips_e2m1_block_max_rceil_does_not():
    x = torch.zeros(32)
    x[0] = 7.9  # floor: 2^(2 - 2) = 1 -> 7.9 saturates at 6; rceil: 2 -> 8
    x[1:] = torch.linspace(-1, 1, 31)
    assert quantize_mx(x, "mxfp4_e2m1", "floor").dequantize()[0].item() == 6.0
    assert quantize_mx(x, "mxfp4_e2m1", "rceil").dequantize()[0].item() == 8.0


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_block_gives_zeros_and_a_valid_scale(fmt):
    x = torch.zeros(2, 64)
    x[1, 32:] = torch.arange(32) - 16.0
    mx = quantize_mx(x, fmt)
    assert mx.scales[0, 0].item() == 0  # 2^-127, not NaN
    assert mx.scales[0, 1].item() != 255
    out = mx.dequantize()
    assert not torch.isnan(out).any()
    assert torch.equal(out[0], torch.zeros(64))


@pytest.mark.parametrize("fmt", FORMATS)
def test_nan_and_inf_propagate(fmt):
    x = torch.randn(3, 64)
    x[0, 5] = float("nan")
    x[1, 40] = float("inf")
    mx = quantize_mx(x, fmt)
    out = mx.dequantize()
    assert mx.scales[0, 0].item() == 255 and mx.scales[1, 1].item() == 255
    assert torch.isnan(out[0, :32]).all() and torch.isnan(out[1, 32:]).all()
    assert torch.isfinite(out[0, 32:]).all() and torch.isfinite(out[1, :32]).all() and torch.isfinite(out[2]).all()


def test_last_dimension_must_be_multiple_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mx(torch.randn(4, 48), "mxfp8_e4m3")


def test_bad_format_and_rule_are_named():
    with pytest.raises(ValueError, match="fmt must be one of"):
        quantize_mx(torch.randn(32), "fp6")
    with pytest.raises(ValueError, match="scale_rule must be one of"):
        quantize_mx(torch.randn(32), "mxfp8_e4m3", "round")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rule", ["rceil", "floor"])
def test_round_trip_error_bound(fmt, rule, seed):
    ef = ELEMENT[fmt]
    x = torch.randn(256, 128) * torch.exp(torch.randn(256, 1) * 3)
    mx = quantize_mx(x, fmt, rule)
    out = mx.dequantize()
    # Per element: half a quantum of the element's binade (relative 2^-(mbits+1)),
    # or half the smallest subnormal step of the block; floor may also clip
    # values above max_normal * scale.
    scale = torch.ldexp(torch.ones(256, 4, 1), mx.exponents().unsqueeze(-1).float())
    xb, ob = x.reshape(256, 4, 32), out.reshape(256, 4, 32)
    sub_step = scale * 2.0 ** (ef.min_exp - ef.mbits)
    bound = torch.maximum(xb.abs() * 2.0 ** -(ef.mbits + 1), sub_step / 2)
    clipped = xb.abs() > ef.max_normal * scale
    err = (ob - xb).abs()
    assert ((err <= bound * (1 + 1e-6)) | clipped).all(), f"seed {seed}"
    if rule == "rceil":
        assert not clipped.any()
    # The payload reads back the same elements.
    assert torch.equal(mx.elements(), round_to_element(torch.ldexp(xb, -mx.exponents().unsqueeze(-1).float()), fmt).reshape(256, 128))


def test_fp4_packs_two_per_byte_low_nibble_first():
    x = torch.tensor([0.5, -6.0, 1.5, 3.0] + [0.0] * 28)
    mx = quantize_mx(x, "mxfp4_e2m1")
    assert mx.payload.dtype == torch.uint8 and mx.payload.shape == (16,)
    assert mx.scales.item() == 127  # amax 6 needs scale 1
    # codes: 0.5 -> 1, -6 -> 0xF, 1.5 -> 3, 3.0 -> 5
    assert mx.payload[:2].tolist() == [0x1 | (0xF << 4), 0x3 | (0x5 << 4)]
    assert torch.equal(mx.dequantize(), x)


@pytest.mark.parametrize("fmt", ["mxfp8_e4m3", "mxfp8_e5m2"])
def test_fp8_payload_dtype(fmt):
    mx = quantize_mx(torch.randn(3, 64), fmt)
    assert mx.payload.dtype == (torch.float8_e4m3fn if fmt == "mxfp8_e4m3" else torch.float8_e5m2)
    assert mx.scales.dtype == torch.uint8 and mx.scales.shape == (3, 2)


def test_fold_is_exact_for_e2m1_within_range(seed):
    # Blocks within a few binades of each other: folding E2M1 into per-token
    # e4m3 loses nothing.
    x = torch.randn(64, 128) * torch.exp2(torch.randint(-4, 5, (64, 4, 1)).float()).repeat_interleave(32, -1).reshape(64, 128)
    assert torch.equal(fake_quantize(x, "mxfp4_e2m1", folded=True), fake_quantize(x, "mxfp4_e2m1")), f"seed {seed}"


def test_fold_puts_the_token_max_in_e4m3_top_binade(seed):
    x = torch.randn(32, 128) * 10
    for fmt in FORMATS:
        elem, a = fold_mx(quantize_mx(x, fmt))
        top = elem.abs().amax(-1)
        assert (top <= 448).all() and (top >= 2.0 ** (8 - ELEMENT[fmt].mbits - 1)).all(), f"{fmt} seed {seed}"
        assert a.shape == (32,)


def test_fold_e4m3_rounds_smaller_blocks():
    x = torch.zeros(64)
    x[:32] = 448.0  # block scale 1
    x[32] = 1.0 + 1 / 8  # block scale 2^-8 (needs 1.125 exactly in e4m3)
    x[33] = 2.0 ** -10  # far below: flushes after folding
    folded = fake_quantize(x, "mxfp8_e4m3", folded=True)
    exact = fake_quantize(x, "mxfp8_e4m3")
    assert exact[32].item() == 1.125 and folded[32].item() == 1.125
    assert exact[33].item() == 2.0**-10 and folded[33].item() == 0.0
