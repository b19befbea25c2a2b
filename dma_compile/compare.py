"""Side-by-side comparison of attention policies on a model and a text.

For stock SDPA, all-MXFP8, all-MXFP4, the paper's DMA policy, the Hopper
default and (when given) a calibrated policy, on held-out windows of the text
(its last HELDOUT_FRACTION, which calibration never sees):
  (a) per layer: the policy and the relative L2 error of the layer's attention
      output against exact attention (and a PNG plot of it);
  (b) perplexity, and greedy-generation agreement with SDPA (tokens until the
      first divergence, exact-match rate over the generated tokens; mean and
      standard error over the prompts), with each policy's modelled cost;
  (c) on a GPU: prefill latency, eager and compiled with CUDA graphs, and
      the GPU time of the attention calls, against SDPA.
The DMA policies run through the "dma" attention implementation of
`dma_compile.hf`, which calls the `dma::attention` op (kernels on a GPU, the
reference on CPU).
"""

from __future__ import annotations

import inspect
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dma_compile.calibrate import (
    DEFAULT_COST_LEN,
    LayerScorer,
    describe,
    load_model,
    model_cost,
    model_format_fraction,
    named_reference_policies,
    split_heldout,
    take_windows,
    tokenize,
)
from dma_compile.hf import running_policy
from dma_compile.policy import ModelPolicy

# (perplexity windows, tokens each, generation prompts, prompt tokens, new
# tokens). Greedy agreement swings from prompt to prompt, so it takes more
# prompts than perplexity takes windows to mean something.
CPU_SETTINGS = (4, 1024, 8, 512, 32)
GPU_SETTINGS = (8, 2048, 16, 1024, 64)


@dataclass
class Settings:
    windows: int
    window_len: int
    prompts: int
    prompt_len: int
    new_tokens: int

    @classmethod
    def for_device(cls, device: torch.device, **overrides) -> "Settings":
        base = cls(*(GPU_SETTINGS if device.type == "cuda" else CPU_SETTINGS))
        for name, value in overrides.items():
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{name} must be a positive integer, got {value!r}")
                setattr(base, name, value)
        return base


@dataclass
class Comparison:
    """What `compare` measured; `tables` are tabulate strings by section."""

    policies: dict[str, dict] = field(default_factory=dict)
    layers: list[dict] = field(default_factory=list)
    speed: dict[str, dict] | None = None
    settings: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    tables: dict[str, str] = field(default_factory=dict)
    plot: str | None = None

    def to_dict(self) -> dict:
        return {
            "settings": self.settings,
            "policies": self.policies,
            "layers": self.layers,
            "speed": self.speed,
            "notes": self.notes,
            "plot": self.plot,
        }

    def save_json(self, path: str | os.PathLike) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=2)

    def report(self) -> str:
        parts = [self.tables[k] for k in ("layers", "model", "speed") if k in self.tables]
        return "\n\n".join(parts + self.notes)


def standard_policies(calibrated: ModelPolicy | None = None) -> dict[str, ModelPolicy | None]:
    """The policies every comparison reports, SDPA (None) first."""
    presets = named_reference_policies()
    policies: dict[str, ModelPolicy | None] = {
        "sdpa": None,
        "all_mxfp8": ModelPolicy(presets["all_mxfp8"]),
        "all_mxfp4": ModelPolicy(presets["all_mxfp4"]),
        "paper": ModelPolicy(presets["paper"]),
        "hopper": ModelPolicy(presets["hopper"]),
    }
    if calibrated is not None:
        target = (calibrated.stats or {}).get("target")
        policies[f"calibrated ({target})" if target else "calibrated"] = calibrated
    return policies


@torch.no_grad()
def perplexity(model, windows: torch.Tensor) -> float:
    """exp(mean next-token NLL) over every predicted position of the windows."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for window in windows:
        ids = window[None].to(device)
        logits = model(ids, use_cache=False).logits[0, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += ids.shape[1] - 1
    return math.exp(total / count)


def _kv_cache(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


@torch.no_grad()
def greedy_tokens(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """`new_tokens` greedy continuations of a 1-D prompt (no early stop at EOS)."""
    device = next(model.parameters()).device
    # transformers renamed `past_key_values` to `cache` (5.2x); accept both.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(prompt[None].to(device), use_cache=True)
    token = out.logits[0, -1].argmax()
    tokens = [token]
    for _ in range(new_tokens - 1):
        out = model(token.view(1, 1), use_cache=True, **{cache_arg: _kv_cache(out)})
        token = out.logits[0, -1].argmax()
        tokens.append(token)
    return torch.stack(tokens).cpu()


def agreement(reference: torch.Tensor, tokens: torch.Tensor) -> tuple[int, float]:
    """(tokens before the first divergence, fraction of positions equal)."""
    equal = reference == tokens
    first = int(equal.logical_not().nonzero()[0]) if not bool(equal.all()) else equal.numel()
    return first, float(equal.float().mean())


def spread(name: str, values: list[float]) -> dict:
    """{name: mean, name_sem: standard error of the mean (0 for one value),
    name_per_prompt: the values}: greedy agreement swings from prompt to
    prompt, so the mean alone says little."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return {name: mean, f"{name}_sem": math.sqrt(var / len(values)), f"{name}_per_prompt": values}


def layer_errors(model, window: torch.Tensor, policies: dict[str, ModelPolicy | None], num_layers: int) -> list[dict]:
    """Per layer, each DMA policy's relative L2 error (and worst row) on one window."""
    from dma_compile.capture import capture_windows

    captured = capture_windows(model, window[None])
    rows = []
    for layer in range(num_layers):
        scorer = LayerScorer(captured.pop(layer))
        row = {"layer": layer}
        for name, policy in policies.items():
            if policy is not None:
                row[name] = scorer.errors(policy.for_layer(layer))
        rows.append(row)
        scorer.release()
    return rows


def attention_time_ms(config, policy: ModelPolicy | None, seq_len: int, device: torch.device, num_layers: int) -> float:
    """Summed attention time of all layers for one causal prefill of `seq_len`
    tokens: the DMA op (kernels via impl="auto") or SDPA."""
    from dma_compile.calibrate import cuda_time_ms
    from dma_compile.ops import dma_attention

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q = torch.randn(1, config.num_attention_heads, seq_len, head_dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, config.num_key_value_heads, seq_len, head_dim, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    if policy is None:
        gqa = q.shape[1] != k.shape[1]
        return num_layers * cuda_time_ms(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        )
    per_policy: dict[str, float] = {}
    total = 0.0
    for layer in range(num_layers):
        pol = policy.for_layer(layer)
        key = pol.to_string()
        if key not in per_policy:
            per_policy[key] = cuda_time_ms(lambda: dma_attention(q, k, v, is_causal=True, policy=pol))
        total += per_policy[key]
    return total


def prefill_ms(model, window: torch.Tensor) -> float:
    """Eager prefill, host work included (what an uncompiled model costs)."""
    from dma_compile.calibrate import cuda_time_ms

    ids = window[None].to(next(model.parameters()).device)
    with torch.no_grad():
        return cuda_time_ms(lambda: model(ids, use_cache=False), repeats=5, graph=False)


def compiled_prefill_ms(model, policy: ModelPolicy | None, window: torch.Tensor) -> float:
    """Prefill under torch.compile(mode="reduce-overhead"): Inductor with stock
    SDPA (policy None) or the "dma" backend, replayed through CUDA graphs, so
    small models are not timed by their kernel launches. Resets Dynamo's
    caches before and after, so each policy compiles afresh."""
    from dma_compile.backend import dma_backend
    from dma_compile.calibrate import cuda_time_ms

    ids = window[None].to(next(model.parameters()).device)
    torch._dynamo.reset()
    backend = "inductor" if policy is None else dma_backend(policy)
    compiled = torch.compile(model, backend=backend, mode="reduce-overhead", fullgraph=True)
    try:
        with torch.no_grad():
            return cuda_time_ms(lambda: compiled(ids, use_cache=False), repeats=5, graph=False)
    finally:
        torch._dynamo.reset()


def compare(
    model,
    text: str,
    policy: ModelPolicy | None = None,
    *,
    tokenizer=None,
    windows: int | None = None,
    window_len: int | None = None,
    prompts: int | None = None,
    prompt_len: int | None = None,
    new_tokens: int | None = None,
    plot: str | os.PathLike | None = None,
    progress: bool = True,
    compiled_prefill: bool = True,
) -> Comparison:
    """Compare SDPA and the standard DMA policies (plus `policy`, a calibrated
    ModelPolicy) on the held-out part of `text`; see the module docstring.
    Defaults: 4 x 1024-token windows and 8 prompts of 512 + 32 tokens on CPU,
    8 x 2048 and 16 x (1024 + 64) on a GPU. compiled_prefill: on a GPU, also
    time each policy's prefill under torch.compile with CUDA graphs (one
    compile per policy, tens of seconds each)."""
    from tqdm.auto import tqdm

    from dma_compile.capture import num_attention_layers

    if plot is not None and not Path(plot).absolute().parent.is_dir():
        raise ValueError(f"plot: directory {os.fspath(Path(plot).absolute().parent)!r} does not exist")
    model, loaded_tokenizer = load_model(model)
    tokenizer = tokenizer or loaded_tokenizer
    if tokenizer is None:
        raise ValueError("tokenizer: pass tokenizer= with a model object")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("text: the evaluation text is empty")
    num_layers = num_attention_layers(model)
    if policy is not None:
        policy.check_layers(num_layers)
    device = next(model.parameters()).device
    cfg = Settings.for_device(
        device, windows=windows, window_len=window_len, prompts=prompts, prompt_len=prompt_len, new_tokens=new_tokens
    )
    _, heldout = split_heldout(tokenize(tokenizer, text))
    eval_windows = take_windows(heldout, cfg.windows, cfg.window_len, spread=False)
    prompt_windows = take_windows(heldout, cfg.prompts, cfg.prompt_len, spread=True)
    result = Comparison(settings={**vars(cfg), "device": str(device), "num_layers": num_layers})
    for what, got, asked in (("evaluation windows", eval_windows, (cfg.windows, cfg.window_len)),
                             ("prompts", prompt_windows, (cfg.prompts, cfg.prompt_len))):
        if tuple(got.shape) != asked:
            result.notes.append(f"note: the held-out text holds {got.shape[0]} x {got.shape[1]} tokens of {what} "
                                f"(asked for {asked[0]} x {asked[1]})")
    if device.type != "cuda":
        result.notes.append(
            f"note: CPU run through the reference: {eval_windows.shape[0]} x {eval_windows.shape[1]}-token "
            "held-out windows (a GPU run uses 8 x 2048); speed is measured on a GPU only"
        )

    calib_len = ((policy.stats or {}) if policy is not None else {}).get("window_len")
    if calib_len and calib_len != eval_windows.shape[1]:
        result.notes.append(length_note(calib_len, eval_windows.shape[1]))

    policies = standard_policies(policy)
    steps = len(policies) * 2 + 1
    with tqdm(total=steps, desc="compare", unit="step", disable=not progress) as bar:
        bar.set_postfix_str("per-layer errors")
        result.layers = layer_errors(model, eval_windows[0], policies, num_layers)
        bar.update()
        reference_tokens: list[torch.Tensor] = []
        for name, pol in policies.items():
            bar.set_postfix_str(f"{name}: perplexity")
            with running_policy(model, pol):
                ppl = perplexity(model, eval_windows)
                bar.update()
                bar.set_postfix_str(f"{name}: generation")
                generated = [greedy_tokens(model, p, cfg.new_tokens) for p in prompt_windows]
                bar.update()
            if pol is None:
                reference_tokens = generated
            agree = [agreement(r, g) for r, g in zip(reference_tokens, generated)]
            result.policies[name] = {
                "policy": None if pol is None else pol.to_dict() | {"stats": None},
                "perplexity": ppl,
                **spread("first_divergence", [a[0] for a in agree]),
                **spread("match_rate", [a[1] for a in agree]),
                "cost_sm100": 1.0 if pol is None else model_cost(pol, num_layers, "sm100", DEFAULT_COST_LEN),
                "cost_sm90": 1.0 if pol is None else model_cost(pol, num_layers, "sm90", DEFAULT_COST_LEN),
                "mxfp4_fraction": 0.0 if pol is None else model_format_fraction(pol, num_layers, DEFAULT_COST_LEN),
            }
    if device.type == "cuda":
        result.speed = measure_speed(model, policies, eval_windows[0], num_layers, compiled_prefill, progress)
    _build_tables(result, policies, policy)
    if plot is not None:
        result.plot = os.fspath(plot_layer_errors(result, policy, plot))
    return result


def measure_speed(
    model, policies: dict[str, ModelPolicy | None], window: torch.Tensor, num_layers: int, compiled: bool = True,
    progress: bool = False,
) -> dict:
    """Per policy: eager prefill, compiled prefill (CUDA graphs; when `compiled`)
    and the GPU time of the attention calls of one prefill, in milliseconds."""
    from tqdm.auto import tqdm

    config = model.config.get_text_config()
    device = next(model.parameters()).device
    speed = {}
    for name, pol in tqdm(policies.items(), desc="speed", unit="policy", disable=not progress):
        with running_policy(model, pol):
            prefill = prefill_ms(model, window)
        speed[name] = {"prefill_ms": prefill}
        if compiled:
            speed[name]["compiled_prefill_ms"] = compiled_prefill_ms(model, pol, window)
        speed[name]["attention_ms"] = attention_time_ms(config, pol, window.numel(), device, num_layers)
    return speed


def _pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def _build_tables(result: Comparison, policies: dict, calibrated: ModelPolicy | None) -> None:
    from tabulate import tabulate

    dma_names = [n for n, p in policies.items() if p is not None]
    stats = ((calibrated.stats or {}) if calibrated is not None else {}).get("layers", {})
    cal_name = next((n for n in dma_names if n.startswith("calibrated")), None)
    rows = []
    for row in result.layers:
        layer = row["layer"]
        line = [layer]
        if cal_name:
            line.append(describe(policies[cal_name].for_layer(layer)))
            s = stats.get(str(layer))
            line.append(f"{s['rel_l2']:.4f}" if s else "-")
        line += [f"{row[n]['rel_l2']:.4f}" for n in dma_names]
        rows.append(line)
    headers = ["layer"] + (["calibrated policy", "calib. rel L2"] if cal_name else []) + dma_names
    window = result.settings
    calib_len = (calibrated.stats or {}).get("window_len") if cal_name else None
    measured = f"held-out window of {window['window_len']} tokens"
    if calib_len:
        calib = calibrated.stats
        measured += f"; calib. rel L2: calibration's own, on {calib['windows']} x {calib_len}-token windows"
    result.tables["layers"] = (
        f"(a) per-layer relative L2 error of the attention output, {measured}\n"
        + tabulate(rows, headers=headers, tablefmt="github")
    )

    sdpa_ppl = result.policies["sdpa"]["perplexity"]
    rows = []
    for name, r in result.policies.items():
        rows.append(
            [
                name,
                f"{r['perplexity']:.4f}",
                _pct(r["perplexity"] / sdpa_ppl - 1),
                f"{r['first_divergence']:.1f} ± {r['first_divergence_sem']:.1f}",
                f"{100 * r['match_rate']:.0f}% ± {100 * r['match_rate_sem']:.0f}%",
                f"{r['cost_sm100']:.3f}",
                f"{r['cost_sm90']:.3f}",
                f"{100 * r['mxfp4_fraction']:.0f}%",
            ]
        )
    headers = ["policy", "perplexity", "vs SDPA", "tokens to 1st divergence", "match rate",
               "cost sm100", "cost sm90", "MXFP4 tiles"]
    result.tables["model"] = (
        f"(b) held-out perplexity ({window['windows']} x {window['window_len']} tokens), greedy agreement with SDPA "
        f"({window['prompts']} prompts of {window['prompt_len']} + {window['new_tokens']} tokens; mean ± standard "
        f"error over the prompts), modelled cost at "
        f"{DEFAULT_COST_LEN} tokens (1 = bf16 SDPA)\n" + tabulate(rows, headers=headers, tablefmt="github")
    )

    if result.speed:
        base = result.speed["sdpa"]
        columns = [("prefill_ms", "eager prefill ms"), ("compiled_prefill_ms", "compiled prefill ms"),
                   ("attention_ms", "attention ms")]
        columns = [c for c in columns if c[0] in base]
        rows = []
        for name, s in result.speed.items():
            row = [name]
            for key, _ in columns:
                row += [f"{s[key]:.3f}", f"{base[key] / s[key]:.2f}x"]
            rows.append(row)
        headers = ["policy"] + [h for _, title in columns for h in (title, "speedup")]
        result.tables["speed"] = (
            f"(c) GPU prefill of {window['window_len']} tokens: eager (host work included), compiled "
            "(torch.compile mode=\"reduce-overhead\": Inductor for SDPA, the dma backend otherwise; CUDA graphs), "
            "and the GPU time of the attention calls summed over layers\n"
            + tabulate(rows, headers=headers, tablefmt="github")
        )


def length_note(calib_len: int, compare_len: int) -> str:
    """Why a policy within its budget at calibration can exceed it here."""
    return (
        f"note: the calibrated policy was calibrated on {calib_len}-token windows and is compared on "
        f"{compare_len}-token ones. Errors grow with length: the sink and diagonal tiles stay in the high format "
        "while the low-format tiles cover more of each row, so a layer within the budget at one length can exceed "
        f"it at a longer one (calibrate with --window-len {compare_len} to compare like with like)"
    )


def plot_layer_errors(result: Comparison, calibrated: ModelPolicy | None, path: str | os.PathLike) -> Path:
    """PNG of each DMA policy's per-layer relative L2 error (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in result.policies if n != "sdpa"]
    layers = [row["layer"] for row in result.layers]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name in names:
        ax.plot(layers, [row[name]["rel_l2"] for row in result.layers], marker="o", markersize=3, label=name)
    stats = (calibrated.stats or {}) if calibrated is not None else {}
    if stats.get("budget"):
        label = f"budget {stats['budget']}"
        if stats.get("window_len"):
            label += f" (calibrated at {stats['window_len']} tokens)"
        ax.axhline(stats["budget"], color="black", linestyle="--", linewidth=1, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("relative L2 error of attention output")
    ax.set_title(f"Per-layer attention error, held-out window of {result.settings['window_len']} tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
