"""The `dma::attention` op and its Python entry `dma_attention`.

This is the single door to the kernels: everything above (the compile
backend, the transformers integration, calibration) calls the op. The op
validates its arguments (`dma_compile.validate`), then `route` decides what
runs: with impl="auto", the kernels of `KERNELS` that serve the GPU's compute
capability, in table order, each handing to the next the calls it cannot
serve or where the next measured faster (`Kernel.passes_on`; logged once per
reason), and stock SDPA when none serves the call (reason logged once); the
PyTorch reference on CPU or when asked for. Every path returns its output
in one memory layout (`dma_compile.kernels.output`). A kernel whose
limits (`dma_compile.kernels.limits.LIMITS`: dtypes, head_dims, scale) refuse
the call is passed over without being imported. The policy
travels as a string argument so compiled-graph caches see it.

The op is defined through `torch.library.Library` with one
CompositeExplicitAutograd kernel (the cheapest dispatch path) and a fake
kernel for torch.compile. It has no backward: the argument checks refuse
inputs that require grad while grad mode is on.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dma_compile import validate
from dma_compile.kernels import Unsupported
from dma_compile.kernels.limits import LIMITS, MAX_HEAD_DIM  # noqa: F401 (MAX_HEAD_DIM: for the doors above)
from dma_compile.kernels.output import in_output_layout, output_like
from dma_compile.policy import AttentionPolicy, as_policy
from dma_compile.reference import dma_attention_reference

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Kernel:
    """An attention kernel: where its function lives, and the compute
    capability majors impl="auto" sends to it."""

    module: str
    function: str
    capability_majors: tuple[int, ...]
    # A function of the module that names why, under impl="auto", the next
    # kernel of the route should take a call this one could serve (where the
    # next one measured faster), or returns None; called with the kernel's
    # arguments, after its LIMITS have taken the call.
    passes_on: str | None = None


# impl name -> kernel. impl="auto" tries the kernels that serve the GPU in this
# order, each handing the call to the next where it cannot serve it or its
# `passes_on` says the next one is faster.
KERNELS = {
    "sm90_gluon": Kernel("dma_compile.kernels.attention_sm90_gluon", "attention_sm90_gluon", (9,),
                         passes_on="slower_reason"),
    "sm90": Kernel("dma_compile.kernels.attention_sm90", "attention_sm90", (9,)),
    "sm100": Kernel("dma_compile.kernels.attention_sm100", "attention_sm100", (10,)),
}
IMPLS = ("auto", "reference", *KERNELS)


def check_impl(impl) -> str:
    """Raise ValueError unless `impl` names an implementation of the op: the
    one impl check of every door (the op, dma_attention, backend, pass, hf)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {list(IMPLS)}, got {impl!r}")
    return impl


def check_inputs(q, k, v, attn_mask, is_causal, scale, policy: AttentionPolicy, impl: str) -> None:
    """Raise ValueError naming the offending argument for anything the op does not accept."""
    check_impl(impl)
    validate.check_inputs(q, k, v, attn_mask, is_causal, scale, policy, impl)


@dataclass(frozen=True)
class Route:
    """What runs one call: `kernels` in order, then `fallback` ("sdpa" or
    "reference") if none serves it; no fallback means a kernel's `Unsupported`
    is raised. `reason` says why no kernel is tried, where that is a fallback."""

    kernels: tuple[str, ...] = ()
    fallback: str | None = None
    reason: str | None = None


@functools.lru_cache(maxsize=None)
def route(impl: str, device_type: str, capability: tuple[int, int] | None, short_query: bool) -> Route:
    """The routing decision, from the call's device, its CUDA compute
    capability (None off CUDA) and whether its queries are shorter than the
    policy's `min_q_len` (decode steps, which stock SDPA serves)."""
    if impl == "reference":
        return Route(fallback="reference")
    if impl != "auto":
        return Route(kernels=(impl,))
    if short_query:
        return Route(fallback="sdpa")
    if device_type == "cpu":
        return Route(fallback="reference")
    if device_type != "cuda" or capability is None:
        return Route(fallback="sdpa", reason=f"no DMA kernel for {device_type} tensors")
    kernels = tuple(name for name, kernel in KERNELS.items() if capability[0] in kernel.capability_majors)
    if not kernels:
        return Route(fallback="sdpa", reason=f"no DMA kernel for compute capability {capability[0]}.{capability[1]}")
    return Route(kernels=kernels, fallback="sdpa")


@functools.lru_cache(maxsize=256)
def _parse_policy(text: str) -> AttentionPolicy:
    return AttentionPolicy.from_string(text)


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of `device`, None off CUDA."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


@functools.lru_cache(maxsize=None)
def _kernel(impl: str):
    """The kernel's entry behind its `LIMITS`: a call they refuse raises
    Unsupported before the kernel's module (and Triton) loads. With
    hand_over (a later kernel of the route could take the call), so does a
    call its `passes_on` rule gives away."""
    limits, kernel = LIMITS[impl], KERNELS[impl]

    def call(q, k, v, attn_mask, is_causal, scale, policy, hand_over=False):
        limits.check(q, v, scale)
        if hand_over and kernel.passes_on is not None:
            reason = _entry(kernel.module, kernel.passes_on)(q, k, v, attn_mask, is_causal, scale, policy)
            if reason is not None:
                raise Unsupported(reason)
        return _entry(kernel.module, kernel.function)(q, k, v, attn_mask, is_causal, scale, policy)

    return call


@functools.lru_cache(maxsize=None)
def _entry(module: str, function: str):
    return getattr(importlib.import_module(module), function)


@functools.lru_cache(maxsize=None)
def _warn_fallback_once(reason: str) -> None:
    logger.warning("dma attention: stock SDPA runs instead of the kernel: %s", reason)


@functools.lru_cache(maxsize=None)
def _log_handover_once(name: str, successor: str, reason: str) -> None:
    logger.info("dma attention: %s hands the call to %s: %s", name, successor, reason)


def stock_sdpa(q, k, v, attn_mask, is_causal: bool, scale: float | None) -> torch.Tensor:
    """Stock SDPA on the op's inputs, GQA served as transformers' SDPA path
    serves it: natively, except with a mask on CUDA, where only SDPA's math
    backend takes enable_gqa; there on K/V repeated per query head."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and attn_mask is not None and q.device.type == "cuda":
        k, v = repeat_heads(k, groups), repeat_heads(v, groups)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


def repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """x.repeat_interleave(groups, dim=1) for (B, H, L, D) tensors, through
    torch's concatenation kernel: a copy at memory bandwidth (as Inductor's
    copy of transformers' `repeat_kv`), where repeat_interleave's and
    expand's strided copies run at well under half of it."""
    return torch.stack([x] * groups, dim=2).flatten(1, 2)


def run(plan: Route, q, k, v, attn_mask, is_causal: bool, scale: float | None, policy: AttentionPolicy):
    """Run one validated call as `plan` says."""
    if plan.kernels:
        for name, successor in zip(plan.kernels, (*plan.kernels[1:], None)):
            try:
                return _kernel(name)(q, k, v, attn_mask, is_causal, scale, policy, hand_over=successor is not None)
            except Unsupported as e:
                if successor is not None:
                    _log_handover_once(name, successor, str(e))
                    continue
                if plan.fallback is None:
                    raise
                _warn_fallback_once(f"{name}: {e}")
    elif plan.reason is not None:
        _warn_fallback_once(plan.reason)
    if plan.fallback == "reference":
        return in_output_layout(dma_attention_reference(q, k, v, attn_mask, is_causal, scale, policy))
    return in_output_layout(stock_sdpa(q, k, v, attn_mask, is_causal, scale))


# Dynamo must not trace the kernel when eager code after a graph break calls it.
@torch._disable_dynamo
def _attention(q, k, v, attn_mask, is_causal, scale, policy, impl):
    pol = _parse_policy(policy)
    check_inputs(q, k, v, attn_mask, is_causal, scale, pol, impl)
    b, hq, lq, _ = q.shape
    if b * hq * lq == 0 or k.shape[2] == 0:
        # As SDPA: empty in, empty out; no keys, zeros.
        return output_like(q, v.shape[-1]).zero_()
    device = q.device
    plan = route(impl, device.type, _capability(device), lq < pol.min_q_len)
    return run(plan, q, k, v, attn_mask, is_causal, scale, pol)


def _attention_fake(q, k, v, attn_mask, is_causal, scale, policy, impl):
    check_inputs(q, k, v, attn_mask, is_causal, scale, _parse_policy(policy), impl)
    return output_like(q, v.shape[-1])


_lib = torch.library.Library("dma", "DEF")
# flexible_layout: Inductor may hand the op any strides, so every layer of a
# compiled model shares one mask buffer (and one cached mask classification).
_lib.define(
    "attention(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, bool is_causal, float? scale, str policy, str impl)"
    " -> Tensor",
    tags=(torch.Tag.flexible_layout,),
)
_lib.impl("attention", _attention, "CompositeExplicitAutograd")
torch.library.register_fake("dma::attention", _attention_fake, lib=_lib)


def dma_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    policy: AttentionPolicy | str | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Drop-in for `F.scaled_dot_product_attention` (no dropout) running DMA.

    policy: an AttentionPolicy, its string form or a preset name; None takes
    the device's default. impl: "auto" picks the kernel for the GPU (stock
    SDPA where none serves the call, the reference on CPU); "reference",
    "sm90" and "sm100" force one, the kernels also on CPU tensors under
    TRITON_INTERPRET=1. GQA is served whenever q's heads are a multiple of k's.
    """
    check_impl(impl)
    if torch.compiler.is_compiling():
        # Raise the ValueError while Dynamo traces, rather than from the fake kernel's run.
        pol = as_policy(policy, q.device if isinstance(q, torch.Tensor) else None)
        validate.check_inputs(q, k, v, attn_mask, is_causal, scale, pol, impl)
        text = pol.to_string()
    else:
        # The op checks the rest.
        validate.check_arguments(q, k, v, attn_mask, is_causal, scale)
        text = _policy_text(policy, q.device)
    scale = None if scale is None else float(scale)
    return torch.ops.dma.attention.default(q, k, v, attn_mask, is_causal, scale, text, impl)


@functools.lru_cache(maxsize=256)
def _cached_policy_text(policy: str | None, device: torch.device) -> str:
    return as_policy(policy, device).to_string()


def _policy_text(policy, device: torch.device) -> str:
    if isinstance(policy, AttentionPolicy):
        return policy.to_string()
    if policy is None or isinstance(policy, str):
        return _cached_policy_text(policy, device)
    return as_policy(policy, device).to_string()  # raises the ValueError naming the argument
