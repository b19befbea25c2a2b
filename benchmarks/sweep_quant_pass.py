"""Launch configurations of the quantization pass's launches, timed.

Token pass: times `kernels.quantize._quantize_tokens_kernel` as the hopper
policy's prefill launches it, for Q in transformers' (B, L, H, D) memory layout and
for K contiguous with smoothing, at each tokens-per-program / warps pair of
a grid, with and without rotation, in one run with CUDA graphs. Every
configuration's output is first compared bit for bit with the default
plan's (`_token_block`); the speed of light is the pass's bytes (bf16 in,
e4m3 codes, exponents and scales out) at the GPU's DRAM bandwidth, which
the table reports as achieved GB/s.

Statistics pass: times `kernels.quantize.kv_statistics` (K's mean and V's
scales in one launch, as the hopper policy asks) for each elements-per-step /
programs / warps of a grid (`_stats_chunking`), each checked bit for bit
against the default launch's results first.

    python benchmarks/sweep_quant_pass.py --shape 1 32 8 16384 128 --out sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
from tabulate import tabulate
from tqdm import tqdm

from dma_compile.kernels.quantize import kv_statistics, launch_tokens, plan_tokens
from dma_compile.policy import AttentionPolicy


def bench(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1000.0


def launcher(plan, block_t: int | None, warps: int):
    return lambda: launch_tokens(plan, block_t, warps)


def outputs(plan) -> list[torch.Tensor]:
    return [t for op in plan.operands.values() for t in (op.values, op.exponents, op.scales) if t is not None]


def pass_bytes(x: torch.Tensor) -> int:
    b, h, length, d = x.shape
    return b * h * length * (d * (x.element_size() + 1) + 8)


def statistics_rows(k: torch.Tensor, v: torch.Tensor, steps: list[int], programs: list[int], warps: list[int]) -> list:
    """One row per statistics launch configuration (None: the default)."""
    grid = [None, *itertools.product(steps, programs, warps)]
    expected = kv_statistics(k, v, True, True)
    total = k.numel() * k.element_size() + v.numel() * v.element_size()
    rows = []
    for config in tqdm(grid, desc="statistics configs"):
        step, progs, w = config or ("default", "default", 4)
        chunking = None if config is None else dict(step_elements=step, programs=progs)

        def run(chunking=chunking, w=w):
            return kv_statistics(k, v, True, True, chunking=chunking, num_warps=w)

        stats = run()
        for name in ("key_mean", "value_exponents", "value_scales"):
            if not torch.equal(getattr(stats, name), getattr(expected, name)):
                raise SystemExit(f"statistics {config}: {name} differ from the default launch's")
        us = bench(run)
        rows.append(dict(default=config is None, step_elements=step, programs=progs, warps=w, us=us, gb_s=total / us / 1e3))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=5, default=[1, 32, 8, 16384, 128], metavar=("B", "HQ", "HKV", "L", "D"))
    parser.add_argument("--block-t", type=int, nargs="+", default=[16, 32, 64, 128], help="tokens per program")
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--rotate", nargs="+", default=["none", "signed_hadamard"])
    parser.add_argument("--parts", nargs="+", default=["tokens", "stats"], choices=["tokens", "stats"])
    parser.add_argument("--stats-steps", type=int, nargs="+", default=[1024, 2048, 4096],
                        help="statistics pass: elements of K (and of V) per loop step")
    parser.add_argument("--stats-programs", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                        help="statistics pass: programs aimed at")
    parser.add_argument("--stats-warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_quant_pass.py needs a CUDA GPU")
    b, hq, hkv, n, d = args.shape
    torch.manual_seed(0)
    q = torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16)
    mean = k.float().mean(dim=2)
    policy = AttentionPolicy.hopper()
    formats = ("mxfp8_e4m3",)
    rows = []
    grid = list(itertools.product(args.rotate, [None, *args.block_t], args.warps)) if "tokens" in args.parts else []
    for rotate, block_t, warps in tqdm(grid, desc="token pass configs"):
        if block_t is None and warps != 4:
            continue
        times = {}
        for name, x, m in (("q", q, None), ("k", k, mean)):
            plan = plan_tokens(x, formats, policy.mx_mode, policy.scale_rule, mean=m, pow2_scales=True, rotate=rotate)
            launcher(plan, None, 4)()
            expected = [t.clone() for t in outputs(plan)]
            run = launcher(plan, block_t, warps)
            for t in outputs(plan):
                t.zero_()
            run()
            same = all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                   e.view(torch.uint8) if e.dtype == torch.float8_e4m3fn else e)
                       for a, e in zip(outputs(plan), expected))
            if not same:
                raise SystemExit(f"{name} rotate={rotate} block_t={block_t} warps={warps}: output differs from the default plan's")
            times[name] = bench(run)
        total_bytes = pass_bytes(q) + pass_bytes(k)
        rows.append(dict(rotate=rotate, block_t=block_t or plan.args["BLOCK_T"], default=block_t is None, warps=warps,
                         q_us=times["q"], k_us=times["k"], total_us=times["q"] + times["k"],
                         gb_s=total_bytes / (times["q"] + times["k"]) / 1e3))
    if rows:
        print_token_rows(rows, args.shape)
    stats = statistics_rows(k, torch.randn_like(k), args.stats_steps, args.stats_programs, args.stats_warps) \
        if "stats" in args.parts else []
    if stats:
        print_statistics_rows(stats, args.shape)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(shape=args.shape, device=torch.cuda.get_device_name(), token_rows=rows, statistics_rows=stats),
                      f, indent=1)


def print_token_rows(rows: list, shape: list[int]) -> None:
    b, hq, hkv, n, d = shape
    base = {r["rotate"]: r["total_us"] for r in rows if r["default"]}
    table = [[r["rotate"], r["block_t"], r["warps"], "yes" if r["default"] else "", f"{r['q_us']:.1f}", f"{r['k_us']:.1f}",
              f"{r['total_us']:.1f}", f"{r['gb_s']:.0f}", f"{base[r['rotate']] / r['total_us']:.2f}x"] for r in rows]
    print(f"\nB{b} H{hq}/{hkv} S{n} D{d}, hopper policy, {torch.cuda.get_device_name()}")
    print(tabulate(table, headers=["rotate", "tokens/program", "warps", "default", "Q us", "K us", "Q+K us", "GB/s",
                                   "vs default"]))


def print_statistics_rows(stats: list, shape: list[int]) -> None:
    b, hq, hkv, n, d = shape
    base_us = stats[0]["us"]
    print(f"\nStatistics pass (K mean, V scales), B{b} H{hkv} S{n} D{d}")
    print(tabulate([[r["step_elements"], r["programs"], r["warps"], "yes" if r["default"] else "", f"{r['us']:.1f}",
                     f"{r['gb_s']:.0f}", f"{base_us / r['us']:.2f}x"] for r in stats],
                   headers=["elements/step", "programs", "warps", "default", "us", "GB/s", "vs default"]))


if __name__ == "__main__":
    main()
