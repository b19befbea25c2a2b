"""The quantization pass compiles for sm_90a with saturating fp8 casts and
without spills.

`numerics.on_element_grid` and `e4m3_code` cast float32 to fp8 without a
clamp before it, because Triton emits `cvt.rn.satfinite` for that cast:
values past the format's largest normal become it, as `formats` rounds
them. The statistics pass keeps its per-thread sums in registers at every
head_dim (it once spilled with K and V at 128). This test holds each Triton
CI installs to both (no GPU needed: tests/offline_compile.py). Run as a
script it prints each configuration's casts and resources.
"""

import re

from offline_compile import compile_in_subprocess, resources, script_main

# (name, formats, mx_mode, scale_rule, rotate): floor scales put elements past the largest normal.
TOKEN_CONFIGS = [
    ("hopper_folded_e4m3", ("mxfp8_e4m3",), "folded", "rceil", "none"),
    ("hopper_folded_e4m3_rotated", ("mxfp8_e4m3",), "folded", "rceil", "signed_hadamard"),
    ("paper_folded_e4m3_e2m1_floor", ("mxfp8_e4m3", "mxfp4_e2m1"), "folded", "floor", "none"),
    ("exact_e5m2_floor", ("mxfp8_e5m2",), "exact", "floor", "none"),
]
# (name, head_dim, key mean, value scale)
STATISTICS_CONFIGS = [(f"statistics_kv_d{d}", d, True, True) for d in (64, 128, 256)] + [
    ("statistics_k_d128", 128, True, False),
]
# float32 or a float16 pair to a pair of fp8: `cvt.rn.satfinite.e4m3x2.f32`
# (the satfinite part optional in the pattern).
TO_FP8 = re.compile(r"cvt\.rn(\.satfinite)?(?:\.relu)?\.(e4m3|e5m2)x2\.(f32|f16x2)")


def compile_all() -> dict:
    import triton

    from dma_compile.kernels.quantize import compile_statistics, compile_tokens

    out = {"triton": triton.__version__, "tokens": {}, "statistics": {}}
    for name, formats, mode, rule, rotate in TOKEN_CONFIGS:
        kernel = compile_tokens(formats, mode, rule, rotate)
        ptx = kernel.asm["ptx"]
        casts = TO_FP8.findall(ptx)
        out["tokens"][name] = {
            "target": re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1),
            "fp8_casts": {fmt: sum(1 for _, f, _ in casts if f == fmt) for fmt in ("e4m3", "e5m2")},
            "f16_pair_casts": sum(1 for _, _, src in casts if src == "f16x2"),
            "unsaturated_casts": sum(1 for sat, _, _ in casts if not sat),
            **resources(kernel.asm["cubin"]),
        }
    for name, d, key_mean, value_scale in STATISTICS_CONFIGS:
        kernel = compile_statistics(d, key_mean, value_scale)
        out["statistics"][name] = resources(kernel.asm["cubin"])
    return out


def mode_of(name: str) -> str:
    return next(mode for config, _, mode, _, _ in TOKEN_CONFIGS if config == name)


def test_token_pass_casts_to_fp8_saturating():
    configs = compile_in_subprocess(__file__)["tokens"]
    for name, info in configs.items():
        assert info["target"] == "sm_90a", name
        fmt = "e5m2" if "e5m2" in name else "e4m3"
        assert info["fp8_casts"][fmt] > 0, (name, info["fp8_casts"])
        assert info["unsaturated_casts"] == 0, (name, info)
        # Folded MX re-rounds to the token's exponent in float16 pairs (numerics.folded_mx).
        assert (info["f16_pair_casts"] > 0) == (mode_of(name) == "folded"), (name, info)
        if "stack" in info:
            assert info["stack"] == 0, (name, info)


def test_statistics_pass_does_not_spill():
    configs = compile_in_subprocess(__file__)["statistics"]
    for name, info in configs.items():
        if "stack" in info:  # read with the cuobjdump Triton ships, where it has one
            assert info["stack"] == 0 and info["local_loads"] == 0, (name, info)


def _print_table(result: dict) -> None:
    from tabulate import tabulate

    rows = [[name, info["target"], info["fp8_casts"], info["unsaturated_casts"], info.get("reg", "?"),
             info.get("stack", "?")] for name, info in result["tokens"].items()]
    rows += [[name, "sm_90a", "", "", info.get("reg", "?"), info.get("stack", "?")]
             for name, info in result["statistics"].items()]
    print(f"Triton {result['triton']}: the quantization pass compiled for sm_90a")
    print(tabulate(rows, headers=["config", "target", "fp8 casts", "unsaturated", "regs", "stack B"]))


if __name__ == "__main__":
    script_main(compile_all, _print_table)
