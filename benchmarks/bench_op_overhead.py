"""Host time per call of the `dma::attention` op path against stock SDPA, and
the latency of the first call at a new shape.

Each row times rounds of back-to-back calls and reports, per call, the CPU
time of the calling thread until the last call returns (the host time; the
fastest round, least disturbed by other load on the machine) and the wall
time until the device is done (median round). Rows interleave round by
round. Without a GPU (or with --device cpu) torch runs on one thread and
the shapes are tiny, so the time is the host path: the dispatcher,
validation, routing and, for decode-shaped queries, the stock SDPA the op
runs. On meta tensors only the dispatcher and validation run.

With --device cuda the kernel rows run the sm90 kernel at --shape (B, Hq,
Hkv, L, D), causal, default policy (and --input-pv), synchronizing after each
round; keep --calls small enough (default 100) that the launch queue never
fills, or the host time includes waiting for the GPU. The breakdown splits
the call: the op without the kernel path (dispatch, validation, routing), the
quantization launches and the attention launch, each replayed as a repeated
call replays them (`kernels.launch.Replay`) and through Triton's own launcher
(the first call of a signature, or every call with a mask). Then fresh
processes time their first call at --shape (to the result on the host): one
to warm Triton's cache, then warm-cache first calls with the default
configuration rule, after `dma_compile.warmup`, and with
DMA_COMPILE_AUTOTUNE=1. --out writes everything as JSON. --cprofile N
profiles N eager dma_attention calls at --shape and prints the functions
that took the most host time (with a GPU: where the 100 µs of a call go).

    python benchmarks/bench_op_overhead.py
    PYTHONPATH=. python benchmarks/bench_op_overhead.py --device cuda --out benchmarks/results/h200_op_overhead.json
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
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


def kernel_cases(shape, policy: AttentionPolicy, device, dtype) -> dict:
    """The kernel rows and the breakdown of one call at `shape` (causal, no mask)."""
    from dma_compile import ops
    from dma_compile.kernels import attention_sm90
    from dma_compile.kernels.launch import Replay

    full = qkv(shape, device, dtype)
    q, k, v = full
    label = "x".join(map(str, shape))
    op, text = torch.ops.dma.attention.default, policy.to_string()
    b, hq, hkv, length, d = shape
    dims = (b, hq, hkv, length, length, d, d)
    dma_attention(*full, is_causal=True, policy=policy)  # the first call records its launches
    replay = attention_sm90._replays.get(attention_sm90.signature(q, k, v, True, None, policy))
    if not isinstance(replay, Replay):
        raise RuntimeError(f"the call at {label} was not replayable")
    quantization = dataclasses.replace(replay, launches=replay.launches[:-1])
    attention = dataclasses.replace(replay, launches=replay.launches[-1:], zeroed_bytes=0)
    qi = attention_sm90.quantize_inputs(q, k, v, policy)
    scale = d ** -0.5

    class NoKernel:
        """ops.run replaced: what the op costs before the kernel path."""

        def __enter__(self):
            self.run, ops.run = ops.run, lambda plan, q, *args: q

        def __exit__(self, *exc):
            ops.run = self.run

    def op_without_kernel():
        with no_kernel:
            dma_attention(*full, is_causal=True, policy=policy)

    no_kernel = NoKernel()
    return {
        f"stock SDPA, causal {label}": lambda: F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True),
        f"dma_attention, causal {label}": lambda: dma_attention(*full, is_causal=True, policy=policy),
        f"torch.ops.dma.attention, causal {label}": lambda: op(*full, None, True, None, text, "auto"),
        "  dma_attention without the kernel path (dispatch, validation, routing)": op_without_kernel,
        f"  quantization launches, replayed ({len(replay.launches) - 1})": lambda: quantization.run(full),
        "  attention launch, replayed (1)": lambda: attention.run(full),
        "  sm90 path through Triton's launcher (no replay)":
            lambda: attention_sm90._attention(q, k, v, None, True, None, policy, None),
        "    quantization launches through Triton's launcher": lambda: attention_sm90.quantize_inputs(q, k, v, policy),
        "    attention launch through Triton's launcher":
            lambda: attention_sm90.attention_from_quantized(qi, dims, None, True, scale, policy),
    }


FIRST_CALL = """
import json, sys, time
start = time.perf_counter()
import torch
import dma_compile
from dma_compile import AttentionPolicy, dma_attention
b, hq, hkv, length, d = {shape}
policy = AttentionPolicy.from_string({policy!r})
q = torch.randn(b, hq, length, d, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(b, hkv, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
torch.cuda.synchronize()
ready = time.perf_counter()
warmup = 0.0
if {warmup}:
    dma_compile.warmup([(b, hq, hkv, length, d)], policy, masks=("causal",))
    warmup = time.perf_counter() - ready
    ready = time.perf_counter()
with torch.inference_mode():
    out = dma_attention(q, k, v, is_causal=True, policy=policy)
    out.float().sum().item()
first = time.perf_counter() - ready
print(json.dumps({{"first_call_s": first, "warmup_s": warmup, "process_s": time.perf_counter() - start}}))
"""


def first_call(shape, policy: AttentionPolicy, autotune: bool, warmup: bool) -> dict:
    """A fresh process's first call at `shape`: seconds to the result, and the warmup's."""
    env = dict(os.environ)
    env.pop("DMA_COMPILE_AUTOTUNE", None)
    if autotune:
        env["DMA_COMPILE_AUTOTUNE"] = "1"
    code = FIRST_CALL.format(shape=tuple(shape), policy=policy.to_string(), warmup=warmup)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def first_call_rows(shape, policy: AttentionPolicy) -> list[dict]:
    runs = [("warms Triton's cache (may compile)", False, False), ("warm cache, configuration by rule", False, False),
            ("warm cache, after dma_compile.warmup", False, True), ("autotuning on, warms its configurations", True, False),
            ("autotuning on, warm cache", True, False)]
    rows = []
    for name, autotune, warmup in runs:
        rows.append({"run": name, "autotune": autotune, **first_call(shape, policy, autotune, warmup)})
        print(rows[-1], file=sys.stderr)
    return rows


def profile_calls(shape, policy: AttentionPolicy, device, dtype, calls: int, sync) -> None:
    """cProfile of `calls` causal dma_attention calls at `shape` (after warm-up), top functions by own time."""
    import cProfile
    import pstats

    q, k, v = qkv(shape, device, dtype)
    with torch.inference_mode():
        for _ in range(10):
            dma_attention(q, k, v, is_causal=True, policy=policy)
        sync()
        profiler = cProfile.Profile()
        for start in range(0, calls, 100):  # sync every 100 calls: the launch queue must not fill
            profiler.enable()
            for _ in range(min(100, calls - start)):
                dma_attention(q, k, v, is_causal=True, policy=policy)
            profiler.disable()
            sync()
    print(f"\ncProfile of {calls} dma_attention calls at {'x'.join(map(str, shape))} (top 30 by own time):")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", type=int, nargs=5, default=(1, 32, 8, 1024, 128), metavar=("B", "HQ", "HKV", "L", "D"))
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--input-pv", action="store_true",
                        help="time the default policy with P·V in the input dtype too")
    parser.add_argument("--no-first-call", action="store_true", help="skip the fresh-process first-call runs")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N",
                        help="also profile N eager dma_attention calls at --shape and print the top functions")
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
    policies = [policy, policy.replace(pv="input")] if args.input_pv else [policy]
    with torch.inference_mode():
        if device.type == "cuda":
            for i, pol in enumerate(policies):
                rows = kernel_cases(tuple(args.shape), pol, device, dtype)
                cases.update({(f"[pv=input] {name}" if i else name): fn for name, fn in rows.items()})
        times = per_call_us(cases, args.calls, args.rounds, sync)
    rows = [[name, f"{host:.1f}", f"{wall:.1f}"] for name, (host, wall) in times.items()]
    print(f"device {device}, torch {torch.__version__}, {args.rounds} rounds of {args.calls} calls, policy {text}")
    print(tabulate(rows, headers=["call", "host CPU µs/call", "wall µs/call"], tablefmt="github"))
    if args.cprofile:
        profile_calls(tuple(args.shape), policy, device, dtype, args.cprofile, sync)
    first = []
    if device.type == "cuda" and not args.no_first_call:
        first = first_call_rows(args.shape, policy)
        print(f"\nfirst call at {'x'.join(map(str, args.shape))} in a fresh process (s):")
        print(tabulate([[r["run"], f"{r['first_call_s']:.3f}", f"{r['warmup_s']:.3f}", f"{r['process_s']:.2f}"]
                        for r in first], headers=["run", "first call", "warmup", "whole process"], tablefmt="github"))
    if args.out:
        import triton

        with open(args.out, "w") as f:
            json.dump({
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__, "triton": triton.__version__, "command": " ".join(sys.argv),
                "shape": list(args.shape), "policy": text,
                "rows": [{"call": name, "host_us": host, "wall_us": wall} for name, (host, wall) in times.items()],
                "first_call": first,
            }, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
