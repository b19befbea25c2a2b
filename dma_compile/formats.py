"""OCP Microscaling (MX v1.0) element formats, quantization and dequantization.

An MX tensor stores blocks of 32 consecutive elements along the last dimension
with one shared E8M0 scale (a power of two, biased by 127, 255 = NaN). The
element formats are FP8 E4M3, FP8 E5M2 and FP4 E2M1. Everything here is plain
PyTorch and runs on any device; it is the numerical ground truth that the
reference attention and the Triton quantization pass are tested against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK_SIZE = 32
FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp4_e2m1")
SCALE_RULES = ("rceil", "floor")
E8M0_BIAS = 127
E8M0_NAN = 255


@dataclass(frozen=True)
class ElementFormat:
    """One MX element format: bit widths, the largest exponent and normal value."""

    name: str
    ebits: int
    mbits: int
    emax: int
    max_normal: float

    @property
    def min_exp(self) -> int:
        """Exponent of the smallest normal number (subnormals share its quantum)."""
        return 1 - (2 ** (self.ebits - 1) - 1)


ELEMENT = {
    "mxfp8_e4m3": ElementFormat("e4m3", ebits=4, mbits=3, emax=8, max_normal=448.0),
    "mxfp8_e5m2": ElementFormat("e5m2", ebits=5, mbits=2, emax=15, max_normal=57344.0),
    "mxfp4_e2m1": ElementFormat("e2m1", ebits=2, mbits=1, emax=2, max_normal=6.0),
}
E4M3 = ELEMENT["mxfp8_e4m3"]

# E2M1 magnitudes indexed by their 3-bit code (sign is bit 3).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def check_format(fmt: str) -> ElementFormat:
    if fmt not in ELEMENT:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    return ELEMENT[fmt]


def _check_scale_rule(scale_rule: str) -> None:
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")


def _element_format(fmt: str | ElementFormat) -> ElementFormat:
    return fmt if isinstance(fmt, ElementFormat) else check_format(fmt)


def round_to_element(x: torch.Tensor, fmt: str | ElementFormat) -> torch.Tensor:
    """Round `x` to the element grid of `fmt`: nearest, ties to even, saturating.

    Returns float32 values on the grid. NaN stays NaN; +-Inf saturates like any
    value beyond the largest normal (the MX spec leaves overflow handling to the
    implementation; saturation is what the hardware conversions do).
    """
    ef = _element_format(fmt)
    x = x.float()
    mag = x.abs()
    # Exponent of each value's binade, never below the smallest normal's: that
    # makes subnormals share the smallest normal quantum.
    _, e = torch.frexp(mag)
    exp = torch.clamp(e - 1, min=ef.min_exp)
    quantum_exp = exp - ef.mbits
    # ldexp by powers of two is exact; torch.round is round-half-to-even.
    quantum_exp = quantum_exp.float()
    q = torch.ldexp(torch.round(torch.ldexp(mag, -quantum_exp)), quantum_exp)
    q = torch.clamp(q, max=ef.max_normal)
    return torch.where(torch.isnan(x), x, torch.copysign(q, x))


def _block_view(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 0 or x.shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"x: the last dimension must be a multiple of {BLOCK_SIZE} for MX quantization, "
            f"got shape {tuple(x.shape)}"
        )
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)


def scale_exponents(x: torch.Tensor, fmt: str, scale_rule: str = "rceil") -> torch.Tensor:
    """Unbiased E8M0 exponents, one per block of 32 along the last dimension.

    `floor` is the spec's rule: 2^(floor(log2 amax) - emax_elem). `rceil` is the
    smallest power of two with amax / scale <= max normal, which never clips the
    block's largest value. Exponents are clamped to E8M0's range [-127, 127]; an
    all-zero block gets -127. A block holding NaN or Inf gets no exponent here:
    `quantize_mx` marks its scale NaN.
    """
    ef = check_format(fmt)
    _check_scale_rule(scale_rule)
    amax = _block_view(x).float().abs().amax(dim=-1)
    amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
    if scale_rule == "floor":
        exp = torch.frexp(amax)[1] - 1 - ef.emax
    else:
        exp = rceil_exponent(amax, ef.max_normal)
    exp = torch.where(amax == 0, torch.full_like(exp, -E8M0_BIAS), exp)
    return torch.clamp(exp, -E8M0_BIAS, E8M0_BIAS).to(torch.int32)


def rceil_exponent(amax: torch.Tensor, max_normal: float) -> torch.Tensor:
    """Smallest integer k with amax <= max_normal * 2^k, for finite amax > 0."""
    # With amax = a * 2^E and max_normal = m * 2^F (a, m in [0.5, 1)), k is
    # E - F when a <= m and E - F + 1 otherwise: a comparison of mantissas,
    # exact on every device.
    mant, exp = torch.frexp(amax.float())
    max_mant, max_exp = math.frexp(max_normal)
    k = exp - max_exp
    return torch.where(mant <= max_mant, k, k + 1).to(torch.int32)


def _pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 grid values (float) two per byte, the even index in the low nibble."""
    mag = values.abs()
    code = torch.bucketize(mag, torch.tensor(E2M1_VALUES, device=values.device))
    code = code.to(torch.uint8) | (torch.signbit(values).to(torch.uint8) << 3)
    code = code.reshape(*code.shape[:-1], code.shape[-1] // 2, 2)
    return code[..., 0] | (code[..., 1] << 4)


def _unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)
    table = torch.tensor(E2M1_VALUES, device=packed.device)
    mag = table[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -mag, mag)


@dataclass(frozen=True)
class MXTensor:
    """An MX-quantized tensor: element payload, E8M0 block scales and the format.

    `payload` is a float8 tensor for the FP8 formats, or uint8 with two E2M1
    codes per byte (even index in the low nibble) for MXFP4. `scales` has one
    uint8 per block of 32 along the last dimension of `shape`.
    """

    payload: torch.Tensor
    scales: torch.Tensor
    fmt: str
    shape: torch.Size

    def elements(self) -> torch.Tensor:
        """The element values before scaling, as float32 of `shape`."""
        if self.fmt == "mxfp4_e2m1":
            return _unpack_e2m1(self.payload)
        return self.payload.float()

    def exponents(self) -> torch.Tensor:
        """Unbiased block exponents (int32); NaN scales read as 128."""
        return self.scales.to(torch.int32) - E8M0_BIAS

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        elem = _block_view(self.elements())
        exp = self.exponents()
        out = torch.ldexp(elem, exp.unsqueeze(-1).float())
        out = torch.where((self.scales == E8M0_NAN).unsqueeze(-1), float("nan"), out)
        return out.reshape(self.shape).to(dtype)


def quantize_mx(x: torch.Tensor, fmt: str, scale_rule: str = "rceil") -> MXTensor:
    """Quantize `x` to the MX format `fmt` along its last dimension."""
    ef = check_format(fmt)
    exp = scale_exponents(x, fmt, scale_rule)
    blocks = _block_view(x).float()
    nonfinite = ~torch.isfinite(blocks).all(dim=-1)
    elem = round_to_element(torch.ldexp(blocks, -exp.unsqueeze(-1).float()), ef)
    # A block with NaN or Inf gets a NaN scale: the whole block reads back NaN,
    # as the spec prescribes for a NaN scale.
    elem = torch.where(nonfinite.unsqueeze(-1), torch.zeros_like(elem), elem).reshape(x.shape)
    scales = torch.where(nonfinite, E8M0_NAN, exp + E8M0_BIAS).to(torch.uint8)
    if fmt == "mxfp4_e2m1":
        payload = _pack_e2m1(elem)
    else:
        payload = elem.to(torch.float8_e4m3fn if fmt == "mxfp8_e4m3" else torch.float8_e5m2)
    return MXTensor(payload=payload, scales=scales, fmt=fmt, shape=x.shape)


def fold_mx(mx: MXTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold a token's block scales into one power of two per token (row).

    With `s_b` the row's block exponents and `A = max_b s_b + emax(fmt) - 8`,
    each element becomes `e4m3(elem * 2^(s_b - A))`. Returns those e4m3 grid
    values (float32, `mx.shape`) and `A` (int32, `mx.shape[:-1]`); the folded
    value is `elements * 2^A`. This is what fp8 tensor cores compute with one
    scale per query row and key column. Rows with a NaN scale stay NaN.
    """
    ef = ELEMENT[mx.fmt]
    exp = mx.exponents()
    a = exp.amax(dim=-1) + ef.emax - E4M3.emax
    shift = (exp - a.unsqueeze(-1)).unsqueeze(-1).float()
    elem = _block_view(mx.elements())
    folded = round_to_element(torch.ldexp(elem, shift), E4M3)
    folded = torch.where((mx.scales == E8M0_NAN).unsqueeze(-1), float("nan"), folded)
    return folded.reshape(mx.shape), a.to(torch.int32)


def fake_quantize(
    x: torch.Tensor, fmt: str, scale_rule: str = "rceil", folded: bool = False
) -> torch.Tensor:
    """The values an MX (or folded MX) quantization of `x` represents, as float32."""
    mx = quantize_mx(x, fmt, scale_rule)
    if not folded:
        return mx.dequantize()
    elem, a = fold_mx(mx)
    return torch.ldexp(elem, a.unsqueeze(-1).float())
