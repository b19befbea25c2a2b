"""What dma_compile's transformers integration reads from a model: its attention layers, its cache keyword.

Shared by `dma_compile.hf` (the attention implementation) and
`dma_compile.hf_cache` (the quantized KV cache) and the CLI commands.
"""

from __future__ import annotations

import inspect

import torch

from dma_compile.policy import ModelPolicy

# The name models take as `attn_implementation` after `dma_compile.hf.register()`.
NAME = "dma"


def num_attention_layers(model_or_config) -> int:
    """The number of attention layers of a transformers model or config (its text config's)."""
    config = getattr(model_or_config, "config", model_or_config)
    count = getattr(getattr(config, "get_text_config", lambda: config)(), "num_hidden_layers", None)
    if not isinstance(count, int):
        raise ValueError("model: its config has no num_hidden_layers, so its attention layers cannot be counted")
    return count


def checked_layers(policy: ModelPolicy | None, model_or_config) -> int:
    """The model's number of attention layers, after checking that `policy`
    (None: nothing to check) was made for that many."""
    layers = num_attention_layers(model_or_config)
    if policy is not None:
        policy.check_layers(layers)
    return layers


def cache_kwargs(model: torch.nn.Module, cache) -> dict:
    """{keyword: cache} for `model(...)` and `model.generate(...)`: transformers
    renamed `past_key_values` to `cache` (5.2x), and a model given the
    keyword it does not know ignores the cache without an error."""
    params = inspect.signature(type(model).forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}
