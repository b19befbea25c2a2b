"""Whole-flow benchmark: model.generate() on a Llama-3-8B-shaped model, stock SDPA vs DMA.

    PYTHONPATH=. python3 benchmarks/bench_generate.py --out bench_generate.json              # eager variants
    PYTHONPATH=. python3 benchmarks/bench_generate.py --compiled --out bench_generate.json   # and torch.compile
    PYTHONPATH=. python3 benchmarks/bench_generate.py --modes compiled --variants sdpa,dma   # a subset
    PYTHONPATH=. python3 benchmarks/bench_generate.py --tiny                                 # CPU smoke run

Builds LlamaForCausalLM with random bf16 weights at Llama-3-8B's layer shapes
(hidden 4096, 32 heads, 8 KV heads, head_dim 128, intermediate 14336, vocab
128256; --layers decoder layers, 4 of the 32 by default, so that a run fits a
few minutes) and runs greedy generate() at batch 1 on random prompts, for stock
SDPA and DMA (the device's default policy, and Hopper's with P·V in the input
dtype), and DMA with its quantized KV cache (`dma-cache`: the default policy
with an FP8 cache, dma_compile.hf.DMACache, so decode reads FP8 K/V):

- eager: attn_implementation="sdpa", or "dma" after dma_compile.hf.register(policy);
  dma-cache on a growing DMACache;
- compiled (--compiled or --modes compiled): model.forward = torch.compile(model.forward,
  mode="reduce-overhead") with Inductor's stock SDPA or backend=dma_backend(policy),
  and a StaticCache allocated before the first compiled call; dma-cache compiles the
  "dma" attention implementation with Inductor on a static DMACache (max_cache_len).

Per variant and prompt length, from a streamer that notes when each new token
reaches the host: time to first token (prefill and the first token, from the
generate call on, after a CUDA synchronize) and decode tokens/s (the other new
tokens over the time from the first to the last), medians of --repeats calls
after warm-up (the first generate, one for the logits and --warmup more),
the eager variants' timed calls taking turns (sdpa, dma, ..., sdpa, dma, ...); the
SDPA call sites of the compiled prefill graph that run dma.attention (the
backend's RewriteReport); and the last-position prefill logits against the matching SDPA variant (eager
against eager, compiled against compiled): relative L2 error and argmax
agreement. Prints one tabulate table and writes everything as JSON to --out
(rewritten after each measurement, so a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import time
import traceback
from dataclasses import dataclass

import torch
from tabulate import tabulate
from tqdm import tqdm

import dma_compile.hf
from dma_compile import AttentionPolicy, default_policy
from dma_compile.backend import dma_backend

LLAMA3_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, vocab_size=128256, rope_theta=500000.0,
)
TINY = dict(
    hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, vocab_size=1000, rope_theta=10000.0,
)
# Issue 14's targets on the H200, as (mode, prompt length, minimum TTFT ratio vs SDPA).
TTFT_TARGETS = (("eager", 16384, 1.0), ("compiled", 4096, 1.0), ("compiled", 16384, 1.4))
DECODE_TARGET = 0.97  # decode tokens/s of every DMA variant with a bf16 cache over SDPA's
# Issue 15's: decode tokens/s through the FP8 DMACache over SDPA's, from this prompt length on.
CACHE_DECODE_TARGET = (32768, 1.3)
VARIANT_NAMES = ("sdpa", "dma", "dma-input-pv", "dma-cache")
MODES = ("eager", "compiled")


@dataclass(frozen=True)
class Variant:
    name: str
    mode: str  # "eager" or "compiled"
    policy: AttentionPolicy | None  # None: stock SDPA

    @property
    def label(self) -> str:
        return f"{self.name} ({self.mode})"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (32 in Llama-3-8B)")
    parser.add_argument("--prompt-lens", default="4096,16384", help="comma-separated prompt lengths")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt")
    parser.add_argument("--warmup", type=int, default=1, help="untimed generate calls per measurement, besides two")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="sdpa,dma,dma-input-pv",
                        help="subset of sdpa,dma,dma-input-pv (each mode)")
    parser.add_argument("--modes", default="eager", help="subset of eager,compiled (compiled is slow to compile)")
    parser.add_argument("--compiled", action="store_true", help="shorthand for --modes eager,compiled")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU, to check the script itself")
    parser.add_argument("--out", default="bench_generate.json", help="JSON results path")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        args.prompt_lens = [int(s) for s in args.prompt_lens.split(",")]
    except ValueError:
        parser.error(f"--prompt-lens: expected comma-separated integers, got {args.prompt_lens!r}")
    if min(args.prompt_lens) < 1:
        parser.error("--prompt-lens: lengths must be positive")
    args.variants = args.variants.split(",")
    unknown = set(args.variants) - set(VARIANT_NAMES)
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; accepted: {', '.join(VARIANT_NAMES)}")
    args.modes = ["eager", "compiled"] if args.compiled else args.modes.split(",")
    unknown = set(args.modes) - set(MODES)
    if unknown:
        parser.error(f"--modes: unknown {sorted(unknown)}; accepted: {', '.join(MODES)}")
    if args.new_tokens < 2:
        parser.error("--new-tokens: at least 2 (decode speed needs tokens after the first)")
    if args.layers < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--layers and --repeats must be positive, --warmup not negative")
    if args.tiny:
        args.layers, args.prompt_lens, args.new_tokens = min(args.layers, 2), [64], min(args.new_tokens, 8)
    return args


def variants(device: torch.device, names: list[str], modes: list[str]) -> list[Variant]:
    fp8_cache = default_policy(device).replace(cache_k="mxfp8_e4m3", cache_v="mxfp8_e4m3")
    policies = {"sdpa": None, "dma": default_policy(device), "dma-input-pv": AttentionPolicy.preset("hopper_input_pv"),
                "dma-cache": fp8_cache}
    # In the order given: a later variant in a process pays that process's
    # history in host time (BENCHMARKS.md, 2026-12-06), so the order is the caller's to choose.
    return [Variant(name, mode, policies[name]) for mode in MODES if mode in modes for name in names]


def build_model(args, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **(TINY if args.tiny else LLAMA3_8B), num_hidden_layers=args.layers,
        max_position_embeddings=max(args.prompt_lens) + args.new_tokens, attn_implementation="sdpa",
    )
    torch.manual_seed(args.seed)
    with device:
        model = LlamaForCausalLM._from_config(config, dtype=torch.float32 if args.tiny else torch.bfloat16)
    return model.to(device).eval()


class LogLines(logging.Handler):
    """Keeps the messages dma_compile logs (fallbacks to SDPA or to the reference)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def set_up(model, variant: Variant, eager_forward):
    """Point the model at the variant; returns the DmaBackend of a compiled DMA variant."""
    torch._dynamo.reset()
    model.forward = eager_forward
    # generate() sizes a static cache at least as large as an earlier call's
    # (older transformers keep the cache itself): start from none.
    for name in ("_cache", "_previous_max_cache_length"):
        model.__dict__.pop(name, None)
    if variant.mode == "eager" or variant.name == "dma-cache":
        if variant.policy is not None:
            dma_compile.hf.register(variant.policy)
        model.set_attn_implementation("sdpa" if variant.policy is None else dma_compile.hf.NAME)
        if variant.mode == "compiled":
            model.forward = torch.compile(eager_forward, mode="reduce-overhead", dynamic=False)
        return None
    model.set_attn_implementation("sdpa")
    backend = "inductor" if variant.policy is None else dma_backend(variant.policy)
    # Static shapes: one prefill graph per prompt length (compiled afresh after the reset) and one decode graph.
    model.forward = torch.compile(eager_forward, backend=backend, mode="reduce-overhead", dynamic=False)
    return None if variant.policy is None else backend


def static_cache(model, ids, new_tokens: int, variant: Variant):
    """The cache a variant generates on, or None (eager SDPA and DMA: generate's
    own). Compiled variants get a static one, its buffers allocated before the
    first compiled call: allocated lazily inside the compiled prefill, they
    would be outputs of a CUDA graph that the next replay overwrites."""
    from transformers import StaticCache

    if variant.name == "dma-cache" and variant.mode == "eager":
        return dma_compile.hf.DMACache(model, variant.policy)
    if variant.mode != "compiled":
        return None
    config = model.config
    length = ids.shape[1] + new_tokens
    if variant.name == "dma-cache":
        cache = dma_compile.hf.DMACache(model, variant.policy, max_cache_len=length)
    else:
        cache = StaticCache(config=config, max_cache_len=length)
    cache.early_initialization(ids.shape[0], config.num_key_value_heads, config.head_dim, model.dtype, ids.device)
    return cache


def generate(model, ids, new_tokens: int, variant: Variant, cache=None, **kw):
    """Greedy generate(); with `cache` (`static_cache`'s), on it, emptied first."""
    if cache is not None:
        cache.reset()
        kw.update(dma_compile.hf.cache_kwargs(model, cache))
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, pad_token_id=0, disable_compile=True, **kw,
    )


class TokenClock:
    """A generate() streamer that notes when each token reaches the host: the
    prompt first, then each new token (generate copies it to the CPU, so the
    time includes the GPU work that produced it)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, _tokens) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def timed_generate(model, ids, variant: Variant, new_tokens: int, device: torch.device,
                   cache=None) -> tuple[float, float]:
    """Seconds to the first new token and from it to the last."""
    clock = TokenClock()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    generate(model, ids, new_tokens, variant, cache, streamer=clock)
    if len(clock.times) != new_tokens + 1:
        raise RuntimeError(f"generate produced {len(clock.times) - 1} tokens, expected {new_tokens}")
    return clock.times[1] - start, clock.times[-1] - clock.times[1]


class PrefillSites:
    """Counts, over the graphs compiled during the model's first forward (the
    prefill), the SDPA call sites the backend rewrote and all it saw."""

    def __init__(self, model, backend):
        self.backend, self.start, self.end = backend, len(backend.reports), None
        self.handle = model.register_forward_hook(self._after_forward)

    def _after_forward(self, *_):
        self.end = len(self.backend.reports)
        self.handle.remove()

    def summary(self) -> str:
        reports = self.backend.reports[self.start:self.end]
        rewritten = sum(len(r.rewritten) for r in reports)
        return f"{rewritten}/{sum(len(r.sites) for r in reports)}"


def prepare(args, model, variant: Variant, backend, ids, device, row: dict) -> tuple[torch.Tensor, object]:
    """The variant's untimed calls (the first generate, timed whole, with the
    compiled prefill's DMA call sites; one for the logits; --warmup more).
    Returns the last-position prefill logits and the cache its timed calls run on."""
    sites = PrefillSites(model, backend) if backend is not None else None
    # Sized for the full-length call; the shorter one below runs on it too.
    cache = static_cache(model, ids, args.new_tokens, variant)
    first_token_s, decode_s = timed_generate(model, ids, variant, args.new_tokens, device, cache)
    row["first_generate_s"] = first_token_s + decode_s
    if sites is not None:
        row["dma_sites"] = sites.summary()
    out = generate(model, ids, 1, variant, cache, output_logits=True, return_dict_in_generate=True)
    logits = out.logits[0][0].float()
    for _ in range(args.warmup):
        generate(model, ids, args.new_tokens, variant, cache)
    return logits, cache


def record(args, row: dict, timings: list[tuple[float, float]]) -> None:
    """Medians of the timed calls: time to first token and decode tokens/s."""
    first, decode = zip(*timings)
    row["ttft_ms"] = statistics.median(first) * 1e3
    row["decode_tok_s"] = (args.new_tokens - 1) / statistics.median(decode)


def compare(row: dict, logits: torch.Tensor, reference: torch.Tensor) -> None:
    row["logits_rel_err"] = ((logits - reference).norm() / reference.norm()).item()
    row["argmax_agree"] = bool(logits.argmax() == reference.argmax())


def add_ratios(rows: list[dict]) -> None:
    """TTFT speedup and decode tokens/s ratio of each row over the SDPA row of its mode and length."""
    base = {(r["mode"], r["prompt"]): r for r in rows if r["variant"] == "sdpa"}
    for row in rows:
        sdpa = base.get((row["mode"], row["prompt"]), {})
        if "ttft_ms" in row and "ttft_ms" in sdpa:
            row["ttft_x_sdpa"] = sdpa["ttft_ms"] / row["ttft_ms"]
            row["decode_x_sdpa"] = row["decode_tok_s"] / sdpa["decode_tok_s"]


def run(args, device, results, save) -> None:
    model = build_model(args, device)
    eager_forward = model.forward
    gen = torch.Generator().manual_seed(args.seed)
    prompts = {n: torch.randint(0, model.config.vocab_size, (1, n), generator=gen).to(device) for n in args.prompt_lens}
    todo = variants(device, args.variants, args.modes)
    # SDPA's logits per (mode, prompt length), and the DMA rows waiting for them (SDPA may run later).
    reference, unchecked = {}, []
    logs = LogLines()
    dma_logger = logging.getLogger("dma_compile")
    dma_logger.addHandler(logs)
    steps = tqdm(total=len(todo) * len(prompts), desc="generate", unit="run")
    # Eager variants take turns call by call (switching costs nothing there):
    # the host time of eager decode drifts with what the process ran before,
    # so timing them one after the other favours the first (BENCHMARKS.md,
    # 2026-12-06). A compiled variant's switch recompiles: those run in turn.
    groups = [[v for v in todo if v.mode == "eager"]] + [[v] for v in todo if v.mode == "compiled"]
    for group in (g for g in groups if g):
        for n, ids in prompts.items():
            ready = []
            for variant in group:
                steps.set_postfix_str(f"{variant.label} {n}")
                row = {"variant": variant.name, "mode": variant.mode, "prompt": n, "layers": args.layers,
                       "policy": None if variant.policy is None else variant.policy.to_string()}
                logs.lines.clear()
                try:
                    backend = set_up(model, variant, eager_forward)
                    logits, cache = prepare(args, model, variant, backend, ids, device, row)
                    if variant.policy is None:
                        reference[variant.mode, n] = logits
                    else:
                        unchecked.append((row, (variant.mode, n), logits))
                    ready.append((variant, row, cache, []))
                except Exception as e:  # one failing variant must not lose the others' numbers
                    row["error"] = f"{type(e).__name__}: {e}"
                    traceback.print_exc()
                if logs.lines:
                    row["log"] = sorted(set(logs.lines))
                results["rows"].append(row)
            for _ in range(args.repeats):
                for variant, row, cache, timings in ready:
                    if "error" in row:
                        continue
                    try:
                        if len(ready) > 1:
                            set_up(model, variant, eager_forward)
                        timings.append(timed_generate(model, ids, variant, args.new_tokens, device, cache))
                    except Exception as e:
                        row["error"] = f"{type(e).__name__}: {e}"
                        traceback.print_exc()
            for _, row, _, timings in ready:
                if "error" not in row:
                    record(args, row, timings)
            for row, key, logits in [u for u in unchecked if u[1] in reference]:
                compare(row, logits, reference[key])
            unchecked = [u for u in unchecked if u[1] not in reference]
            add_ratios(results["rows"])
            save()
            steps.update(len(group))
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    steps.close()
    dma_logger.removeHandler(logs)
    model.forward = eager_forward
    torch._dynamo.reset()


def environment(device: torch.device) -> dict:
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__,
           "dma_compile": dma_compile.__version__, "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
    return env


COLUMNS = {
    "variant": "variant", "mode": "mode", "prompt": "prompt", "ttft_ms": "TTFT ms", "ttft_x_sdpa": "TTFT x SDPA",
    "decode_tok_s": "decode tok/s", "decode_x_sdpa": "decode x SDPA", "dma_sites": "DMA sites (prefill)",
    "logits_rel_err": "logits rel err", "argmax_agree": "argmax agree", "first_generate_s": "first generate s",
    "error": "error",
}


def table(rows: list[dict]) -> str:
    def fmt(value):
        return f"{value:.4g}" if isinstance(value, float) else value

    return tabulate([[fmt(r.get(c, "")) for c in COLUMNS] for r in rows], headers=list(COLUMNS.values()))


def target_lines(rows: list[dict]) -> list[str]:
    """Each of the issue's targets: met, not met, or not measured in this run."""
    lines = []
    for mode, prompt, minimum in TTFT_TARGETS:
        measured = [r for r in rows if r["mode"] == mode and r["prompt"] == prompt
                    and r["variant"] not in ("sdpa", "dma-cache")]
        got = ", ".join(f"{r['variant']} {r['ttft_x_sdpa']:.3f}x" for r in measured if "ttft_x_sdpa" in r)
        verdict = ("met" if all(r.get("ttft_x_sdpa", 0) >= minimum for r in measured) else "not met") if got else "not measured"
        lines.append(f"target: {mode} DMA TTFT >= {minimum}x {mode} SDPA at {prompt} tokens: {verdict}"
                     + (f" ({got})" if got else ""))
    decode = [r for r in rows if r["variant"] not in ("sdpa", "dma-cache") and "decode_x_sdpa" in r]
    worst = min(decode, key=lambda r: r["decode_x_sdpa"], default=None)
    verdict = "not measured" if worst is None else (
        f"{'met' if worst['decode_x_sdpa'] >= DECODE_TARGET else 'not met'} "
        f"(lowest: {worst['variant']} {worst['mode']} at {worst['prompt']}: {worst['decode_x_sdpa']:.3f}x)")
    lines.append(f"target: DMA decode tok/s within {1 - DECODE_TARGET:.0%} of SDPA's: {verdict}")
    prompt, minimum = CACHE_DECODE_TARGET
    cached = [r for r in rows if r["variant"] == "dma-cache" and r["prompt"] >= prompt and "decode_x_sdpa" in r]
    got = ", ".join(f"{r['mode']} {r['prompt']}: {r['decode_x_sdpa']:.3f}x" for r in cached)
    verdict = ("met" if all(r["decode_x_sdpa"] >= minimum for r in cached) else "not met") if cached else "not measured"
    lines.append(f"target: dma-cache decode tok/s >= {minimum}x SDPA's from {prompt} tokens: {verdict}"
                 + (f" ({got})" if got else ""))
    return lines


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.tiny:
        raise SystemExit("bench_generate: no CUDA GPU; use --tiny for a CPU run of the script itself")
    results = {"env": environment(device), "args": vars(args), "rows": []}

    def save():
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)

    print(json.dumps(results["env"]))
    run(args, device, results, save)
    save()
    shapes = "tiny Llama" if args.tiny else "Llama-3-8B layer shapes"
    print(f"\ngenerate(), batch 1, greedy, {args.new_tokens} new tokens; {shapes}, {args.layers} decoder layers, "
          f"random weights; median of {args.repeats}\n")
    print(table(results["rows"]))
    print("\nTTFT x SDPA: SDPA's time to first token over the row's (eager vs eager, compiled vs compiled); "
          "decode x SDPA: the row's decode tok/s over SDPA's.\nDMA sites: SDPA call sites of the compiled prefill "
          "graph that run dma.attention, of all seen. Logits: last prompt position vs the SDPA row's.")
    for line in target_lines(results["rows"]):
        print(line)
    for row in results["rows"]:
        for line in row.get("log", []):  # each logged once per process: at the first row that met it
            print(f"dma_compile logged at {row['variant']} ({row['mode']}) {row['prompt']}: {line}")
    print(f"\nresults written to {args.out}")
    return results


if __name__ == "__main__":
    main()
