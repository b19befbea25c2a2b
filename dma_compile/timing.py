"""GPU timing: the median CUDA time of a call, through CUDA graphs where it can.

Calibration (measured per-format rates), comparison (part (c), the speed
table) and the benchmarks time their calls with `cuda_time_ms`.
"""

from __future__ import annotations

import torch


def _syncs_with_host(fn) -> bool:
    """Whether fn() synchronizes the host with the GPU (an `.item()`, a copy to
    the CPU), which a CUDA graph cannot capture. Found by running it under
    PyTorch's sync debug mode rather than by a failed capture: a failed
    capture leaves the device's random generator in capture mode, and every
    later random op in the process then fails."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError:
        return True
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    return False


def cuda_time_ms(fn, repeats: int = 20, graph: bool = True) -> float:
    """Median CUDA time of `fn()` in milliseconds, after three warm-up calls.

    graph: time replays of `fn` captured in a CUDA graph, i.e. the GPU's time
    alone. A small attention call spends longer in the host's launches (about
    0.35 ms for the sm90 path's four or five) than on the GPU, so direct timing would
    rank policies by their launch counts. A `fn` that synchronizes with the
    host cannot be captured and is timed directly; graph=False times direct
    calls, host work included.
    """
    # Warm-up (compiles, autotunes, allocates) off the default stream where a capture follows, as capture needs.
    warm_stream = torch.cuda.Stream() if graph else torch.cuda.current_stream()
    warm_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm_stream):
        for _ in range(2):
            fn()
        # The third warm-up call, checked for host synchronization where a capture would follow.
        capture = graph and not _syncs_with_host(fn)
        if not graph:
            fn()
    torch.cuda.current_stream().wait_stream(warm_stream)
    torch.cuda.synchronize()
    run = fn
    if capture:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            fn()
        run = captured.replay
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
