"""The sm90 kernel's block configurations by rule (`attention_sm90.config_for`):
every configuration the rule can choose is one the kernel compiles for (it
divides the tile, is an autotuning candidate for the head_dim, fits in a
Hopper multiprocessor's shared memory), and the table agrees with the
autotuned winners recorded from the H200 (benchmarks/results)."""

import json
import pathlib
from collections import Counter

import pytest

from dma_compile.kernels import attention_sm90
from dma_compile.kernels.attention_sm90 import _CONFIGS, _RULES, _configs_for, config_for, config_key
from dma_compile.kernels.limits import LIMITS
from dma_compile.policy import TILES, AttentionPolicy

HEAD_DIMS = LIMITS["sm90"].head_dims

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "h200_attention_quick.json"
# An H100/H200 multiprocessor's shared memory per block (227 KiB).
SHARED_MEMORY = 227 * 1024


def shared_bytes(config, head_dim: int) -> int:
    """A lower bound on the kernel's shared memory: the pipelined K and V
    blocks (16-bit, the larger case) over num_stages, and the Q block."""
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    return config.num_stages * 2 * bn * head_dim * 2 + bm * head_dim * 2


@pytest.mark.parametrize("major", sorted({m for m, _, _ in _RULES} | {8, 10, 12}))
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("pv_fp8", [False, True])
def test_every_rule_config_serves_the_call(major, head_dim, tile, pv_fp8):
    config = config_for(major, head_dim, tile, pv_fp8)
    bm, bn = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"]
    for size in (bm, bn):
        assert size >= 16 and size & (size - 1) == 0 and tile % size == 0, (config, tile)
    # The rule chooses among the candidates autotuning would time for this call.
    assert config in _configs_for(head_dim, tile)
    assert shared_bytes(config, head_dim) <= SHARED_MEMORY, (config, head_dim)
    assert config.num_warps in (4, 8) and config.num_stages in (2, 3, 4)


def test_rule_entries_are_autotuning_candidates_and_chosen_at_the_default_tile():
    for (major, bucket, pv_fp8), wanted in _RULES.items():
        assert wanted in [config_key(c) for c in _CONFIGS[bucket]], wanted
        assert config_key(config_for(major, bucket, AttentionPolicy().tile, pv_fp8)) == wanted


def test_unmeasured_cases_take_the_first_candidate():
    for major in (8, 10):
        for head_dim in HEAD_DIMS:
            assert config_for(major, head_dim, 128, False) is _configs_for(head_dim, 128)[0]
    assert not any(bucket == 256 for _, bucket, _ in _RULES)
    assert config_for(9, 256, 128, True) is _configs_for(256, 128)[0]


def measured_winners() -> dict[tuple[int, bool], Counter]:
    """(head_dim, FP8 P·V) -> how often each (BLOCK_M, BLOCK_N, warps, stages) won in the H200 run."""
    runs = json.loads(RESULTS.read_text())
    winners: dict[tuple[int, bool], Counter] = {}
    for row in runs["results"]:
        if row["config"] is None or not row["method"].startswith("dma_"):
            continue
        fields = dict(part.split(": ") for part in row["config"].split(", "))
        key = tuple(int(fields[name]) for name in ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"))
        winners.setdefault((row["D"], row["method"].endswith("_fp8pv")), Counter())[key] += 1
    return winners


def test_rules_are_the_measured_winners():
    """Per head_dim and P·V format, the rule's configuration is the one most
    policies' autotuning chose on the H200 (all with the default 128-token tile)."""
    winners = measured_winners()
    assert {head_dim for head_dim, _ in winners} == {64, 128}
    for (head_dim, pv_fp8), counts in winners.items():
        chosen = config_key(config_for(9, head_dim, 128, pv_fp8))
        best = max(counts.values())
        assert counts[chosen] == best and best > sum(counts.values()) / 2, (head_dim, pv_fp8, counts)
    assert set(winners) == {(bucket, fp8) for major, bucket, fp8 in _RULES if major == 9}


def test_kernel_launch_uses_the_rule(monkeypatch):
    """The rule's configuration reaches the launch (block sizes, warps, stages, grid)."""
    import torch

    from dma_compile.kernels import launch

    seen = []
    monkeypatch.setattr(attention_sm90, "INTERPRET", False)
    monkeypatch.setattr(attention_sm90, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(launch, "launch", lambda fn, grid, *args, **kwargs: seen.append((fn, grid, kwargs)))
    b, hq, hk, length = attention_sm90.COMPILE_SHAPE
    for head_dim, pv in [(64, "input"), (64, "fp8"), (128, "input"), (128, "fp8"), (256, "input")]:
        policy = AttentionPolicy.hopper().replace(pv=pv)
        qi = attention_sm90.placeholder_inputs(policy, torch.bfloat16, head_dim)
        seen.clear()
        attention_sm90.attention_from_quantized(qi, (b, hq, hk, length, length, head_dim, head_dim), None, True, 0.1,
                                                policy)
        config = config_for(9, head_dim, policy.tile, pv == "fp8")
        (fn, grid, kwargs), = seen
        assert fn is attention_sm90._dma_attention_kernel
        assert kwargs["BLOCK_M"] == config.kwargs["BLOCK_M"] and kwargs["BLOCK_N"] == config.kwargs["BLOCK_N"]
        assert kwargs["num_warps"] == config.num_warps and kwargs["num_stages"] == config.num_stages
        assert kwargs["K_LO"].block_shape == [1, 1, config.kwargs["BLOCK_N"], head_dim]
        assert grid == (-(-length // config.kwargs["BLOCK_M"]), b * hq)
