"""The torch.compile backend "dma" and the same rewrite as an Inductor pass.

    torch.compile(model, backend="dma")                       # device default policy
    torch.compile(model, backend=dma_backend(policy))         # ModelPolicy, AttentionPolicy or JSON path
    install_inductor_pass(policy); torch.compile(model)       # keep the stock Inductor backend

The backend rewrites each SDPA call site of the Dynamo graph into
`torch.ops.dma.attention` (see `dma_compile.passes.rewrite_sdpa`) and hands the
graph to Inductor, taking `mode` and `options` as the Inductor backend does.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

import dma_compile.policy
from dma_compile.ops import check_impl
from dma_compile.passes import rewrite_sdpa as rewrite_module
from dma_compile.passes.rewrite_sdpa import RewriteReport, rewrite_sdpa
from dma_compile.policy import ModelPolicy, as_model_policy, default_policy

logger = logging.getLogger(__name__)

# The files whose code decides what the rewrite produces: part of the pass's cache uuid.
_PASS_SOURCES = (rewrite_module.__file__, dma_compile.policy.__file__, __file__)


def inductor_config_patches(mode: str | None = None, options: dict | None = None) -> dict:
    """Inductor config for `mode` and `options`, as torch.compile's Inductor backend builds it."""
    from torch._inductor import config, list_mode_options

    patches = dict(list_mode_options(mode)) if mode and mode != "default" else {}
    known = config.get_config_copy()
    for key, value in (options or {}).items():
        name = key.replace("-", "_")
        if name not in known:
            raise ValueError(f"options: unknown Inductor option {key!r}")
        patches[name] = value
    return patches


def _log_report(report: RewriteReport) -> None:
    unexpanded = sum(s.unexpanded_kv for s in report.rewritten)
    logger.info(
        "dma: %d of %d SDPA call sites run dma.attention%s",
        len(report.rewritten),
        len(report.sites),
        f" ({unexpanded} on unexpanded GQA K/V)" if unexpanded else "",
    )


class DmaBackend:
    """A Dynamo backend: rewrite SDPA into dma.attention, then compile with Inductor.

    policy: a ModelPolicy, an AttentionPolicy (every layer), a policy JSON path
    or string, or None (each call's device default). impl: the op's impl
    ("auto" picks the kernel per GPU). `reports` keeps one RewriteReport per
    compiled graph, so callers can see which call sites were rewritten.
    """

    def __init__(self, policy: ModelPolicy | str | os.PathLike | None = None, impl: str = "auto"):
        self.policy = as_model_policy(policy)
        self.impl = check_impl(impl)
        self.reports: list[RewriteReport] = []

    def __call__(self, gm: fx.GraphModule, example_inputs, *, mode: str | None = None, options: dict | None = None):
        from torch._inductor.compile_fx import compile_fx

        patches = inductor_config_patches(mode, options)
        report = RewriteReport()
        # Higher-order ops (checkpoint, cond, nested regions) keep their bodies in sub-GraphModules.
        for module in gm.modules():
            if isinstance(module, fx.GraphModule):
                report.sites += rewrite_sdpa(module.graph, self.policy, self.impl).sites
                module.recompile()
        self.reports.append(report)
        _log_report(report)
        return compile_fx(gm, example_inputs, config_patches=patches)

    def __repr__(self) -> str:
        policy = "device default" if self.policy is None else json.dumps(self.policy.to_dict())
        return f"DmaBackend(policy={policy}, impl={self.impl!r})"


_default_backend = DmaBackend()


def dma_backend(policy=None, example_inputs=None, *, impl: str = "auto", mode: str | None = None, options=None):
    """The "dma" backend, or a factory for one with a given policy.

    torch.compile(model, backend=dma_backend) and backend="dma" use the device
    default policy (Dynamo calls this with the graph and its example inputs);
    dma_backend(policy, impl="auto") returns a backend for a ModelPolicy, an
    AttentionPolicy, a policy string or a policy JSON path. Both accept
    torch.compile's `mode` and `options` (Inductor's).
    """
    if isinstance(policy, fx.GraphModule):
        return _default_backend(policy, example_inputs, mode=mode, options=options)
    if example_inputs is not None or mode is not None or options is not None:
        raise ValueError("dma_backend(policy): pass mode and options to torch.compile, not here")
    return DmaBackend(policy, impl)


class SdpaRewritePass(CustomGraphPass):
    """The SDPA rewrite as an Inductor pre-grad pass, cacheable: its uuid covers
    the pass's code and the policy."""

    def __init__(self, policy: ModelPolicy | None, impl: str):
        self.policy = policy
        self.impl = check_impl(impl)

    def __call__(self, graph: fx.Graph) -> None:
        _log_report(rewrite_sdpa(graph, self.policy, self.impl))

    def uuid(self) -> str:
        if self.policy is not None:
            policy = self.policy.to_dict()
            policy.pop("stats")
        else:
            devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
            policy = {d: default_policy(d).to_string() for d in devices}
        text = json.dumps({"policy": policy, "impl": self.impl}, sort_keys=True)
        return hashlib.sha256(get_hash_for_files(_PASS_SOURCES) + text.encode()).hexdigest()


def install_inductor_pass(policy: ModelPolicy | str | os.PathLike | None = None, impl: str = "auto") -> SdpaRewritePass:
    """Make every later torch.compile with the stock Inductor backend rewrite SDPA.

    Installs the rewrite as torch._inductor.config.pre_grad_custom_pass
    (replacing an earlier DMA pass; another pass already there is an error);
    `uninstall_inductor_pass` removes it.
    """
    from torch._inductor import config

    current = config.pre_grad_custom_pass
    if current is not None and not isinstance(current, SdpaRewritePass):
        raise ValueError(
            f"torch._inductor.config.pre_grad_custom_pass already holds {current!r}; "
            "remove it or compose it with the DMA pass yourself"
        )
    config.pre_grad_custom_pass = SdpaRewritePass(as_model_policy(policy), check_impl(impl))
    return config.pre_grad_custom_pass


def uninstall_inductor_pass() -> None:
    """Remove the pass `install_inductor_pass` installed."""
    from torch._inductor import config

    if isinstance(config.pre_grad_custom_pass, SdpaRewritePass):
        config.pre_grad_custom_pass = None
