"""The Gluon names that differ between the Triton versions we run on.

The H200 machines have Triton 3.6, CI installs the newest (3.9 today). 3.9
renamed the TMA copy builtins (`async_copy_global_to_shared` became
`async_load`) and `thread_barrier` (now `barrier`); everything else the
Gluon kernels use has one name in both.
Kernels import the names from here, never from Triton directly, so a rename
is mended in this file alone.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# 3.9: tma.async_load(desc, coord, barrier, result); 3.6: async_copy_global_to_shared, same arguments.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# 3.9: gl.barrier(); 3.6: gl.thread_barrier(). Both synchronize the warps of
# the calling partition of a warp-specialized kernel (a named barrier there).
thread_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

__all__ = [
    "TensorDescriptor", "fence_async_shared", "gl", "gluon", "mbarrier", "thread_barrier", "tma_load",
    "warpgroup_mma", "warpgroup_mma_wait",
]
