"""Where generate() spends GPU time: the kernels of one prefill and of the decode steps, per variant.

    PYTHONPATH=. python3 benchmarks/profile_generate.py --modes compiled --prompt-len 4096
    PYTHONPATH=. python3 benchmarks/profile_generate.py --tiny            # CPU smoke run

Builds `bench_generate`'s Llama-3-8B-shaped model and sets each variant up as
it does (eager or compiled with mode="reduce-overhead" on a StaticCache).
After two untimed generate() calls, times one (time to first token, decode
time per token, Python's garbage collections meanwhile) and profiles another (torch.profiler, CUDA kernels inside
CUDA graphs included). Prints, per variant and for the prefill and the
decode steps apart (the latter as the whole call's kernels less a
one-token call's): the kernels that took the most GPU time with their
launch counts (a kernel that runs once per layer and step shows layers x
steps), the GPU time, the caching allocator's calls to
the driver (cudaMalloc/cudaFree), and the CUDA graph trees' skip counters
(a decode graph that is not captured pays every launch on the host).
"""

from __future__ import annotations

import argparse
import collections
import gc
import time

import torch
from tabulate import tabulate

import bench_generate as bg


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--variants", default="sdpa,dma", help="subset of sdpa,dma,dma-input-pv")
    parser.add_argument("--modes", default="compiled", help="subset of eager,compiled")
    parser.add_argument("--top", type=int, default=12, help="kernels listed per variant")
    parser.add_argument("--host", type=int, default=0, help="also list this many host-side entries by self CPU time")
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)
    args.variants, args.modes = args.variants.split(","), args.modes.split(",")
    for name, given, known in (("--variants", args.variants, bg.VARIANT_NAMES), ("--modes", args.modes, bg.MODES)):
        if set(given) - set(known):
            parser.error(f"{name}: unknown {sorted(set(given) - set(known))}; accepted: {', '.join(known)}")
    if args.new_tokens < 2 or args.layers < 1 or args.prompt_len < 1:
        parser.error("--new-tokens must be at least 2, --layers and --prompt-len positive")
    if args.tiny:
        args.layers, args.prompt_len, args.new_tokens = 2, 64, 4
    return args


class GcClock:
    """Collections of Python's garbage collector and their time while active (`with GcClock() as gc_clock:`)."""

    def __enter__(self):
        self.count, self.full, self.seconds, self._start = 0, 0, 0.0, None
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._note)

    def _note(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.count += 1
            self.full += info["generation"] == 2
            self.seconds += time.perf_counter() - self._start

    def __str__(self) -> str:
        return f"{self.count} collections ({self.full} full) {self.seconds * 1e3:.1f} ms, {len(gc.get_objects())} objects"


def allocator_calls(prof) -> str:
    """How often and how long the CUDA caching allocator went to the driver (cudaMalloc / cudaFree)."""
    calls = collections.Counter()
    times = collections.Counter()
    for event in prof.events():
        if event.name in ("cudaMalloc", "cudaFree"):
            calls[event.name] += 1
            times[event.name] += event.cpu_time_total
    return ", ".join(f"{name} {calls[name]}x {times[name] / 1e3:.1f} ms" for name in sorted(calls)) or "none"


def kernel_times(prof) -> tuple[collections.Counter, collections.Counter]:
    """GPU µs and launches per kernel name."""
    times, counts = collections.Counter(), collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] += event.device_time
            counts[event.name] += 1
    return times, counts


def kernel_table(times: collections.Counter, counts: collections.Counter, top: int) -> tuple[list[list], float]:
    """The `top` kernels by GPU time as rows (name, launches, total µs), and the total GPU µs."""
    total = sum(times.values())
    rows = [[name[:90], counts[name], f"{us:.0f}", f"{us / max(total, 1e-9):.1%}"] for name, us in times.most_common(top)]
    return rows, total


def profiled(fn, activities, device) -> tuple:
    """(profile, wall seconds) of fn() run under torch.profiler, synchronized at both ends."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    return prof, wall


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    gen_args = argparse.Namespace(tiny=args.tiny, layers=args.layers, prompt_lens=[args.prompt_len],
                                  new_tokens=args.new_tokens, seed=0)
    model = bg.build_model(gen_args, device)
    eager_forward = model.forward
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for variant in bg.variants(device, args.variants, args.modes):
        bg.set_up(model, variant, eager_forward)
        cache = bg.static_cache(model, ids, args.new_tokens, variant)
        torch._dynamo.utils.counters.clear()
        for _ in range(2):
            bg.generate(model, ids, args.new_tokens, variant, cache)
        if device.type == "cuda":
            torch.cuda.synchronize()
        with GcClock() as gc_clock:
            first, rest = bg.timed_generate(model, ids, variant, args.new_tokens, device, cache)
        prefill, prefill_gpu = profiled(lambda: bg.generate(model, ids, 1, variant, cache), activities, device)
        prof = profiled(lambda: bg.generate(model, ids, args.new_tokens, variant, cache), activities, device)[0]
        prefill_times, prefill_counts = kernel_times(prefill)
        times, counts = kernel_times(prof)
        # The decode steps' kernels: the whole generate() less its prefill's.
        decode_times, decode_counts = times - prefill_times, counts - prefill_counts
        skips = {k: v for k, v in torch._dynamo.utils.counters["inductor"].items() if "cudagraph" in k}
        print(f"\n{variant.label}, prompt {args.prompt_len}, {args.new_tokens} new tokens, {args.layers} layers: "
              f"unprofiled TTFT {first * 1e3:.2f} ms, decode {(rest / (args.new_tokens - 1)) * 1e3:.3f} ms/token, "
              f"garbage collector {gc_clock}; profiled prefill (1 new token): GPU kernels "
              f"{sum(prefill_times.values()) / 1e3:.2f} ms in {prefill_gpu * 1e3:.2f} ms; "
              f"profiled: GPU kernel time {sum(times.values()) / 1e3:.2f} ms, allocator {allocator_calls(prof)}; "
              f"cudagraph counters {skips or 'none'}")
        for phase, (t, c) in (("prefill", (prefill_times, prefill_counts)),
                              (f"decode, {args.new_tokens - 1} steps", (decode_times, decode_counts))):
            rows, total = kernel_table(t, c, args.top)
            print(f"{phase}: GPU kernels {total / 1e3:.2f} ms")
            print(tabulate(rows, headers=["kernel", "launches", "GPU µs", "share"], tablefmt="github"))
        if args.host:
            print(f"host, the whole generate(): {args.host} entries by self CPU time")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.host, max_name_column_width=70))
    model.forward = eager_forward
    torch._dynamo.reset()


if __name__ == "__main__":
    main()
