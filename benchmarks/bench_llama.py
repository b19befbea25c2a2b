"""Prefill benchmark: a Llama-3-8B-shaped model under torch.compile, stock SDPA vs DMA.

    PYTHONPATH=. python3 benchmarks/bench_llama.py --out bench_llama.json
    PYTHONPATH=. python3 benchmarks/bench_llama.py --layers 8 --seq 4096,16384   # quicker
    PYTHONPATH=. python3 benchmarks/bench_llama.py --tiny                        # CPU smoke run

Builds LlamaForCausalLM with random bf16 weights (hidden 4096, 32 heads, 8 KV
heads, head_dim 128, intermediate 14336), compiles it three ways (Inductor with
stock SDPA, backend="dma" with the device's default policy, and
dma_backend of Hopper's policy with P·V in the input dtype) and times one prefill
forward per sequence length (median of CUDA-event timings after warm-up).
Logits at a fixed set of positions are compared with the SDPA variant
(relative error, top-1 agreement). A second table times the attention call
alone at the model's shapes, where DMA's gain is not diluted by the GEMMs.
Prints tabulate tables and writes everything as JSON to --out (rewritten after
each measurement, so a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import platform
import statistics
import time
import traceback

import torch
import torch.nn.functional as F
from tabulate import tabulate
from tqdm import tqdm

import dma_compile
from dma_compile import AttentionPolicy, default_policy, dma_attention
from dma_compile.backend import dma_backend

LLAMA3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, vocab_size=128256, rope_theta=500000.0,
)
TARGET_SPEEDUP = 1.25  # prefill at the longest length, DMA over stock SDPA
VARIANT_NAMES = ("sdpa", "dma", "dma-input-pv")
TINY = dict(
    hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, vocab_size=1000, rope_theta=10000.0,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32, help="decoder layers (32 in Llama-3-8B)")
    parser.add_argument("--seq", default="4096,16384", help="comma-separated prefill lengths")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--positions", type=int, default=256, help="logit positions compared per sequence")
    parser.add_argument("--variants", default=",".join(VARIANT_NAMES), help=f"subset of {','.join(VARIANT_NAMES)}")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU, to check the script itself")
    parser.add_argument("--out", default="bench_llama.json", help="JSON results path")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.seq = [int(s) for s in args.seq.split(",")]
    args.variants = args.variants.split(",")
    unknown = set(args.variants) - set(VARIANT_NAMES)
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; accepted: {', '.join(VARIANT_NAMES)}")
    if args.tiny:
        args.layers, args.seq, args.positions = min(args.layers, 2), [s for s in args.seq if s <= 512] or [128, 256], 64
    return args


def timed_ms(fn, device: torch.device, warmup: int, repeats: int) -> float:
    """Median wall time of fn() in ms: CUDA events on a GPU, perf_counter on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def build_model(args, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    shapes = TINY if args.tiny else LLAMA3_8B
    config = LlamaConfig(
        **shapes, num_hidden_layers=args.layers, max_position_embeddings=max(args.seq),
        attn_implementation="sdpa", use_cache=False,
    )
    torch.manual_seed(args.seed)
    with device:
        model = LlamaForCausalLM._from_config(config, dtype=torch.float32 if args.tiny else torch.bfloat16)
    return model.to(device).eval()


def ensure_dma_backend_name() -> str:
    """backend="dma" resolves through the installed package's entry point; a
    source checkout on PYTHONPATH has none, so register the same function."""
    if "dma" in torch._dynamo.list_backends():
        return "entry point"
    torch._dynamo.register_backend(dma_backend, name="dma")
    return "registered by the benchmark (package not installed)"


def compile_variant(model, name: str, device: torch.device):
    """The compiled model and the policy string it runs (None for stock SDPA)."""
    if name == "sdpa":
        return torch.compile(model), None
    if name == "dma":
        return torch.compile(model, backend="dma"), default_policy(device).to_string()
    policy = AttentionPolicy.preset("hopper_input_pv")
    return torch.compile(model, backend=dma_backend(policy)), policy.to_string()


class RewriteLog(logging.Handler):
    """Keeps the backend's "N of M SDPA call sites run dma.attention" lines."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def compare(logits: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """Relative L2 error and top-1 agreement of logits against a reference."""
    a, b = logits.float(), reference.float()
    return ((a - b).norm() / b.norm()).item(), (a.argmax(-1) == b.argmax(-1)).float().mean().item()


def bench_model(args, device, results, save) -> None:
    model = build_model(args, device)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    inputs = {n: torch.randint(0, vocab, (1, n), generator=gen).to(device) for n in args.seq}
    positions = {n: torch.linspace(0, n - 1, args.positions).long().to(device) for n in args.seq}
    reference_logits = {}
    steps = tqdm(total=len(args.variants) * len(args.seq), desc="model prefill", unit="run")
    rewrites = RewriteLog()
    backend_logger = logging.getLogger("dma_compile.backend")
    backend_logger.addHandler(rewrites)
    backend_logger.setLevel(logging.INFO)
    for name in args.variants:
        torch._dynamo.reset()
        rewrites.lines.clear()
        compiled, policy = compile_variant(model, name, device)
        for n in args.seq:
            row = {"variant": name, "policy": policy, "seq": n, "layers": args.layers}
            try:
                ids = inputs[n]
                torch._dynamo.maybe_mark_dynamic(ids, 1)

                def prefill():
                    return compiled(ids, use_cache=False, logits_to_keep=positions[n]).logits

                with torch.no_grad():
                    start = time.perf_counter()
                    logits = prefill()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    row["first_call_s"] = round(time.perf_counter() - start, 2)
                    row["latency_ms"] = timed_ms(prefill, device, args.warmup, args.repeats)
                if rewrites.lines:
                    row["rewrite"] = rewrites.lines[-1]
                if name == "sdpa":
                    reference_logits[n] = logits
                elif n in reference_logits:
                    row["logits_rel_err"], row["top1_agreement"] = compare(logits, reference_logits[n])
            except Exception as e:  # one failing variant must not lose the others' numbers
                row["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            results["model"].append(row)
            save()
            steps.update()
        del compiled
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    steps.close()
    backend_logger.removeHandler(rewrites)
    base = {r["seq"]: r.get("latency_ms") for r in results["model"] if r["variant"] == "sdpa"}
    for row in results["model"]:
        if base.get(row["seq"]) and row.get("latency_ms"):
            row["speedup_vs_sdpa"] = base[row["seq"]] / row["latency_ms"]
    del model, inputs, reference_logits
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_attention(args, device, results, save) -> None:
    """The attention call alone at the model's shapes: causal flag and boolean mask."""
    shapes = TINY if args.tiny else LLAMA3_8B
    hq, hkv, d = shapes["num_attention_heads"], shapes["num_key_value_heads"], shapes["head_dim"]
    dtype = torch.float32 if args.tiny else torch.bfloat16
    dma_policies = {"dma": default_policy(device), "dma-input-pv": AttentionPolicy.preset("hopper_input_pv")}
    steps = tqdm(total=len(args.seq) * 2, desc="attention alone", unit="shape")
    for n in args.seq:
        torch.manual_seed(args.seed)
        q = torch.randn(1, hq, n, d, device=device, dtype=dtype)
        k, v = (torch.randn(1, hkv, n, d, device=device, dtype=dtype) for _ in range(2))
        k_rep, v_rep = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        causal_mask = torch.ones(n, n, device=device, dtype=torch.bool).tril()[None, None]
        flops = 4 * hq * n * n * d / 2
        for masked in (False, True):
            # One mask tensor across the timed calls, as across a forward's layers: DMA
            # classifies its blocks on the first call and reuses that.
            kw = {"attn_mask": causal_mask} if masked else {"is_causal": True}
            # transformers passes a mask only with repeat_kv-expanded K/V, and SDPA's
            # math fallback for a masked enable_gqa call would need O(S^2) memory.
            calls = {"sdpa (expanded K/V)": lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, **kw)}
            if not masked:
                calls["sdpa (enable_gqa)"] = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
            for name, policy in dma_policies.items():
                calls[name] = lambda policy=policy: dma_attention(q, k, v, policy=policy, **kw)
            group = []
            with torch.no_grad():
                reference = F.scaled_dot_product_attention(q, k_rep, v_rep, **kw).float()
                for name, fn in calls.items():
                    row = {"impl": name, "seq": n, "mask": "bool mask" if masked else "is_causal"}
                    try:
                        row["latency_ms"] = timed_ms(fn, device, args.warmup, args.repeats)
                        row["tflops"] = flops / row["latency_ms"] / 1e9
                        out = fn().float()
                        row["rel_err_vs_sdpa"] = ((out - reference).norm() / reference.norm()).item()
                    except Exception as e:
                        row["error"] = f"{type(e).__name__}: {e}"
                        traceback.print_exc()
                    group.append(row)
            sdpa_best = min((r["latency_ms"] for r in group if r["impl"].startswith("sdpa") and "latency_ms" in r), default=None)
            for row in group:
                if sdpa_best and "latency_ms" in row:
                    row["speedup_vs_best_sdpa"] = sdpa_best / row["latency_ms"]
            results["attention"].extend(group)
            save()
            steps.update()
        del q, k, v, k_rep, v_rep, causal_mask
    steps.close()


def environment(device: torch.device) -> dict:
    import transformers

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dma_compile": dma_compile.__version__,
        "device": str(device),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    return env


def table(rows: list[dict], columns: list[str]) -> str:
    def fmt(value):
        return f"{value:.4g}" if isinstance(value, float) else value

    return tabulate([[fmt(r.get(c, "")) for c in columns] for r in rows], headers=columns)


def main() -> None:
    args = parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.tiny:
        raise SystemExit("bench_llama: no CUDA GPU; use --tiny for a CPU run of the script itself")
    results = {"env": environment(device), "args": vars(args), "model": [], "attention": []}
    results["env"]["dma_backend_name"] = ensure_dma_backend_name()

    def save():
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)

    print(json.dumps(results["env"]))
    bench_model(args, device, results, save)
    save()
    print("\nprefill of the whole model (torch.compile)\n")
    print(table(results["model"], ["variant", "seq", "first_call_s", "latency_ms", "speedup_vs_sdpa",
                                   "logits_rel_err", "top1_agreement", "rewrite", "error"]))
    longest = max(args.seq)
    for row in results["model"]:
        if row["variant"] != "sdpa" and row["seq"] == longest and "speedup_vs_sdpa" in row:
            met = row["speedup_vs_sdpa"] >= TARGET_SPEEDUP
            print(f"{row['variant']} at {longest} tokens: {row['speedup_vs_sdpa']:.3f}x stock SDPA "
                  f"(target {TARGET_SPEEDUP}x: {'met' if met else 'not met'})")
    bench_attention(args, device, results, save)
    print("\nattention call alone\n")
    print(table(results["attention"], ["impl", "seq", "mask", "latency_ms", "tflops", "speedup_vs_best_sdpa",
                                       "rel_err_vs_sdpa", "error"]))
    print(f"\nresults written to {args.out}")


if __name__ == "__main__":
    main()
