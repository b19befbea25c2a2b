"""The token quantization pass compiles for sm_90a with saturating fp8 casts.

`numerics.on_element_grid` and `e4m3_code` cast float32 to fp8 without a
clamp before it, because Triton emits `cvt.rn.satfinite` for that cast:
values past the format's largest normal become it, as `formats` rounds
them. This test holds each Triton CI installs to that, for every fp8
format the pass writes (no GPU needed: tests/offline_compile.py). Run as a
script it prints each configuration's casts and resources.
"""

import re

from offline_compile import compile_in_subprocess, resources, script_main

# (name, formats, mx_mode, scale_rule, rotate): floor scales put elements past the largest normal.
CONFIGS = [
    ("hopper_folded_e4m3", ("mxfp8_e4m3",), "folded", "rceil", "none"),
    ("hopper_folded_e4m3_rotated", ("mxfp8_e4m3",), "folded", "rceil", "signed_hadamard"),
    ("paper_folded_e4m3_e2m1_floor", ("mxfp8_e4m3", "mxfp4_e2m1"), "folded", "floor", "none"),
    ("exact_e5m2_floor", ("mxfp8_e5m2",), "exact", "floor", "none"),
]
# float32 to a pair of fp8: `cvt.rn.satfinite.e4m3x2.f32` (the satfinite part optional in the pattern).
TO_FP8 = re.compile(r"cvt\.rn(\.satfinite)?(?:\.relu)?\.(e4m3|e5m2)x2\.f32")


def compile_all() -> dict:
    import triton

    from dma_compile.kernels.quantize import compile_tokens

    out = {"triton": triton.__version__, "configs": {}}
    for name, formats, mode, rule, rotate in CONFIGS:
        kernel = compile_tokens(formats, mode, rule, rotate)
        ptx = kernel.asm["ptx"]
        casts = TO_FP8.findall(ptx)
        out["configs"][name] = {
            "target": re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1),
            "fp8_casts": {fmt: sum(1 for _, f in casts if f == fmt) for fmt in ("e4m3", "e5m2")},
            "unsaturated_casts": sum(1 for sat, _ in casts if not sat),
            **resources(kernel.asm["cubin"]),
        }
    return out


def test_token_pass_casts_to_fp8_saturating():
    configs = compile_in_subprocess(__file__)["configs"]
    for name, info in configs.items():
        assert info["target"] == "sm_90a", name
        fmt = "e5m2" if "e5m2" in name else "e4m3"
        assert info["fp8_casts"][fmt] > 0, (name, info["fp8_casts"])
        assert info["unsaturated_casts"] == 0, (name, info)
        if "counted_spills" in info:
            assert info["counted_spills"] == 0, (name, info)


def _print_table(result: dict) -> None:
    from tabulate import tabulate

    rows = [[name, info["target"], info["fp8_casts"], info["unsaturated_casts"], info.get("reg", "?"),
             info.get("stack", "?")] for name, info in result["configs"].items()]
    print(f"Triton {result['triton']}: the token pass compiled for sm_90a")
    print(tabulate(rows, headers=["config", "target", "fp8 casts", "unsaturated", "regs", "stack B"]))


if __name__ == "__main__":
    script_main(compile_all, _print_table)
