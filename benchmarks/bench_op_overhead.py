"""Host time per call of the `dma::attention` op path against stock SDPA.

Each row times rounds of back-to-back calls and reports, per call, the CPU
time of the calling thread until the last call returns (the host time; the
fastest round, least disturbed by other load on the machine) and the wall
time until the device is done (median round). Rows interleave round by
round. Without a GPU (or with --device cpu) torch runs on one thread and
the shapes are tiny, so the time is the host path: the dispatcher,
validation, routing and, for decode-shaped queries, the stock SDPA the op
runs. On meta tensors only the dispatcher and validation run. With --device
cuda the kernel rows run the DMA kernel at --shape (B, Hq, Hkv, L, D),
synchronizing after each round; keep --calls small enough (default 100) that
the launch queue never fills, or the host time includes waiting for the GPU.

    python benchmarks/bench_op_overhead.py
    python benchmarks/bench_op_overhead.py --device cuda --shape 1 32 8 1024 128
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from tabulate import tabulate

import dma_compile  # noqa: F401  (registers torch.ops.dma.attention)
from dma_compile import AttentionPolicy, dma_attention


def per_call_us(cases: dict, calls: int, rounds: int, sync) -> dict[str, tuple[float, float]]:
    """Per case (host CPU time: fastest round, wall time: median round), µs per call."""
    for fn in cases.values():
        for _ in range(10):
            fn()
    sync()
    host = {name: [] for name in cases}
    wall = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            start, start_cpu = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                fn()
            host[name].append((time.thread_time() - start_cpu) / calls * 1e6)
            sync()
            wall[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: (min(host[name]), statistics.median(wall[name])) for name in cases}


def qkv(shape, device, dtype, lq=None):
    b, hq, hkv, length, d = shape
    q = torch.randn(b, hq, lq or length, d, device=device, dtype=dtype)
    return q, torch.randn(b, hkv, length, d, device=device, dtype=dtype), torch.randn(b, hkv, length, d, device=device, dtype=dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", type=int, nargs=5, default=None, metavar=("B", "HQ", "HKV", "L", "D"))
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cpu":
        torch.set_num_threads(1)
    policy = AttentionPolicy.hopper() if device.type == "cuda" else AttentionPolicy()
    text = policy.to_string()
    op = torch.ops.dma.attention.default

    decode = qkv((1, 8, 2, 64, 128), device, dtype, lq=1)
    meta = qkv((1, 8, 2, 64, 128), "meta", dtype)
    cases = {
        "stock SDPA, decode query (1x8/2x1x64x128)": lambda: F.scaled_dot_product_attention(*decode, enable_gqa=True),
        "torch.ops.dma.attention, decode query (runs SDPA)": lambda: op(*decode, None, False, None, text, "auto"),
        "dma_attention, decode query (runs SDPA)": lambda: dma_attention(*decode, policy=policy),
        "torch.ops.dma.attention on meta tensors (dispatch + checks)": lambda: op(*meta, None, True, None, text, "auto"),
    }
    if device.type == "cuda":
        shape = tuple(args.shape or (1, 32, 8, 1024, 128))
        full = qkv(shape, device, dtype)
        label = "x".join(map(str, shape))
        cases[f"stock SDPA, causal {label}"] = lambda: F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
        cases[f"torch.ops.dma.attention, causal {label} (kernel)"] = lambda: op(*full, None, True, None, text, "auto")
        cases[f"dma_attention, causal {label} (kernel)"] = lambda: dma_attention(*full, is_causal=True, policy=policy)

    with torch.inference_mode():
        times = per_call_us(cases, args.calls, args.rounds, sync)
    rows = [[name, f"{host:.1f}", f"{wall:.1f}"] for name, (host, wall) in times.items()]
    print(f"device {device}, torch {torch.__version__}, {args.rounds} rounds of {args.calls} calls")
    print(tabulate(rows, headers=["call", "host CPU µs/call", "wall µs/call"], tablefmt="github"))


if __name__ == "__main__":
    main()
