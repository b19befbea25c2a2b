"""Perplexity of the embedded model when the held-out text is decoded through the KV cache.

Each window is fed teacher-forced: the first `--prefix` tokens as a prefill
(exact attention), then one token per step. The perplexity over the decoded
positions is compared with stock SDPA's on the same positions, for each cache
format, with and without the input-dtype sinks and recent window.

`--through cache` runs the real thing: every step through
`dma_compile.hf.DMACache`, whose decode steps read the cache through
`torch.ops.dma.decode_attention` (the kernel on a GPU). `--through reference`
(the default on the CPU, where stepping is slow) computes the same numbers in
one forward per window with `reference.teacher_forced_decode_reference`, which
is step-by-step decode in closed form (tests/test_reference_decode.py).

    export DMA_COMPILE_CACHE=/work/dma-cache
    python benchmarks/decode_accuracy.py --windows 4 --window-len 1024
    python benchmarks/decode_accuracy.py --through cache --windows 4 --window-len 2048 --out decode_accuracy.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from tabulate import tabulate
from tqdm import tqdm
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import dma_compile.hf
from dma_compile.assets import find_assets
from dma_compile.loading import load_model, split_heldout, take_windows, tokenize
from dma_compile.policy import AttentionPolicy
from dma_compile.reference import teacher_forced_decode_reference

TEACHER_FORCED = "dma_teacher_forced"

EXACT = AttentionPolicy.preset("exact")
FP8 = EXACT.replace(cache_k="mxfp8_e4m3", cache_v="mxfp8_e4m3")
MXFP4K = EXACT.replace(cache_k="mxfp4_e2m1", cache_v="mxfp8_e4m3")
NO_WINDOW = {"sink_tiles": 0, "recent_tokens": 0}
CACHES = {
    "none (bf16 cache)": EXACT,
    "fp8 K+V": FP8,
    "fp8 K+V, no sinks/recent": FP8.replace(**NO_WINDOW),
    "mxfp4 K + fp8 V": MXFP4K,
    "mxfp4 K + fp8 V, no recent": MXFP4K.replace(recent_tokens=0),
    "mxfp4 K + fp8 V, no sinks": MXFP4K.replace(sink_tiles=0),
    "mxfp4 K + fp8 V, no sinks/recent": MXFP4K.replace(**NO_WINDOW),
}


@torch.no_grad()
def sdpa_nll(model, window: torch.Tensor, prefix: int) -> float:
    """Summed NLL of tokens prefix .. end under one full forward."""
    logits = model(window[None], use_cache=False).logits[0, prefix - 1 : -1].float()
    return float(F.cross_entropy(logits, window[prefix:], reduction="sum"))


@torch.no_grad()
def cache_nll(model, window: torch.Tensor, prefix: int, policy: AttentionPolicy, bar) -> float:
    """Summed NLL of tokens prefix .. end, decoded one at a time through a DMACache."""
    cache = dma_compile.hf.DMACache(model, policy)
    logits = model(window[None, :prefix], **dma_compile.hf.cache_kwargs(model, cache), use_cache=True).logits[0, -1:]
    total = float(F.cross_entropy(logits.float(), window[prefix : prefix + 1], reduction="sum"))
    for i in range(prefix, window.numel() - 1):
        logits = model(window[None, i : i + 1], **dma_compile.hf.cache_kwargs(model, cache), use_cache=True).logits[0]
        total += float(F.cross_entropy(logits.float(), window[i + 1 : i + 2], reduction="sum"))
        bar.update(1)
    return total


@torch.no_grad()
def reference_nll(model, window: torch.Tensor, prefix: int, policy: AttentionPolicy, bar) -> float:
    """`cache_nll` in one forward: every layer's attention is the closed form of its decode steps."""

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        out = teacher_forced_decode_reference(query, key, value, prefix, scaling, policy)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register(TEACHER_FORCED, attention)
    AttentionMaskInterface.register(TEACHER_FORCED, sdpa_mask)
    model.set_attn_implementation(TEACHER_FORCED)
    total = sdpa_nll(model, window, prefix)
    bar.update(window.numel() - prefix)
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--windows", type=int, default=1)
    parser.add_argument("--window-len", type=int, default=1024)
    parser.add_argument("--prefix", type=int, default=128, help="prefill tokens per window")
    parser.add_argument("--caches", nargs="*", choices=list(CACHES), help="default: all")
    parser.add_argument("--through", choices=["cache", "reference"], help="default: cache on a GPU, else reference")
    parser.add_argument("--out", help="write the results as JSON")
    args = parser.parse_args()
    assets = find_assets()
    if assets is None:
        sys.exit("the embedded model is not prepared: run `dma-compile assets` (or set DMA_COMPILE_CACHE)")
    model, tokenizer = load_model(assets.model_dir)
    device = next(model.parameters()).device
    _, heldout = split_heldout(tokenize(tokenizer, assets.text_path.read_text()))
    windows = take_windows(heldout, args.windows, args.window_len, spread=False).to(device)
    if args.prefix < 1 or args.prefix >= windows.shape[1]:
        sys.exit(f"--prefix must be in 1..{windows.shape[1] - 1}")
    count = windows.numel() - windows.shape[0] * args.prefix

    model.set_attn_implementation("sdpa")
    reference = math.exp(sum(sdpa_nll(model, w, args.prefix) for w in windows) / count)
    through = args.through or ("cache" if device.type == "cuda" else "reference")
    if through == "cache":
        dma_compile.hf.register(EXACT)
        model.set_attn_implementation(dma_compile.hf.NAME)
    nll = cache_nll if through == "cache" else reference_nll
    names = args.caches or list(CACHES)
    rows = [["sdpa (no cache)", f"{reference:.4f}", ""]]
    results = {"sdpa": reference}
    with tqdm(total=len(names) * count, desc="decode steps") as bar:
        for name in names:
            bar.set_postfix_str(name)
            ppl = math.exp(sum(nll(model, w, args.prefix, CACHES[name], bar) for w in windows) / count)
            results[name] = ppl
            rows.append([name, f"{ppl:.4f}", f"{100 * (ppl / reference - 1):+.2f}%"])
    print(f"perplexity over {count} decoded tokens ({windows.shape[0]} x {windows.shape[1]}, prefill {args.prefix}, "
          f"through the {through}; "
          f"sinks {EXACT.sink_tiles * EXACT.tile}, recent {EXACT.recent_tokens} unless said)")
    print(tabulate(rows, headers=["KV cache", "perplexity", "vs SDPA"]))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            settings = {**vars(args), "through": through}
            json.dump({"settings": settings, "device": str(device), "perplexity": results}, f, indent=2)


if __name__ == "__main__":
    main()
