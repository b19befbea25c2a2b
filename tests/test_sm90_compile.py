"""The Hopper kernel compiles for sm_90a to wgmma on the tensor cores each policy names.

No GPU is needed: `compile_sm90` runs Triton's real compiler (and the ptxas
its wheel ships) for an explicit sm_90 target, so CI checks the kernel with
the Triton it installs, not only under the interpreter. The compilation runs
in a subprocess (tests/offline_compile.py says why).

Run as a script (`python tests/test_sm90_compile.py`) it prints each
configuration's wgmma instructions, registers per thread and stack frame
(spills show there), read from the cubin with the cuobjdump Triton ships.
"""

import re

from offline_compile import compile_configs, compile_in_subprocess, count_matches, script_main

# (name, policy string, compile_sm90 keyword arguments)
CONFIGS = [
    ("hopper_input_pv_causal", "hopper_input_pv", {"is_causal": True}),
    ("hopper_fp8pv_boolmask_fp16_d64", "hi=none,lo=mxfp8_e4m3,mx=folded,pv=fp8",
     {"mask": "bool", "dtype": "float16", "head_dim": 64}),
    ("paper_folded_additive", "hi=mxfp8_e4m3,lo=mxfp4_e2m1,mx=folded", {"mask": "additive", "is_causal": True}),
    ("paper_exact", "paper", {}),
]
WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.f32\.(\w+)\.(\w+)")


def compile_all() -> dict:
    """Compile every configuration: target, wgmma operand types with counts, resources."""
    from dma_compile.kernels.attention_sm90 import compile_sm90

    return compile_configs(compile_sm90, CONFIGS, lambda ptx: {
        "wgmma": count_matches(WGMMA, ptx, key=lambda m: f"{m.group(1)}x{m.group(2)}")})


def test_sm90_ptx_uses_the_policies_tensor_cores():
    configs = compile_in_subprocess(__file__)["configs"]
    for name, info in configs.items():
        assert info["target"] == "sm_90a", (name, info["target"])
        assert info["cubin_bytes"] > 0, name

    def kinds(name):
        return set(configs[name]["wgmma"])

    # "none" sink/diagonal tiles and P·V on bf16 tensor cores, folded MXFP8 on e4m3 ones.
    assert kinds("hopper_input_pv_causal") == {"bf16xbf16", "e4m3xe4m3"}
    # fp16 inputs: "none" tiles in fp16; folded tiles and FP8 P·V in e4m3.
    assert kinds("hopper_fp8pv_boolmask_fp16_d64") == {"f16xf16", "e4m3xe4m3"}
    # Folded MXFP8 and MXFP4 both run as per-token e4m3; P·V in bf16.
    assert kinds("paper_folded_additive") == {"e4m3xe4m3", "bf16xbf16"}
    # Exact MX: values dequantized to bf16 by the quantization pass.
    assert kinds("paper_exact") == {"bf16xbf16"}


def _print_table(result: dict) -> None:
    from tabulate import tabulate

    rows = [[name, info["target"], ", ".join(f"{k} x{n}" for k, n in sorted(info["wgmma"].items())),
             info.get("reg", "?"), info.get("stack", "?")] for name, info in result["configs"].items()]
    print(f"Triton {result['triton']}: the sm90 kernel compiled for sm_90a")
    print(tabulate(rows, headers=["configuration", "target", "wgmma (A x B types)", "registers", "stack bytes"]))


if __name__ == "__main__":
    script_main(compile_all, _print_table)
