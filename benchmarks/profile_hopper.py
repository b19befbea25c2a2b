"""One launch of each Hopper DMA kernel (Gluon, Triton) on the quantization
pass's output, for `ncu` (the first launch of each warms up):

    ncu --clock-control none -k regex:_dma_attention --launch-skip 2 --launch-count 2 \
        --section WarpStateStats --section SourceCounters python benchmarks/profile_hopper.py

`--pingpong` profiles that launch variant of the Gluon kernel.
"""

import argparse
import math

import torch

from dma_compile import AttentionPolicy
from dma_compile.kernels.attention_sm90 import attention_from_quantized, quantize_inputs
from dma_compile.kernels.attention_sm90_gluon import gluon_attention_from_quantized, pass_options

parser = argparse.ArgumentParser()
parser.add_argument("--shape", default="1,32,32,16384,128,1", help="B,Hq,Hkv,S,D,causal")
parser.add_argument("--policy", default="hopper", choices=["hopper", "hopper_fp8pv"])
parser.add_argument("--block-n", type=int, default=128)
parser.add_argument("--pingpong", action="store_true", help="the Gluon kernel's ping-pong variant")
args = parser.parse_args()
b, hq, hk, s, d, causal = (int(x) for x in args.shape.split(","))
policy = AttentionPolicy.hopper().replace(pv="fp8" if args.policy == "hopper_fp8pv" else "input")
q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16)
k, v = (torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
# Each kernel on the pass output it asks for (the Gluon kernel's FP8 V^T is in wgmma's key order).
qi_gluon = quantize_inputs(q, k, v, policy, is_causal=bool(causal), **pass_options())
qi_triton = quantize_inputs(q, k, v, policy, is_causal=bool(causal))
shape = (b, hq, hk, s, s, d, d)
for _ in range(2):
    gluon_attention_from_quantized(qi_gluon, shape, bool(causal), 1 / math.sqrt(d), policy, block_n=args.block_n,
                                   pingpong=args.pingpong)
    attention_from_quantized(qi_triton, shape, None, bool(causal), 1 / math.sqrt(d), policy)
torch.cuda.synchronize()
