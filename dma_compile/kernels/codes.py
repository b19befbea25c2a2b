"""The constants and constexpr codes every kernel shares: one name and one
value per concept, for the Triton kernels, the Gluon kernel and the host
code that launches them.

They are constexpr globals because Triton and Gluon kernels may read only
those; host code reads `.value` (a launch takes the plain number). Kernels
compare their constexpr arguments with these names, never with literals.
"""

from __future__ import annotations

import triton.language as tl

# exp(x) = exp2(x * LOG2E): the kernels' softmax runs in base 2.
LOG2E = tl.constexpr(1.4426950408889634)

# How a precision class's QK^T operands reach a kernel (constexpr KIND,
# HI_KIND, LO_KIND): 16-bit floats (the input dtype for "none"; exact MX
# dequantized to bf16 where a kernel has no block-scaled matmul), MX payloads
# with their E8M0 block scales (`tl.dot_scaled`), or folded MX: e4m3 values
# with a power of two per token.
KIND_16BIT = tl.constexpr(0)
KIND_MX = tl.constexpr(1)
KIND_FOLDED = tl.constexpr(2)

# The explicit mask a call carries (constexpr MASK_KIND): none, boolean
# (True keeps the key), or additive (added to the scores).
MASK_NONE = tl.constexpr(0)
MASK_BOOL = tl.constexpr(1)
MASK_ADDITIVE = tl.constexpr(2)

# Element formats (constexpr FMT, FMT1, FMT2, K_FMT, V_FMT): none (16-bit
# values, or an unused slot), e4m3, e5m2, e2m1.
FMT_NONE = tl.constexpr(0)
FMT_E4M3 = tl.constexpr(1)
FMT_E5M2 = tl.constexpr(2)
FMT_E2M1 = tl.constexpr(3)
# The MX formats of a policy by name, and their element format codes.
MX_FORMAT_CODES = {"mxfp8_e4m3": FMT_E4M3.value, "mxfp8_e5m2": FMT_E5M2.value, "mxfp4_e2m1": FMT_E2M1.value}


def mx_format_slots(formats) -> tuple[list[str], dict[str, int]]:
    """The MX formats among `formats` ("none" dropped), and the FMT1 / FMT2
    codes of a quantization pass that writes them in one go (FMT_NONE for a
    free slot). Raises ValueError for more than two or an unknown one."""
    mx = [f for f in formats if f != "none"]
    if len(mx) > 2 or any(f not in MX_FORMAT_CODES for f in mx):
        raise ValueError(f"formats: at most two of {list(MX_FORMAT_CODES)} (plus 'none'), got {formats}")
    codes = [MX_FORMAT_CODES[f] for f in mx] + [FMT_NONE.value] * (2 - len(mx))
    return mx, {"FMT1": codes[0], "FMT2": codes[1]}

# Which keys' V an attention kernel zeroes in its masking loops (constexpr
# SELECT_V, `schedule.v_select_mode`): none (V as stored), the keys from the
# call's key limit on, or also those its key-keep vector marks 0.
SELECT_V_NONE = tl.constexpr(0)
SELECT_V_LIMIT = tl.constexpr(1)
SELECT_V_KEEP = tl.constexpr(2)
