"""dma-compile: Diagonal-Tiled Mixed-Precision Attention (DMA) for PyTorch.

`dma_attention` is a drop-in for `scaled_dot_product_attention` that runs QK^T
in MXFP8 on the sink and diagonal tiles of the score matrix and in MXFP4 (or
another format the policy names) elsewhere. `torch.compile(model,
backend="dma")` rewrites a model's SDPA calls into it: Dynamo finds the name
through the installed entry point, or, in a source checkout that was never
installed, through the registration below on `import dma_compile`.
"""

from importlib.metadata import entry_points

from dma_compile.calibrate import calibrate
from dma_compile.formats import quantize_mx
from dma_compile.ops import dma_attention
from dma_compile.ops_decode import decode_attention  # registers dma::decode_attention
from dma_compile.policy import AttentionPolicy, ModelPolicy, default_policy
from dma_compile.prepare import warmup

__version__ = "0.1.0"

# Heavier layers load on first use, so `import dma_compile` stays cheap.
_LAZY = {
    "dma_backend": "dma_compile.backend",
    "install_inductor_pass": "dma_compile.backend",
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
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dma_compile' has no attribute {name!r}")


__all__ = [
    "AttentionPolicy",
    "ModelPolicy",
    "calibrate",
    "decode_attention",
    "default_policy",
    "dma_attention",
    "quantize_mx",
    "warmup",
    *_LAZY,
]
