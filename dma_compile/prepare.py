"""`warmup`: call the DMA op once per attention shape before the real work.

On a GPU the first call at a new shape compiles the Triton kernels for it
or loads them from Triton's cache (and autotunes where that is on), and
records the launches that later calls of that shape replay
(`kernels.launch`): time that otherwise lands on the first request. `warmup` pays them ahead, for the shapes of a transformers model or
for shapes given explicitly. Off CUDA there is nothing to compile; it checks
each shape and policy against the op on meta tensors instead, so bad shapes
fail here with the op's ValueError.
"""

from __future__ import annotations

import os
import time
from typing import Iterable

import torch
from tqdm import tqdm

from dma_compile.ops import check_impl, dma_attention
from dma_compile.policy import AttentionPolicy, ModelPolicy, as_model_policy, default_policy

MASKS = ("causal", "bool", "none")
# (batch, query heads, key/value heads, length, head_dim)
Shape = tuple[int, int, int, int, int]


def model_shapes(model: torch.nn.Module, lengths: Iterable[int], batch: int = 1) -> list[Shape]:
    """The attention shapes of a transformers model at each prompt length."""
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"model_or_shapes: a model must have a transformers `config`, got {type(model).__name__}")
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return [(batch, heads, kv_heads, length, head_dim) for length in lengths]


def _policies(policy, device: torch.device) -> list[AttentionPolicy]:
    model_policy = as_model_policy(policy)
    if model_policy is None:
        return [default_policy(device)]
    return list(dict.fromkeys([model_policy.default, *model_policy.layers.values()]))


def _check_shape(shape) -> Shape:
    if len(shape) != 5 or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
        raise ValueError(
            f"model_or_shapes: a shape must be 5 positive ints (batch, q_heads, kv_heads, length, head_dim), got {shape!r}"
        )
    return tuple(shape)


def warmup(
    model_or_shapes: torch.nn.Module | Iterable[Shape],
    policy: ModelPolicy | AttentionPolicy | str | os.PathLike | None = None,
    *,
    lengths: Iterable[int] = (1024,),
    masks: Iterable[str] = ("causal", "bool"),
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    impl: str = "auto",
) -> list[dict]:
    """Run the op once per shape, distinct policy and mask form.

    model_or_shapes: a transformers model (its shapes at each of `lengths`,
    on its device and in its dtype) or (batch, q_heads, kv_heads, length,
    head_dim) tuples. policy: as for `dma_backend` (every distinct layer
    policy of a ModelPolicy is warmed); None is the device's default. masks:
    "causal" (is_causal=True, as eager transformers calls it), "bool" (a
    boolean causal mask, as under torch.compile and with padding), "none".
    Returns one record per call: shape, policy, mask and seconds taken.
    """
    check_impl(impl)
    masks = tuple(masks)
    bad = [m for m in masks if m not in MASKS]
    if bad:
        raise ValueError(f"masks must be drawn from {list(MASKS)}, got {bad}")
    if isinstance(model_or_shapes, torch.nn.Module):
        parameter = next(model_or_shapes.parameters(), None)
        device = device or (parameter.device if parameter is not None else None)
        dtype = dtype or (parameter.dtype if parameter is not None else None)
        shapes = model_shapes(model_or_shapes, lengths)
    else:
        shapes = [_check_shape(s) for s in model_or_shapes]
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    policies = _policies(policy, device)
    # Off CUDA nothing compiles: meta tensors run only the op's checks.
    run_on = device if device.type == "cuda" else torch.device("meta")
    jobs = [(s, p, m) for s in shapes for p in policies for m in masks]
    records = []
    with torch.inference_mode():
        for (b, hq, hkv, length, d), pol, mask in tqdm(jobs, desc="dma warmup", disable=run_on.type == "meta"):
            q = torch.randn(b, hq, length, d, device=run_on, dtype=dtype)
            k, v = (torch.randn(b, hkv, length, d, device=run_on, dtype=dtype) for _ in range(2))
            attn_mask = None
            if mask == "bool":
                attn_mask = torch.ones(length, length, dtype=torch.bool, device=run_on).tril().expand(b, 1, -1, -1)
            start = time.perf_counter()
            dma_attention(q, k, v, attn_mask=attn_mask, is_causal=mask == "causal", policy=pol, impl=impl)
            if run_on.type == "cuda":
                torch.cuda.synchronize(run_on)
            records.append(
                {"shape": (b, hq, hkv, length, d), "policy": pol.to_string(), "mask": mask,
                 "seconds": time.perf_counter() - start}
            )
    return records
