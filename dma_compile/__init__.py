"""dma-compile: Diagonal-Tiled Mixed-Precision Attention (DMA) for PyTorch.

`dma_attention` is a drop-in for `scaled_dot_product_attention` that runs QK^T
in MXFP8 on the sink and diagonal tiles of the score matrix and in MXFP4 (or
another format the policy names) elsewhere. `torch.compile(model,
backend="dma")` rewrites a model's SDPA calls into it: Dynamo finds the name
through the installed entry point, or, in a source checkout that was never
installed, through the registration below on `import dma_compile`.

Every name below loads its module on first use, so `import dma_compile` (and
with it `dma-compile --help`) does not import torch where the package is
installed.
"""

import importlib
import sys
import types
from importlib.metadata import entry_points

__version__ = "0.1.0"

_LAZY = {
    "AttentionPolicy": "dma_compile.policy",
    "ModelPolicy": "dma_compile.policy",
    "default_policy": "dma_compile.policy",
    "calibrate": "dma_compile.calibrate",
    "dma_attention": "dma_compile.ops",
    "quantize_mx": "dma_compile.formats",
    "dma_backend": "dma_compile.backend",
    "install_inductor_pass": "dma_compile.backend",
    "decode_attention": "dma_compile.ops_decode",
    "warmup": "dma_compile.prepare",
}


def _dma_backend(gm, example_inputs, **kwargs):
    """backend="dma" when registered on import: `dma_backend`, loaded on first use."""
    from dma_compile.backend import dma_backend

    return dma_backend(gm, example_inputs, **kwargs)


def _register_backend() -> None:
    # With the entry point installed Dynamo registers the name itself when it
    # loads it, and refuses a second registration.
    if not entry_points(group="torch_dynamo_backends", name="dma"):
        from torch._dynamo import register_backend

        register_backend(_dma_backend, name="dma")


_register_backend()


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dma_compile' has no attribute {name!r}")


class _Package(types.ModuleType):
    """Importing the submodule `dma_compile.calibrate` binds it as the package's
    attribute `calibrate`; the package's `calibrate` stays the function."""

    def __setattr__(self, name, value):
        if name == "calibrate" and isinstance(value, types.ModuleType):
            value = value.calibrate
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

__all__ = list(_LAZY)
