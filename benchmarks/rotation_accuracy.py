"""Perplexity cost of DMA policies with and without the Hadamard rotation of Q and K.

For all-MXFP4, the paper's policy and the Hopper default, each with
`rotate` none, hadamard and signed_hadamard: perplexity on held-out windows
of the embedded model's text (the split calibration never sees) against
stock SDPA's, through the "dma" attention of `dma_compile.hf` (the reference
on CPU, the kernels on a GPU). Uses compare.py's and calibrate.py's public
functions, so the numbers are those `dma-compile compare` would print.

    export DMA_COMPILE_CACHE=/work/dma-cache
    python benchmarks/rotation_accuracy.py --windows 2 --window-len 1024
    python benchmarks/rotation_accuracy.py --policies all_mxfp4,paper --skip-windows 4   # 4 other windows
    python benchmarks/rotation_accuracy.py --balance      # every policy with balance_qk as well

`--balance` adds, for every policy and rotation, the same policy with
`balance_qk` (Q and K balanced per channel before MX quantization).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from tabulate import tabulate

from dma_compile.assets import find_assets
from dma_compile.loading import load_model, split_heldout, take_windows, tokenize
from dma_compile.compare import perplexity
from dma_compile.hf import running_policy
from dma_compile.policy import AttentionPolicy, ModelPolicy
from dma_compile.rotation import ROTATIONS

POLICIES = {
    "all_mxfp4": AttentionPolicy.preset("all_mxfp4"),
    "paper": AttentionPolicy.paper(),
    "hopper": AttentionPolicy.hopper(),
    "all_mxfp8": AttentionPolicy.preset("all_mxfp8"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--window-len", type=int, default=1024)
    parser.add_argument("--skip-windows", type=int, default=0,
                        help="start after this many windows of the held-out part (another sample of the text)")
    parser.add_argument("--policies", default="all_mxfp4,paper,hopper", help=f"comma-separated, of {list(POLICIES)}")
    parser.add_argument("--rotations", default=",".join(ROTATIONS), help=f"comma-separated, of {list(ROTATIONS)}")
    parser.add_argument("--balance", action="store_true", help="also each policy with balance_qk")
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    names = args.policies.split(",")
    rotations = args.rotations.split(",")
    for name in names:
        if name not in POLICIES:
            parser.error(f"--policies: unknown policy {name!r}, expected some of {list(POLICIES)}")
    for rot in rotations:
        if rot not in ROTATIONS:
            parser.error(f"--rotations: unknown rotation {rot!r}, expected some of {list(ROTATIONS)}")

    assets = find_assets()
    if assets is None:
        print("no embedded assets: run `dma-compile fetch` (or set DMA_COMPILE_CACHE)", file=sys.stderr)
        return 1
    model, tokenizer = load_model(assets.model_dir)
    with open(assets.text_path) as f:
        text = f.read()
    _, heldout = split_heldout(tokenize(tokenizer, text))
    heldout = heldout[args.skip_windows * args.window_len :]
    windows = take_windows(heldout, args.windows, args.window_len, spread=False)
    print(f"{windows.shape[0]} x {windows.shape[1]} held-out tokens after {args.skip_windows} windows, "
          f"model {assets.model_dir}, torch {torch.__version__}, device {next(model.parameters()).device}", flush=True)

    start = time.time()
    with running_policy(model, None):
        base = perplexity(model, windows)
    print(f"sdpa: {base:.4f} ({time.time() - start:.0f} s)", flush=True)
    rows, results = [], {"sdpa": base, "windows": list(windows.shape)}
    variants = [(name, False) for name in names] + ([(name, True) for name in names] if args.balance else [])
    for name, balance in variants:
        label = f"{name}, balanced" if balance else name
        row = [label]
        for rot in rotations:
            policy = POLICIES[name].replace(rotate=rot, balance_qk=balance)
            start = time.time()
            with running_policy(model, ModelPolicy(policy)):
                ppl = perplexity(model, windows)
            results[f"{label} rotate={rot}"] = ppl
            row.append(f"{ppl:.4f} ({100 * (ppl / base - 1):+.2f}%)")
            print(f"{label} rotate={rot}: {ppl:.4f} ({100 * (ppl / base - 1):+.2f}%, {time.time() - start:.0f} s)",
                  flush=True)
        rows.append(row)
    print()
    print(f"perplexity vs SDPA {base:.4f}")
    print(tabulate(rows, headers=["policy"] + [f"rotate={r}" for r in rotations], tablefmt="github"))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
