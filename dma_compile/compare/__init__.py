"""Side-by-side comparison of attention policies on a model and a text.

For stock SDPA, all-MXFP8, all-MXFP4, the paper's DMA policy, the Hopper
default and (when given) a calibrated policy, on held-out windows of the text
(its last HELDOUT_FRACTION, which calibration never sees):
  (a) per layer: the policy and the relative L2 error of the layer's attention
      output against exact attention (and a PNG plot of it);
  (b) perplexity, and greedy-generation agreement with SDPA (tokens until the
      first divergence, exact-match rate over the generated tokens; mean and
      standard error over the prompts), with each policy's modelled cost;
  (c) on a GPU: prefill latency, eager and compiled with CUDA graphs, and
      the GPU time of the attention calls, against SDPA.
The DMA policies run through the "dma" attention implementation of
`dma_compile.hf`, which calls the `dma::attention` op (kernels on a GPU, the
reference on CPU).

The package: `entry` (`compare()`), `result` (`Settings`, `Comparison`),
`measures` (perplexity, agreement, per-layer errors), `speed` (part (c)),
`tables` (the tables and the plot).
"""

from dma_compile.compare.entry import compare, standard_policies
from dma_compile.compare.measures import agreement, greedy_tokens, layer_errors, perplexity, spread
from dma_compile.compare.result import CPU_SETTINGS, GPU_SETTINGS, Comparison, Settings
from dma_compile.compare.speed import attention_time_ms, compiled_prefill_ms, measure_speed, prefill_ms
from dma_compile.compare.tables import build_tables, length_note, plot_layer_errors

__all__ = [
    "CPU_SETTINGS",
    "GPU_SETTINGS",
    "Comparison",
    "Settings",
    "agreement",
    "attention_time_ms",
    "build_tables",
    "compare",
    "compiled_prefill_ms",
    "greedy_tokens",
    "layer_errors",
    "length_note",
    "measure_speed",
    "perplexity",
    "plot_layer_errors",
    "prefill_ms",
    "spread",
    "standard_policies",
]
