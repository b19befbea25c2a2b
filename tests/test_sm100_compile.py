"""The Blackwell kernel compiles for sm_100 to block-scaled tensor-core MMAs.

No B200 is needed: `compile_sm100` runs Triton's real compiler (and the
ptxas its wheel ships) for an explicit sm_100 target. The compilation runs in
a subprocess (tests/offline_compile.py says why).

Run as a script (`python tests/test_sm100_compile.py`) it prints a table of
the tensor-core MMA instructions in each configuration's PTX.
"""

import re

from offline_compile import compile_configs, compile_in_subprocess, count_matches, script_main

# (name, policy string, compile_sm100 keyword arguments)
CONFIGS = [
    ("paper", "paper", {}),
    ("mxfp8_fp8pv_causal", "hi=mxfp8_e5m2,lo=mxfp8_e4m3,pv=fp8", {"is_causal": True}),
    ("none_mxfp4_boolmask_fp16", "hi=none,lo=mxfp4_e2m1", {"mask": "bool", "dtype": "float16", "head_dim": 64}),
    ("folded_additive", "hopper_input_pv", {"mask": "additive"}),
]
MMA = re.compile(r"\btcgen05\.mma\.cta_group::[12]\.kind::[\w.:]+")


def compile_all() -> dict:
    """Compile every configuration; per name, the tcgen05.mma variants with counts."""
    from dma_compile.kernels.attention_sm100 import block_scaled_mma_instructions, compile_sm100

    return compile_configs(compile_sm100, CONFIGS, lambda ptx: {
        "mma": count_matches(MMA, ptx), "block_scaled": block_scaled_mma_instructions(ptx)})


def test_sm100_ptx_uses_block_scaled_tensor_cores():
    result = compile_in_subprocess(__file__)
    configs = result["configs"]
    for name, info in configs.items():
        assert info["target"].startswith("sm_100"), (name, info["target"])
        assert info["cubin_bytes"] > 0, name

    def kinds(name, block_scaled):
        table = configs[name]["block_scaled" if block_scaled else "mma"]
        return {re.search(r"kind::(\w+)", k).group(1) for k in table}

    # MXFP8 (e4m3) sink/diagonal tiles and MXFP4 (e2m1) middle tiles, E8M0 scales per 32 elements.
    assert kinds("paper", True) == {"mxf8f6f4", "mxf4"}
    # E5M2/E4M3 on the mxf8f6f4 kind; FP8 P·V on plain (unscaled) fp8 tensor cores.
    assert kinds("mxfp8_fp8pv_causal", True) == {"mxf8f6f4"}
    assert "f8f6f4" in kinds("mxfp8_fp8pv_causal", False)
    # "none" high tiles on 16-bit tensor cores, MXFP4 middle tiles block-scaled.
    assert kinds("none_mxfp4_boolmask_fp16", True) == {"mxf4"}
    assert "f16" in kinds("none_mxfp4_boolmask_fp16", False)
    # Folded MX runs per-token fp8: no block scales.
    assert kinds("folded_additive", True) == set()
    assert kinds("folded_additive", False) == {"f16", "f8f6f4"}


def _print_table(result: dict) -> None:
    from tabulate import tabulate

    rows = []
    for name, info in result["configs"].items():
        for instr, count in sorted(info["mma"].items()):
            rows.append([name, info["target"], instr, count])
    print(f"Triton {result['triton']}: tcgen05.mma instructions in the sm_100 PTX")
    print(tabulate(rows, headers=["configuration", "target", "instruction", "count"]))


if __name__ == "__main__":
    script_main(compile_all, _print_table)
