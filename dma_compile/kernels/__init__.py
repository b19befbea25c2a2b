"""Triton kernels behind `torch.ops.dma.attention` (imported lazily by ops.py).

`numerics` holds the rounding and conversion helpers every kernel shares,
`quantize` is the fused quantization pass over Q, K and V, `masks` classifies
explicit attention masks into blocks, `attention_sm90` is the Hopper kernel,
`launch` holds the autotuning switch and the replay of repeated calls' launches.
`limits` states what each attention kernel serves; a kernel that cannot
serve a call raises `Unsupported`, and `impl="auto"` then falls back to
stock SDPA (dma_compile.ops.run).
"""


class Unsupported(ValueError):
    """The kernel cannot serve this call (the message says why)."""
