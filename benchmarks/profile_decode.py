"""Launches of the decode kernel on one cache, for `ncu` (the first launch warms up):

    ncu --clock-control none -k regex:_decode_split --launch-skip 1 --launch-count 1 \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        python benchmarks/profile_decode.py --cache fp8
"""

import argparse

import torch

from dma_compile.kv_cache import QuantizedKV
from dma_compile.policy import AttentionPolicy

parser = argparse.ArgumentParser()
parser.add_argument("--shape", type=int, nargs=5, default=[8, 32, 8, 32768, 128], metavar=("B", "HQ", "HKV", "L", "D"))
parser.add_argument("--cache", default="fp8", choices=["fp8", "mxfp4k"])
args = parser.parse_args()
b, hq, hkv, n, d = args.shape
policy = AttentionPolicy(cache_k="mxfp8_e4m3" if args.cache == "fp8" else "mxfp4_e2m1", cache_v="mxfp8_e4m3")
cache = QuantizedKV(b, hkv, d, n, policy, torch.bfloat16, torch.device("cuda"))
for start in range(0, n, 8192):
    piece = min(8192, n - start)
    cache.append(*(torch.randn(b, hkv, piece, d, device="cuda").bfloat16() for _ in range(2)))
q = torch.randn(b, hq, 1, d, device="cuda").bfloat16()
for _ in range(3):
    cache.attend(q, impl="triton")
torch.cuda.synchronize()
