"""GPU time of each launch in one DMA prefill call, against stock SDPA's.

Runs `dma_attention` and stock SDPA (cuDNN where it serves) on the same
inputs under `torch.profiler` and prints, per shape and policy, every CUDA
kernel of the call with its time per call: where the quantization pass's
time goes (statistics, token passes, rotation) next to the attention
kernel's. Q comes in transformers' (B, L, H, D) memory layout, K and V as a
DynamicCache holds them.

    python benchmarks/profile_launches.py
    python benchmarks/profile_launches.py --shapes 1,32,8,16384,128 --policies hopper:none hopper:signed_hadamard
    python benchmarks/profile_launches.py --pass-launches rule fewest    # the pass's launch layouts side by side

--pass-launches (`attention_sm90.pass_launches`): `rule` keeps
`FEWEST_LAUNCHES_BELOW` and `Q_BESIDE_STATISTICS_BELOW`; `fewest` puts Q's
programs in the statistics launch and V's in K's token launch at every
size, `most` gives each its own launch (Q too, without FP8 P·V).
"""

from __future__ import annotations

import argparse
import collections

import torch
import torch.nn.functional as F
from tabulate import tabulate
from torch.profiler import ProfilerActivity, profile

from dma_compile import AttentionPolicy, dma_attention
from dma_compile.kernels.attention_sm90 import PASS_LAUNCH_LAYOUTS, pass_launches


def kernel_times(fn, calls: int) -> dict[str, tuple[float, float]]:
    """{kernel name: (µs per call, launches per call)} of fn, under the profiler."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total, count = collections.defaultdict(float), collections.Counter()
    for event in prof.events():
        if event.device_type.name == "CUDA":
            total[event.name] += event.device_time_total
            count[event.name] += 1
    return {name: (total[name] / calls, count[name] / calls) for name in total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["1,32,8,16384,128", "1,32,32,16384,128", "4,32,32,4096,128"],
                        help="B,Hq,Hkv,S,D (causal)")
    parser.add_argument("--policies", nargs="+",
                        default=["hopper:none", "hopper:signed_hadamard", "hopper_input_pv:none", "paper:none",
                                 "paper:signed_hadamard"],
                        help="preset:rotation")
    parser.add_argument("--pass-launches", nargs="+", choices=list(PASS_LAUNCH_LAYOUTS), default=["rule"])
    parser.add_argument("--calls", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_launches.py needs a CUDA GPU")
    for shape in args.shapes:
        b, hq, hk, s, d = (int(x) for x in shape.split(","))
        torch.manual_seed(0)
        q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16)
        sdpa = kernel_times(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                            args.calls)
        sdpa_us = sum(t for t, _ in sdpa.values())
        for spec, layout in ((spec, layout) for spec in args.policies for layout in args.pass_launches):
            preset, _, rotation = spec.partition(":")
            policy = AttentionPolicy.preset(preset).replace(rotate=rotation or "none")
            with pass_launches(layout):
                times = kernel_times(lambda: dma_attention(q, k, v, is_causal=True, policy=policy), args.calls)
            total = sum(t for t, _ in times.values())
            rows = [[f"{t:.1f}", f"{n:g}", name[:80]] for name, (t, n) in sorted(times.items(), key=lambda x: -x[1][0])]
            rows.append([f"{total:.1f}", "", f"total (stock SDPA: {sdpa_us:.1f} µs, {sdpa_us / total:.3f}x)"])
            print(f"\nB{b} H{hq}/{hk} S{s} D{d} causal, {preset}, rotate={policy.rotate}, pass launches: {layout}")
            print(tabulate(rows, headers=["µs per call", "launches", "kernel"]))


if __name__ == "__main__":
    main()
