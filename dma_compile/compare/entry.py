"""The comparison entry point: `compare(model, text, policy)` -> Comparison."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from dma_compile.calibrate.cost import DEFAULT_COST_LEN, model_cost, model_format_fraction
from dma_compile.compare.measures import agreement, greedy_tokens, layer_errors, perplexity, spread
from dma_compile.compare.result import Comparison, Settings
from dma_compile.compare.speed import measure_speed
from dma_compile.compare.tables import build_tables, length_note, plot_layer_errors
from dma_compile.hf import checked_layers, running_policy
from dma_compile.loading import load_model, split_heldout, take_windows, tokenize
from dma_compile.policy import ModelPolicy, reference_policies


def standard_policies(calibrated: ModelPolicy | None = None) -> dict[str, ModelPolicy | None]:
    """The policies every comparison reports, SDPA (None) first."""
    policies: dict[str, ModelPolicy | None] = {"sdpa": None}
    policies.update((name, ModelPolicy(p)) for name, p in reference_policies().items())
    if calibrated is not None:
        target = (calibrated.stats or {}).get("target")
        policies[f"calibrated ({target})" if target else "calibrated"] = calibrated
    return policies


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

    if plot is not None and not Path(plot).absolute().parent.is_dir():
        raise ValueError(f"plot: directory {os.fspath(Path(plot).absolute().parent)!r} does not exist")
    model, loaded_tokenizer = load_model(model)
    tokenizer = tokenizer or loaded_tokenizer
    if tokenizer is None:
        raise ValueError("tokenizer: pass tokenizer= with a model object")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("text: the evaluation text is empty")
    num_layers = checked_layers(policy, model)
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
    build_tables(result, policies, policy)
    if plot is not None:
        result.plot = os.fspath(plot_layer_errors(result, policy, plot))
    return result
