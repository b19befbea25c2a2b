"""Part (c) of a comparison, on a GPU: prefill latency and attention GPU time per policy."""

from __future__ import annotations

import torch

from dma_compile import timing
from dma_compile.hf import running_policy
from dma_compile.policy import ModelPolicy


def attention_time_ms(config, policy: ModelPolicy | None, seq_len: int, device: torch.device, num_layers: int) -> float:
    """Summed attention time of all layers for one causal prefill of `seq_len`
    tokens: the DMA op (kernels via impl="auto") or SDPA."""
    from dma_compile.ops import dma_attention

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q = torch.randn(1, config.num_attention_heads, seq_len, head_dim, device=device, dtype=torch.bfloat16)
    k = torch.randn(1, config.num_key_value_heads, seq_len, head_dim, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    if policy is None:
        gqa = q.shape[1] != k.shape[1]
        return num_layers * timing.cuda_time_ms(
            lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        )
    per_policy: dict[str, float] = {}
    total = 0.0
    for layer in range(num_layers):
        pol = policy.for_layer(layer)
        key = pol.to_string()
        if key not in per_policy:
            per_policy[key] = timing.cuda_time_ms(lambda: dma_attention(q, k, v, is_causal=True, policy=pol))
        total += per_policy[key]
    return total


def prefill_ms(model, window: torch.Tensor) -> float:
    """Eager prefill, host work included (what an uncompiled model costs)."""

    ids = window[None].to(next(model.parameters()).device)
    with torch.no_grad():
        return timing.cuda_time_ms(lambda: model(ids, use_cache=False), repeats=5, graph=False)


def compiled_prefill_ms(model, policy: ModelPolicy | None, window: torch.Tensor) -> float:
    """Prefill under torch.compile(mode="reduce-overhead"): Inductor with stock
    SDPA (policy None) or the "dma" backend, replayed through CUDA graphs, so
    small models are not timed by their kernel launches. Resets Dynamo's
    caches before and after, so each policy compiles afresh."""
    from dma_compile.backend import dma_backend

    ids = window[None].to(next(model.parameters()).device)
    torch._dynamo.reset()
    backend = "inductor" if policy is None else dma_backend(policy)
    compiled = torch.compile(model, backend=backend, mode="reduce-overhead", fullgraph=True)
    try:
        with torch.no_grad():
            return timing.cuda_time_ms(lambda: compiled(ids, use_cache=False), repeats=5, graph=False)
    finally:
        torch._dynamo.reset()


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
