"""Calibration: choose each attention layer's DMA policy from its own Q, K, V.

The model runs (stock SDPA) on calibration windows of a text while
`dma_compile.capture` records every layer's Q, K, V. For each layer, candidate
policies (high format, low format, diagonal and sink tiles, P·V precision) are
scored by the error of that layer's attention output under the policy (the
reference semantics, causal) against exact attention, and the cheapest
candidate within the budget is kept.

Budget unit: the relative L2 error of a layer's attention output,
||O_dma - O_exact||_2 / ||O_exact||_2 over all heads, rows and channels of the
calibration windows (0.02 = 2 %). The worst row's relative error is recorded
beside it.

The package, one module per job:
  cost        the candidates, the target GPUs' rates and the cost model;
  scoring     `LayerScorer`: a candidate's error, from the reference's pieces;
  allocation  the per-layer choice and the model-level allocations;
  entry       `calibrate()`, the entry point;
  report      `policy_table` and `describe`.
Text and model loading are `dma_compile.loading`, GPU timing
`dma_compile.timing`.
"""

from dma_compile.calibrate.allocation import (
    LayerChoice,
    allocate_model,
    choose_policy,
    layer_sensitivity,
    model_error,
    pareto_front,
    score_candidates,
)
from dma_compile.calibrate.cost import (
    DEFAULT_COST_LEN,
    RATES,
    TARGETS,
    base_policy,
    candidate_policies,
    exact_policy,
    format_fraction,
    measure_rates,
    model_cost,
    model_format_fraction,
    policy_cost,
    resolve_target,
    tile_formats,
)
from dma_compile.calibrate.entry import ALLOCATIONS, ERROR_UNIT, calibrate, calibration_windows, default_windows
from dma_compile.calibrate.report import describe, policy_table
from dma_compile.calibrate.scoring import LayerScorer

__all__ = [
    "ALLOCATIONS",
    "DEFAULT_COST_LEN",
    "ERROR_UNIT",
    "RATES",
    "TARGETS",
    "LayerChoice",
    "LayerScorer",
    "allocate_model",
    "base_policy",
    "calibrate",
    "calibration_windows",
    "candidate_policies",
    "choose_policy",
    "default_windows",
    "describe",
    "exact_policy",
    "format_fraction",
    "layer_sensitivity",
    "measure_rates",
    "model_cost",
    "model_error",
    "model_format_fraction",
    "pareto_front",
    "policy_cost",
    "policy_table",
    "resolve_target",
    "score_candidates",
    "tile_formats",
]
