"""Compile a Triton kernel for a named NVIDIA GPU on any machine, GPU or not.

Triton's compiler and the ptxas its wheel ships need no GPU when the target is
named, so CI (no GPU, possibly a newer Triton than the GPU machines) can check
that a kernel still compiles for Hopper or Blackwell and which tensor-core
instructions it uses. `compile_for_target` gives the kernel the signature and
specialisations a launch with the same arguments would.
"""

from __future__ import annotations

import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from dma_compile.kernels.launch import LAUNCH_OPTIONS
from dma_compile.kernels.numerics import INTERPRET

# Triton's names of the pointer element types the kernels take.
POINTER_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.float64: "*fp64",
    torch.float8_e4m3fn: "*fp8e4nv",
    torch.uint8: "*u8",
    torch.int32: "*i32",
}


def compile_for_target(kernel, args: dict, capability: int, num_warps: int, num_stages: int,
                       extra_options: dict | None = None, gluon: bool = False):
    """Compile `kernel` (a @triton.jit function, or @gluon.jit with gluon=True)
    for CUDA compute capability `capability` (90: H100/H200, 100: B200) with
    the launch arguments `args` (by parameter name; constexpr parameters left
    out take their defaults) and compile options `extra_options` (e.g.
    maxnreg). Returns Triton's compiled kernel: `.asm` holds "ttgir", "ptx"
    and "cubin"."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource

    if INTERPRET:
        raise RuntimeError("compiling for a target needs TRITON_INTERPRET unset: the interpreter compiles nothing")
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        name = param.name
        value = args[name] if name in args else param.default
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[value.dtype]
            # Torch allocations are 16-byte aligned: a launch specialises on that.
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif type(value).__name__ == "TensorDescriptor":  # Triton's or Gluon's host descriptor
            signature[name] = mangle_type(value)
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            # A launch turns integer arguments equal to 1 into constants.
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages, **LAUNCH_OPTIONS, **(extra_options or {})}
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
