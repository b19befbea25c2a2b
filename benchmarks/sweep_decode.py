"""Launch configurations of the split-K decode kernel, timed on one cache.

Times `kernels.decode.decode_attention` (the kernel's public hook, the same
call `torch.ops.dma.decode_attention` makes) with each `DecodeConfig` of a
grid, per cache format, against stock SDPA on the bf16 cache, in one run with
CUDA graphs; checks every configuration against the reference decode first. The
fastest row per format is what `kernels.decode.default_config` should pick.

    python benchmarks/sweep_decode.py --shape 8 32 8 32768 128 --out sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import torch.nn.functional as F
import triton
from tabulate import tabulate
from tqdm import tqdm

from dma_compile.kernels.decode import DecodeConfig, decode_attention, default_config
from dma_compile.kv_cache import QuantizedKV
from dma_compile.policy import AttentionPolicy
from dma_compile.reference import decode_attention_math

CACHES = {
    "fp8": AttentionPolicy(cache_k="mxfp8_e4m3", cache_v="mxfp8_e4m3"),
    "mxfp4k": AttentionPolicy(cache_k="mxfp4_e2m1", cache_v="mxfp8_e4m3"),
}


def bench(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1000.0


def kernel_call(cache: QuantizedKV, q: torch.Tensor, config: DecodeConfig | None):
    fmt_k, fmt_v = cache.policy.cache_k, cache.policy.cache_v
    return lambda: decode_attention(
        q, cache.k_payload, cache.k_scales, cache.v_payload, cache.v_scales, cache.hi_k, cache.hi_v,
        cache.lengths, cache.max_length, cache.sink, cache.recent, fmt_k, fmt_v, config=config,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=5, default=[8, 32, 8, 32768, 128], metavar=("B", "HQ", "HKV", "L", "D"))
    parser.add_argument("--block-n", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--chunks", type=int, nargs="+", default=[1024], help="keys per program")
    parser.add_argument("--maxnreg", type=int, nargs="+", default=[0], help="register caps per thread (0: none)")
    parser.add_argument("--pieces", type=int, nargs="+", default=[0],
                        help="programs per sequence aimed at (0: a fixed split of --chunks keys; DecodeConfig)")
    parser.add_argument("--min-chunks", type=int, nargs="+", default=[256],
                        help="with --pieces: fewest keys per program")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    b, hq, hkv, n, d = args.shape
    torch.manual_seed(0)
    k = torch.randn(b, hkv, n, d, device="cuda").bfloat16()
    v = torch.randn(b, hkv, n, d, device="cuda").bfloat16()
    q = torch.randn(b, hq, 1, d, device="cuda").bfloat16()
    sdpa_us = bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    bf16_bytes = 2 * k.numel() * k.element_size()
    rows = []
    splits = [(0, 0)] * (0 in args.pieces) + [(p, m) for p in args.pieces if p for m in args.min_chunks]
    grid = list(itertools.product(CACHES, args.block_n, args.warps, args.stages, args.chunks, args.maxnreg, splits))
    caches = {}
    for name in CACHES:
        cache = QuantizedKV(b, hkv, d, n, CACHES[name], k.dtype, k.device)
        for start in range(0, n, 8192):
            cache.append(k[:, :, start : start + 8192], v[:, :, start : start + 8192])
        caches[name] = (cache, decode_attention_math(q, *cache.values(), cache.lengths))
    for name, bn, warps, stages, chunk, maxnreg, (pieces, min_chunk) in tqdm(grid, desc="decode configs"):
        cache, expected = caches[name]
        config = DecodeConfig(block_n=bn, chunk=chunk, num_warps=warps, num_stages=stages, maxnreg=maxnreg or None,
                              pieces=pieces, min_chunk=min_chunk)
        launch = {"cache": name, "block_n": bn, "warps": warps, "stages": stages, "chunk": chunk, "maxnreg": maxnreg,
                  "pieces": pieces, "min_chunk": min_chunk}
        try:
            fn = kernel_call(cache, q, config)
            err = ((fn().float() - expected).norm() / expected.norm()).item()
            us = bench(fn)
        except Exception as e:  # a configuration that does not compile (shared memory, registers): report it
            rows.append({**launch, "error": str(e)[:80]})
            continue
        if not err < 1e-2:
            sys.exit(f"{name} {config}: disagrees with the reference decode (rel {err:.3g})")
        stored = sum(t.numel() * t.element_size() for t in (cache.k_payload, cache.k_scales, cache.v_payload, cache.v_scales) if t is not None)
        rows.append({
            **launch, "us": us,
            "x_sdpa": sdpa_us / us, "TB/s": stored / us / 1e6, "rel_err": err,
        })
    print(f"shape B{b} H{hq}/{hkv} L{n} D{d}: sdpa {sdpa_us:.1f} us ({bf16_bytes / sdpa_us / 1e6:.2f} TB/s); "
          f"default config {default_config(d)}")
    print(tabulate(sorted(rows, key=lambda r: (r["cache"], r.get("us", 1e9))), headers="keys", floatfmt=".3g"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"shape": args.shape, "sdpa_us": sdpa_us, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
