"""The Gluon Hopper kernel compiles for sm_90a into its intended machinery.

No GPU is needed (tests/offline_compile.py): CI compiles the kernel with the
Triton it installs for an explicit sm_90a target and checks, from the PTX and
the machine code, that it is warp-specialized with register reallocation
(`setmaxnreg`), synchronizes its roles through mbarriers, runs QK^T and P·V
as asynchronous wgmma on the tensor cores each policy names, and keeps the
state of its matmul loops in registers: no local-memory store inside them,
and at most one reload of a loop invariant per loop (ptxas reloads a
per-thread offset that way with Triton 3.9). Spills outside those loops (a
scalar reloaded once per tile of the persistent grid) are reported, not
failed. The consumers release stages and pass the ping-pong turn thread
by thread (`gluon_compat.arrive_per_thread`), so each matmul loop keeps
one warpgroup barrier (bar.sync), the one Triton puts before the first
mbarrier wait after an arrival; `mbarrier.arrive` would add one per
arrival (BENCHMARKS.md, 2026-12-07, fifth session). With FP8 P·V, P goes from
QK^T's accumulator to P·V's operand within each thread: no index shuffle
(SHFL.IDX) in any matmul loop. The softmax's row max and row sum are
pairwise trees, not one dependent chain per row (`sass.longest_chain`).

Run as a script (`python tests/test_sm90_gluon_compile.py`) it prints the
same per configuration.
"""

import re

from offline_compile import compile_configs, compile_in_subprocess, count_matches, script_main

# (name, policy string, compile_sm90_gluon keyword arguments)
CONFIGS = [
    ("hopper_input_pv_causal", "hopper_input_pv", {"is_causal": True}),
    ("hopper_fp8pv_fp16_d64", "hi=none,lo=mxfp8_e4m3,mx=folded,pv=fp8", {"dtype": "float16", "head_dim": 64}),
    ("paper_folded_causal", "hi=mxfp8_e4m3,lo=mxfp4_e2m1,mx=folded", {"is_causal": True}),
    ("all_mxfp8_fp8pv", "hi=mxfp8_e4m3,lo=mxfp8_e4m3,mx=folded,pv=fp8", {"is_causal": False}),
    # Q quantized in the kernel's prologue (a variant) rather than by the pass.
    ("hopper_q_prologue", "hi=none,lo=mxfp8_e4m3,mx=folded,pv=fp8", {"is_causal": True, "q_prologue": True}),
]
WGMMA = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m\d+n\d+k\d+\.f32\.(\w+)\.(\w+)")


def describe(ptx: str) -> dict:
    return {
        "wgmma": count_matches(WGMMA, ptx, key=lambda m: f"{m.group(1)}x{m.group(2)}"),
        "setmaxnreg": len(re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32", ptx)),
        "mbarrier_waits": len(re.findall(r"mbarrier\.try_wait", ptx)),
        "wgmma_waits": len(re.findall(r"wgmma\.wait_group\.sync\.aligned", ptx)),
        "tma_loads": len(re.findall(r"cp\.async\.bulk\.tensor", ptx)),
        "thread_arrivals": len(re.findall(r"cp\.async\.mbarrier\.arrive\.noinc", ptx)),
        "one_thread_arrivals": len(re.findall(r"\bmbarrier\.arrive\.shared", ptx)),
    }


def compile_all() -> dict:
    """Each configuration at the block width the kernel would run it with:
    the wide one, or the narrow one where the wide one spills in its matmul
    loops with this Triton (attention_sm90_gluon.default_block_n reads that
    off the launch)."""
    from dma_compile.kernels.attention_sm90_gluon import NARROW_BLOCK_N, WIDE_BLOCK_N, compile_sm90_gluon

    result = compile_configs(lambda p, **kw: compile_sm90_gluon(p, block_n=WIDE_BLOCK_N, **kw), CONFIGS, describe)
    for name, info in result["configs"].items():
        info["block_n"] = WIDE_BLOCK_N
        if info.get("counted_spills"):
            config = [c for c in CONFIGS if c[0] == name]
            narrow = compile_configs(lambda p, **kw: compile_sm90_gluon(p, block_n=NARROW_BLOCK_N, **kw),
                                     config, describe)["configs"][name]
            result["configs"][name] = {**narrow, "block_n": NARROW_BLOCK_N,
                                       "wide_spills": info["counted_spills"]}
    return result


def test_gluon_kernel_is_warp_specialized_async_and_spill_free():
    configs = compile_in_subprocess(__file__)["configs"]
    kinds = {name: set(info["wgmma"]) for name, info in configs.items()}
    for name, info in configs.items():
        assert info["target"] == "sm_90a", (name, info["target"])
        assert info["setmaxnreg"] >= 2, f"{name}: no register reallocation between the roles"
        assert info["mbarrier_waits"] > 0 and info["tma_loads"] > 0, f"{name}: no TMA + mbarrier pipeline"
        assert info["wgmma_waits"] > 0, f"{name}: wgmma not asynchronous"
        if "local_loads" in info:
            # The width the kernel runs: its matmul loops keep their state in
            # registers, and it is the wide one unless that spilled there.
            if info["matmul_loops"] == 0:
                assert info["local_loads"] == 0 and info["local_stores"] == 0, f"{name}: spills {info}"
            assert info["loop_local_stores"] == 0, f"{name}: spills in the matmul loops {info}"
            assert info["loop_local_loads"] <= info["matmul_loops"], f"{name}: reloads in the matmul loops {info}"
            assert info["block_n"] == 128 or info["wide_spills"] > 0, name
            # FP8 P reaches P·V without crossing threads (V^T in wgmma's key order).
            assert info["loop_index_shuffles"] == 0, f"{name}: values cross threads in the matmul loops {info}"
            # The row max and sum are pairwise trees (Triton 3.6: at most 14
            # deep); a thread's 16 or 32 scores of a row folded into one
            # accumulator chain 17-18 deep at 64 keys per block, 33-34 at 128.
            assert info["loop_max_chain"] < 16 and info["loop_add_chain"] < 16, f"{name}: {info}"
            assert info["loop_barriers"] <= 1, f"{name}: warpgroup barriers in the matmul loops {info}"
        assert info["thread_arrivals"] > 0 and info["one_thread_arrivals"] == 0, f"{name}: {info}"
    assert kinds["hopper_input_pv_causal"] == {"bf16xbf16", "e4m3xe4m3"}
    assert kinds["hopper_fp8pv_fp16_d64"] == {"f16xf16", "e4m3xe4m3"}
    assert kinds["paper_folded_causal"] == {"e4m3xe4m3", "bf16xbf16"}
    assert kinds["all_mxfp8_fp8pv"] == {"e4m3xe4m3"}
    assert kinds["hopper_q_prologue"] == {"bf16xbf16", "e4m3xe4m3"}


def _print_table(result: dict) -> None:
    from tabulate import tabulate

    rows = [[name, info["block_n"], ", ".join(f"{k} x{n}" for k, n in sorted(info["wgmma"].items())),
             info["setmaxnreg"],
             info["mbarrier_waits"], info.get("reg", "?"), info.get("stack", "?"),
             f"{info.get('local_loads', '?')}/{info.get('local_stores', '?')}",
             f"{info.get('loop_local_loads', '?')}/{info.get('loop_local_stores', '?')}",
             info.get("loop_barriers", "?"), f"{info.get('loop_max_chain', '?')}/{info.get('loop_add_chain', '?')}"]
            for name, info in result["configs"].items()]
    print(f"Triton {result['triton']}: the Gluon sm90 kernel compiled for sm_90a")
    print(tabulate(rows, headers=["configuration", "keys per block", "wgmma (A x B)", "setmaxnreg", "mbarrier waits",
                                  "registers", "stack", "LDL/STL", "in matmul loops", "bar.sync per loop",
                                  "max/add chain"]))


if __name__ == "__main__":
    script_main(compile_all, _print_table)
