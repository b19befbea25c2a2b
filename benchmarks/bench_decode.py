"""Decode attention over the quantized KV cache against stock SDPA on a bf16 cache.

For each shape (batch, query heads / KV heads, cached length, head_dim, one
new query token) it first checks the decode kernel against the reference
decode on the same cache (a smaller length), then times, in one run with CUDA
graphs (`triton.testing.do_bench_cudagraph`, median):

- sdpa: `F.scaled_dot_product_attention` (GQA, default backend) on bf16 K/V;
- fa3_fp8: FlashAttention-3's `flash_attn_with_kvcache` on an e4m3 cache
  (one scale per batch and KV head), when `fa3_fwd_interface` is importable;
- dma_<cache>: `torch.ops.dma.decode_attention` on a `QuantizedKV` of each
  cache policy (sinks and a 128-token recent window in bf16).

Prints a table of µs, ratios to SDPA and the cache's bytes per token, and
writes JSON. `--model-layers N` also times whole-model decode (a
transformers Llama with Llama-3-8B's layer shapes and N layers, random
weights, `--model-context` cached tokens): SDPA with a StaticCache against
dma_compile.hf.DMACache per cache policy, tokens/s; eager, or with
`--model-compiled` each step compiled with mode="reduce-overhead" (CUDA
graphs) on a static DMACache.

    python benchmarks/bench_decode.py                    # the issue's shapes
    python benchmarks/bench_decode.py --lengths 4096 32768 131072 --batches 1 8 32 --head-dims 128
    python benchmarks/bench_decode.py --model-layers 4 --model-context 32768
    python benchmarks/bench_decode.py --lengths 4096 --batches 1 --model-layers 4 --model-compiled
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from tabulate import tabulate
from tqdm import tqdm

from dma_compile import cache_formats
from dma_compile.kv_cache import QuantizedKV
from dma_compile.policy import AttentionPolicy
from dma_compile.reference import decode_attention_math

CACHES = {
    "dma_fp8": AttentionPolicy(cache_k="mxfp8_e4m3", cache_v="mxfp8_e4m3"),
    "dma_mxfp4k": AttentionPolicy(cache_k="mxfp4_e2m1", cache_v="mxfp8_e4m3"),
}
# (batch, query heads, KV heads, cached length, head_dim): the targets.
SHAPES = [
    (8, 32, 8, 32768, 128),
    (1, 32, 8, 131072, 128),
    (32, 32, 8, 8192, 128),
    (8, 9, 3, 32768, 64),
]
APPEND_PIECE = 8192
CHECK_LEN = 1500
PREFILL_CHUNK = 4096
DEVICE = "cuda"


def fill(policy: AttentionPolicy, k: torch.Tensor, v: torch.Tensor) -> QuantizedKV:
    b, h, n, d = k.shape
    cache = QuantizedKV(b, h, d, n, policy, k.dtype, k.device)
    for start in range(0, n, APPEND_PIECE):
        cache.append(k[:, :, start : start + APPEND_PIECE], v[:, :, start : start + APPEND_PIECE])
    return cache


def check(policy: AttentionPolicy, b: int, hq: int, hkv: int, d: int) -> float:
    """Relative error of the kernel against the reference decode on one cache."""
    k = torch.randn(b, hkv, CHECK_LEN, d, device=DEVICE).bfloat16()
    v = torch.randn(b, hkv, CHECK_LEN, d, device=DEVICE).bfloat16()
    cache = fill(policy, k, v)
    q = torch.randn(b, hq, 1, d, device=DEVICE).bfloat16()
    out = cache.attend(q, impl="triton").float()
    expected = decode_attention_math(q, *cache.values(), cache.lengths)
    err = ((out - expected).norm() / expected.norm()).item()
    if not err < 1e-2:
        sys.exit(f"decode kernel disagrees with the reference ({policy.cache_k}/{policy.cache_v}): rel err {err:.3g}")
    return err


def fa3_fp8(q, k, v):
    """A closure running FA3 on an e4m3 cache, or None without fa3_fwd_interface."""
    try:
        from fa3_fwd_interface import flash_attn_with_kvcache
    except ImportError:
        return None
    b, hkv = k.shape[:2]

    def fp8_per_kv_head(x):
        """(B, L, H, D) e4m3 and its (B, Hkv) descale, FA3's layout."""
        scale = x.float().abs().reshape(b, hkv, -1).amax(-1).clamp(min=1e-12) / 448.0
        expanded = scale.repeat_interleave(x.shape[1] // hkv, dim=1)[:, :, None, None]
        return (x.float() / expanded).to(torch.float8_e4m3fn).transpose(1, 2).contiguous(), scale

    k8, ks = fp8_per_kv_head(k)
    v8, vs = fp8_per_kv_head(v)
    q8, qs = fp8_per_kv_head(q)
    lengths = torch.full((b,), k.shape[2], dtype=torch.int32, device=k.device)
    return lambda: flash_attn_with_kvcache(
        q8, k8, v8, cache_seqlens=lengths, q_descale=qs, k_descale=ks, v_descale=vs, causal=True
    )


def bench(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1000.0


def run_shape(b, hq, hkv, n, d):
    k = torch.randn(b, hkv, n, d, device=DEVICE).bfloat16()
    v = torch.randn(b, hkv, n, d, device=DEVICE).bfloat16()
    q = torch.randn(b, hq, 1, d, device=DEVICE).bfloat16()
    row = {"batch": b, "heads": f"{hq}/{hkv}", "length": n, "head_dim": d}
    row["sdpa_us"] = bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    fa3 = fa3_fp8(q, k, v)
    if fa3 is not None:
        try:
            row["fa3_fp8_us"] = bench(fa3)
        except Exception as e:  # an FA3 build without this configuration: report, keep going
            row["fa3_fp8_error"] = f"{type(e).__name__}: {e}"
    for name, policy in CACHES.items():
        row[f"{name}_relerr"] = check(policy, min(b, 4), hq, hkv, d)
        cache = fill(policy, k, v)
        row[f"{name}_us"] = bench(lambda: cache.attend(q, impl="triton"))
        per_token = sum(cache_formats.bytes_per_token(f, d, torch.bfloat16) for f in (policy.cache_k, policy.cache_v))
        row[f"{name}_bytes_per_token"] = per_token
        del cache
    for key in [k for k in row if k.endswith("_us") and k != "sdpa_us"]:
        row[key.replace("_us", "_x")] = row["sdpa_us"] / row[key]
    return row


def _positions(i: int, batch: int, with_cache_position: bool) -> dict:
    """Position keywords of a decode step at position i: given explicitly, a
    compiled step never derives them from the cache's length tensor."""
    pos = torch.full((batch, 1), i, device=DEVICE)
    return {"position_ids": pos, "cache_position": pos[0]} if with_cache_position else {"position_ids": pos}


@torch.no_grad()
def model_decode(layers: int, context: int, batch: int, steps: int = 32, compiled: bool = False) -> dict:
    """Decode tokens/s of a random-weight Llama-3-8B-shaped model after a `context` prefill:
    eager, or with `compiled` each step through torch.compile(mode="reduce-overhead")
    on static caches (SDPA's StaticCache, a static DMACache), after warm-up steps."""
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    import dma_compile.hf

    warmup = 3 if compiled else 0
    total = context + warmup + steps
    config = LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        num_hidden_layers=layers, vocab_size=32000, max_position_embeddings=total,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(DEVICE, torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (batch, total), device=DEVICE)
    dma_compile.hf.register()
    result = {"layers": layers, "context": context, "batch": batch, "compiled": compiled}
    eager_forward = model.forward
    with_cache_position = "cache_position" in inspect.signature(type(model).forward).parameters
    for name in ["sdpa", *CACHES]:
        torch._dynamo.reset()
        model.set_attn_implementation("sdpa" if name == "sdpa" else dma_compile.hf.NAME)
        if name == "sdpa":
            cache = StaticCache(config=config, max_cache_len=total)
        else:
            cache = dma_compile.hf.DMACache(model, CACHES[name], max_cache_len=total if compiled else None)
        if compiled:
            cache.early_initialization(batch, config.num_key_value_heads, config.head_dim, torch.bfloat16, DEVICE)
        kw = dma_compile.hf.cache_kwargs(model, cache)
        # Chunked prefill keeps SDPA's explicit masks (StaticCache) small.
        for start in range(0, context, PREFILL_CHUNK):
            eager_forward(ids[:, start : min(start + PREFILL_CHUNK, context)], **kw, use_cache=True)
        step = torch.compile(eager_forward, mode="reduce-overhead", dynamic=False) if compiled else eager_forward
        for i in range(context, context + warmup):
            step(ids[:, i : i + 1], **kw, **_positions(i, batch, with_cache_position), use_cache=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(context + warmup, total):
            step(ids[:, i : i + 1], **kw, **_positions(i, batch, with_cache_position), use_cache=True)
        torch.cuda.synchronize()
        result[f"{name}_tok_s"] = steps * batch / (time.perf_counter() - start)
        del cache, step
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    for name in CACHES:
        result[f"{name}_x"] = result[f"{name}_tok_s"] / result["sdpa_tok_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="*", help="cached lengths (with --batches: a sweep)")
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32])
    parser.add_argument("--head-dims", type=int, nargs="*", default=[128])
    parser.add_argument("--heads", default="32/8", help="query/KV heads of the sweep")
    parser.add_argument("--model-layers", type=int, default=0, help="also time whole-model decode (0: no)")
    parser.add_argument("--model-context", type=int, default=32768)
    parser.add_argument("--model-batch", type=int, default=8)
    parser.add_argument("--model-compiled", action="store_true",
                        help="time whole-model decode steps compiled (reduce-overhead, static caches)")
    parser.add_argument("--out", default="benchmarks/results/h200_decode.json")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode needs a CUDA GPU")
    hq, hkv = (int(x) for x in args.heads.split("/"))
    shapes = SHAPES
    if args.lengths:
        shapes = [(b, hq, hkv, n, d) for d in args.head_dims for b in args.batches for n in args.lengths]
    rows = []
    for shape in tqdm(shapes, desc="decode shapes"):
        try:
            rows.append(run_shape(*shape))
        except torch.OutOfMemoryError:
            tqdm.write(f"skipped {shape}: out of memory")
        torch.cuda.empty_cache()
    cols = ["batch", "heads", "length", "head_dim", "sdpa_us"]
    cols += [c for c in rows[0] if c.endswith("_us") and c != "sdpa_us"] + [c for c in rows[0] if c.endswith("_x")]
    print(tabulate([[r.get(c, "") for c in cols] for r in rows], headers=cols, floatfmt=".3g"))
    model = None
    if args.model_layers:
        model = model_decode(args.model_layers, args.model_context, args.model_batch,
                             compiled=args.model_compiled)
        print(tabulate([list(model.values())], headers=list(model), floatfmt=".3g"))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__, "triton": triton.__version__, "rows": rows, "model_decode": model,
        }, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
