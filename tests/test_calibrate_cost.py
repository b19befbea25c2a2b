"""dma_compile.calibrate.cost: the candidate grid and the cost model."""

import pytest

from dma_compile.calibrate import candidate_policies, exact_policy, format_fraction, policy_cost, resolve_target
from dma_compile.calibrate.cost import ROTATION
from dma_compile.policy import AttentionPolicy


def test_cost_model_known_values():
    # 2048 tokens = 16 tiles: 136 visible tiles, paper has 16 diagonal + 15 sink tiles high.
    paper = AttentionPolicy.paper()
    assert policy_cost(paper, "sm100", 2048) == pytest.approx((31 * 1 + 105 * 0.5 + 136 * 2) / (136 * 4))
    assert format_fraction(paper, 2048) == pytest.approx(105 / 136)
    assert policy_cost(AttentionPolicy.hopper(), "sm90", 2048) == pytest.approx((31 + 105 * 0.5 + 136 * 0.5) / 272)
    assert policy_cost(AttentionPolicy.preset("hopper_input_pv"), "sm90", 2048) == pytest.approx(
        (31 + 105 * 0.5 + 136) / 272)
    # Exact MX numerics on Hopper run at bf16 speed.
    assert policy_cost(paper, "sm90", 2048) == pytest.approx(1.0)
    assert policy_cost(exact_policy("sm100"), "sm100") == pytest.approx(1.0)
    assert policy_cost(paper.replace(pv="fp8"), "sm100") < policy_cost(paper, "sm100")
    assert policy_cost(paper.replace(diag_tiles=4), "sm100") > policy_cost(paper, "sm100")


def test_candidates_are_distinct_and_cover_the_grid():
    for target in ("sm90", "sm100"):
        candidates = candidate_policies(target)
        strings = [p.to_string() for p in candidates]
        assert len(strings) == len(set(strings)) == 3 * 4 * 3 * 2 + 2
        assert {p.pv for p in candidates} == {"input", "fp8"}
        assert {p.diag_tiles for p in candidates} == {1, 2, 4, 8}
    assert all(p.mx_mode == "folded" for p in candidate_policies("sm90"))
    assert resolve_target("sm90") == "sm90"
    with pytest.raises(ValueError, match="target"):
        resolve_target("sm80")


def test_mxfp4_candidates_get_a_rotated_twin_for_power_of_two_head_dims():
    for target in ("sm90", "sm100"):
        plain = candidate_policies(target)
        with_twins = candidate_policies(target, head_dim=64)
        rotated = [p for p in with_twins if p.rotate != "none"]
        assert {p.rotate for p in rotated} == {ROTATION}
        assert all(p.lo == "mxfp4_e2m1" for p in rotated)
        assert not any(p.balance_qk for p in with_twins)
        # Every MXFP4 candidate has its twin, and nothing else changed.
        assert len(rotated) == sum(p.lo == "mxfp4_e2m1" for p in plain)
        assert {p.replace(rotate="none").to_string() for p in rotated} <= {p.to_string() for p in plain}
        assert [p.to_string() for p in candidate_policies(target, head_dim=96)] == [p.to_string() for p in plain]


def test_exact_policy_is_the_exact_preset_on_the_targets_base():
    for target, base in (("sm90", AttentionPolicy.hopper()), ("sm100", AttentionPolicy.paper())):
        exact = exact_policy(target)
        assert (exact.hi, exact.lo, exact.pv, exact.smooth_k) == ("none", "none", "input", False)
        assert exact.mx_mode == base.mx_mode
