"""The decode kernel compiles for sm_90a on the tensor cores, with room for
several programs per SM.

No GPU is needed: `compile_decode` runs Triton's compiler and the ptxas its
wheel ships for an explicit sm_90 target, in a subprocess (tests/offline_compile.py
says why). Run as a script it prints each configuration's resources.
"""

import re

from offline_compile import compile_in_subprocess, resources, script_main

CONFIGS = [
    ("fp8_d128", "mxfp8_e4m3", "mxfp8_e4m3", 128, 4),
    ("mxfp4k_d128", "mxfp4_e2m1", "mxfp8_e4m3", 128, 4),
    ("fp8_d64", "mxfp8_e4m3", "mxfp8_e4m3", 64, 3),
    ("mxfp4k_d64", "mxfp4_e2m1", "mxfp8_e4m3", 64, 3),
]
MMA = re.compile(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.(\w+)\.(\w+)")


def compile_all() -> dict:
    import triton

    from dma_compile.kernels.decode import compile_decode

    out = {"triton": triton.__version__, "configs": {}}
    for name, k_fmt, v_fmt, d, group in CONFIGS:
        kernel = compile_decode(k_fmt, v_fmt, head_dim=d, group=group)
        ptx = kernel.asm["ptx"]
        out["configs"][name] = {
            "target": re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1),
            "shared": kernel.metadata.shared,
            "mma": sorted({f"{a}x{b}" for a, b in MMA.findall(ptx)}),
            **resources(kernel.asm["cubin"]),
        }
    return out


def test_decode_kernel_compiles_for_hopper():
    configs = compile_in_subprocess(__file__)["configs"]
    for name, info in configs.items():
        assert info["target"] == "sm_90a", name
        # Quantized K and V multiply in fp16 (bf16 for the sinks and window).
        assert "f16xf16" in info["mma"], (name, info["mma"])
        # Two programs per SM at least (228 KiB of shared memory on an H100/H200).
        assert info["shared"] <= 112 * 1024, (name, info["shared"])
        if name.endswith("d64") and "reg" in info:
            # Three programs per SM at head_dim 64 (the launch's register cap: 3 x 128 x 168 <= 64K).
            assert info["reg"] <= 168, (name, info["reg"])


def _print_table(result: dict) -> None:
    from tabulate import tabulate

    rows = [[name, info["target"], ",".join(info["mma"]), info["shared"], info.get("reg", "?"), info.get("stack", "?")]
            for name, info in result["configs"].items()]
    print(f"Triton {result['triton']}: the decode split kernel compiled for sm_90a")
    print(tabulate(rows, headers=["config", "target", "mma", "shared B", "regs", "stack B"]))


if __name__ == "__main__":
    script_main(compile_all, _print_table)
