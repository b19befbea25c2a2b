"""The Gluon names that differ between the Triton versions we run on.

The H200 machines have Triton 3.6, CI installs the newest (3.9 today). 3.9
renamed the TMA copy builtins (`async_copy_global_to_shared` became
`async_load`) and `thread_barrier` (now `barrier`); everything else the
Gluon kernels use has one name in both.
Kernels import the names from here, never from Triton directly, so a rename
is mended in this file alone. It also holds `arrive_per_thread`, the
mbarrier arrival that both versions spell through the Ampere copy module.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere.async_copy import mbarrier_arrive as _cp_async_arrive
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


@gluon.jit
def arrive_per_thread(bar):
    """One arrival on bar from every calling thread, with no barrier among
    them: `cp.async.mbarrier.arrive.noinc` (the thread has no copies in
    flight, so it arrives at once). Both versions' `mbarrier.arrive` is one
    thread's arrival after a barrier across the calling warps."""
    _cp_async_arrive(bar, increment_count=False)


__all__ = [
    "TensorDescriptor", "arrive_per_thread", "fence_async_shared", "gl", "gluon", "mbarrier", "thread_barrier",
    "tma_load", "warpgroup_mma", "warpgroup_mma_wait",
]
