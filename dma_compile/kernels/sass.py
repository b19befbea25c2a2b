"""Reading a compiled kernel's machine code (SASS): where it spills registers.

ptxas reports one spill count for a whole kernel, but a spill outside the
loops that issue the matmuls (a scalar reloaded once per tile) costs nothing
measurable, while one inside them costs every iteration. This module finds
those loops in the SASS that `cuobjdump` (shipped in Triton's wheel) prints
and counts the local-memory loads and stores in them. Used by the Gluon
kernel's choice of block width and by the offline compile tests.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile

_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
_BRANCH = re.compile(r"\bBRA\s+`?\(?0x([0-9a-f]+)")
_WGMMA = r"\b[HQI]GMMA\b"


@functools.lru_cache(maxsize=None)
def cuobjdump() -> str | None:
    """The cuobjdump of the installed Triton, None where it ships none."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return tool if os.path.isfile(tool) else None


def cuobjdump_output(cubin: bytes, option: str) -> str | None:
    """What `cuobjdump option` prints for a cubin, None without cuobjdump."""
    tool = cuobjdump()
    if tool is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, option, f.name], capture_output=True, text=True, check=True).stdout


def disassemble(cubin: bytes) -> str | None:
    """The SASS of a cubin, None without cuobjdump."""
    return cuobjdump_output(cubin, "--dump-sass")


def _instructions(sass: str) -> list[tuple[int, str]]:
    return [(int(m.group(1), 16), m.group(2)) for m in map(_INSTRUCTION.match, sass.splitlines()) if m]


def matmul_loops(sass: str) -> list[dict]:
    """The innermost loops that issue warpgroup matmuls (HGMMA for 16-bit
    operands, QGMMA for FP8, IGMMA for integers), each as
    its address range and the matmuls, local loads (LDL), local stores
    (STL), thread-block barriers (BAR.SYNC) and index shuffles (SHFL.IDX:
    values moving between threads, as a layout conversion does) in it, and
    its longest chains of dependent float maxima and additions
    (`longest_chain`: the softmax's row reductions).

    A loop is a backward branch and the code it jumps back over. Branches
    placed after the last EXIT are ptxas's out-of-line retry paths of
    mbarrier waits, not loops, and are left out."""
    code = _instructions(sass)
    exits = [addr for addr, text in code if re.search(r"\bEXIT\b", text)]
    last_exit = max(exits) if exits else max((addr for addr, _ in code), default=0)
    loops = []
    for addr, text in code:
        m = _BRANCH.search(text)
        if m and addr <= last_exit and int(m.group(1), 16) <= addr:
            loops.append((int(m.group(1), 16), addr))

    def body(lo, hi):
        return [text for addr, text in code if lo <= addr <= hi]

    def count(texts, pattern):
        return sum(1 for text in texts if re.search(pattern, text))

    with_mma = [(lo, hi) for lo, hi in loops if count(body(lo, hi), _WGMMA)]
    innermost = [(lo, hi) for lo, hi in with_mma
                 if not any((a, b) != (lo, hi) and lo <= a and b <= hi for a, b in with_mma)]
    found = []
    for lo, hi in sorted(set(innermost)):
        texts = body(lo, hi)
        found.append({"start": lo, "end": hi, "matmuls": count(texts, _WGMMA),
                      "local_loads": count(texts, r"\bLDL\b"), "local_stores": count(texts, r"\bSTL\b"),
                      "barriers": count(texts, r"\bBAR\.SYNC\b"), "index_shuffles": count(texts, r"\bSHFL\.IDX\b"),
                      "max_chain": longest_chain(texts, "FMNMX"), "add_chain": longest_chain(texts, "FADD")})
    return found


_OPERANDS = re.compile(r"^(?:@!?U?P\w+\s+)?([A-Z0-9]+)(?:\.[A-Z0-9_.]+)?\s+(.*)$")
_REGISTER = re.compile(r"\bR(\d+)\b")


def longest_chain(instructions: list[str], opcode: str) -> int:
    """The most `opcode` instructions (e.g. FMNMX) in straight-line order
    of which each reads the one before's result: how deep a reduction's
    dependences go. A row max folded into one accumulator is a chain as long
    as the row; a pairwise tree is log2 of it. Instructions are read in
    address order, so both sides of a branch count as one sequence (a
    register another instruction writes starts a new chain)."""
    depth: dict[str, int] = {}
    longest = 0
    for text in instructions:
        m = _OPERANDS.match(text.strip())
        if not m:
            continue
        operands = m.group(2)
        regs = _REGISTER.findall(operands)
        # A store's first operand is an address: it writes no register.
        if not regs or operands.lstrip().startswith("["):
            continue
        dest, sources = regs[0], regs[1:]
        if m.group(1) == opcode:
            depth[dest] = 1 + max((depth.get(r, 0) for r in sources), default=0)
            longest = max(longest, depth[dest])
        else:
            depth[dest] = 0
    return longest


def counted_spills(sass: str) -> int:
    """The spills that count against a kernel: the local loads and stores
    inside its matmul loops, or all of them where no such loop is identified."""
    loops = matmul_loops(sass)
    if not loops:
        return len(re.findall(r"\b(?:LDL|STL)\b", sass))
    return sum(loop["local_loads"] + loop["local_stores"] for loop in loops)
