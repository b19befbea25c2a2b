"""Relative error of DMA attention against exact attention, per policy.

Random normal Q, K, V (and the same with a few large-magnitude outlier
channels in K, as real keys have), causal; each policy with and without K
smoothing. Runs on CPU through the reference, on a GPU through the kernels.

    python examples/policy_errors.py [--seq 1024] [--heads 4] [--head-dim 128]
"""

import argparse

import torch
import torch.nn.functional as F
from tabulate import tabulate
from tqdm import tqdm

from dma_compile import AttentionPolicy, dma_attention

POLICIES = {
    "all MXFP8": AttentionPolicy.preset("all_mxfp8"),
    "all MXFP4": AttentionPolicy.preset("all_mxfp4"),
    "DMA paper (MXFP8 diag+sink, MXFP4 else)": AttentionPolicy.paper(),
    "DMA Hopper (input diag+sink, folded MXFP8 else, FP8 P·V)": AttentionPolicy.hopper(),
    "DMA Hopper, P·V in the input dtype": AttentionPolicy.preset("hopper_input_pv"),
}


def inputs(b, h, s, d, outliers, device, dtype):
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=torch.float32) for _ in range(3))
    if outliers:
        channels = torch.randperm(d, device=device)[:4]
        k[..., channels] = k[..., channels] * 8 + 20
    return q.to(dtype), k.to(dtype), v.to(dtype)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(args.seed)

    rows = []
    cases = [(name, pol, outl) for outl in (False, True) for name, pol in POLICIES.items()]
    data = {o: inputs(args.batch, args.heads, args.seq, args.head_dim, o, device, dtype) for o in (False, True)}
    for name, pol, outl in tqdm(cases, desc="policies"):
        q, k, v = data[outl]
        exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
        errs = []
        for smooth in (False, True):
            with torch.no_grad():
                out = dma_attention(q, k, v, is_causal=True, policy=pol.replace(smooth_k=smooth))
            errs.append(((out.double() - exact).norm() / exact.norm()).item())
        rows.append(["outliers in K" if outl else "normal", name, *errs])
    print(f"\nrelative L2 error vs exact attention (B={args.batch}, H={args.heads}, S={args.seq}, "
          f"D={args.head_dim}, causal, {dtype}, {device})")
    print(tabulate(rows, headers=["inputs", "policy", "no smoothing", "K smoothing"], floatfmt=".4f"))


if __name__ == "__main__":
    main()
