"""dma-compile: Diagonal-Tiled Mixed-Precision Attention (DMA) for PyTorch.

`dma_attention` is a drop-in for `scaled_dot_product_attention` that runs QK^T
in MXFP8 on the sink and diagonal tiles of the score matrix and in MXFP4 (or
another format the policy names) elsewhere. `torch.compile(model,
backend="dma")` rewrites a model's SDPA calls into it.

Every name below loads its module on first use, so `import dma_compile` (and
with it `dma-compile --help`) does not import torch.
"""

import importlib
import sys
import types

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
}


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
