"""Shared by the target-compile tests: compile each configuration of a kernel
for its GPU, in a subprocess, and describe the result.

The rest of the test suite may have switched Triton to its interpreter
(TRITON_INTERPRET=1), which compiles nothing, so each compile test runs its
own file as a script in a fresh process without it and reads its JSON.
"""

import json
import os
import re
import subprocess
import sys


def compile_in_subprocess(script: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, script, "--json"], env=env, capture_output=True, text=True, timeout=540,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def count_matches(pattern: re.Pattern, text: str, key=lambda m: m.group(0)) -> dict[str, int]:
    counts: dict[str, int] = {}
    for match in pattern.finditer(text):
        counts[key(match)] = counts.get(key(match), 0) + 1
    return counts


def resources(cubin: bytes) -> dict:
    """Registers per thread, stack-frame bytes (spills show there), the
    local-memory loads and stores in the machine code (spills themselves),
    those inside the loops that issue the matmuls (`sass.matmul_loops`) and
    the ones that count against the kernel (`sass.counted_spills`), and
    its shared-memory instructions (layout conversions go through them),
    read with the cuobjdump Triton's wheel ships; empty where it has none."""
    from dma_compile.kernels import sass as sass_reader

    text = sass_reader.cuobjdump_output(cubin, "-res-usage")
    if text is None:
        return {}
    sass = sass_reader.disassemble(cubin)
    loops = sass_reader.matmul_loops(sass)
    found = {key: re.search(rf"{key}:(\d+)", text) for key in ("REG", "STACK")}
    return {**{key.lower(): int(m.group(1)) for key, m in found.items() if m},
            "local_loads": len(re.findall(r"\bLDL\b", sass)), "local_stores": len(re.findall(r"\bSTL\b", sass)),
            "loop_local_loads": sum(loop["local_loads"] for loop in loops),
            "loop_local_stores": sum(loop["local_stores"] for loop in loops),
            "loop_barriers": max((loop["barriers"] for loop in loops), default=0),
            "loop_index_shuffles": sum(loop["index_shuffles"] for loop in loops),
            "loop_max_chain": max((loop["max_chain"] for loop in loops), default=0),
            "loop_add_chain": max((loop["add_chain"] for loop in loops), default=0),
            "matmul_loops": len(loops), "counted_spills": sass_reader.counted_spills(sass),
            "shared_ops": len(re.findall(r"\b(?:LDS|STS|LDSM|STSM)\b", sass))}


def compile_configs(compile_fn, configs, describe) -> dict:
    """compile_fn(policy, **kwargs) for each (name, policy string, kwargs):
    per name the PTX target, cubin size, resources and describe(ptx)."""
    import triton

    from dma_compile import AttentionPolicy

    result = {"triton": triton.__version__, "configs": {}}
    for name, policy, kwargs in configs:
        kernel = compile_fn(AttentionPolicy.from_string(policy), **kwargs)
        ptx = kernel.asm["ptx"]
        result["configs"][name] = {
            "target": re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1),
            "cubin_bytes": len(kernel.asm["cubin"]),
            **resources(kernel.asm["cubin"]),
            **describe(ptx),
        }
    return result


def script_main(compile_all, print_table) -> None:
    """A compile test run as a script: JSON for compile_in_subprocess with --json, else a table."""
    compiled = compile_all()
    if "--json" in sys.argv:
        print(json.dumps(compiled))
    else:
        print_table(compiled)
