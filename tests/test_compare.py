"""compare: tables, perplexity and greedy agreement on a tiny random Llama."""

import json

import pytest
import torch

from dma_compile.calibrate import calibrate
from dma_compile.compare import agreement, compare, perplexity, spread, standard_policies
from dma_compile.hf import running_policy
from dma_compile.policy import AttentionPolicy, ModelPolicy
from test_calibrate import tiny_model, tiny_text, tiny_tokenizer


@pytest.fixture(scope="module")
def setup():
    model, tok, text = tiny_model(), tiny_tokenizer(), tiny_text(2500, seed=2)
    policy = calibrate(model, text, 0.02, "sm100", tokenizer=tok, windows=1, window_len=200, progress=False)
    return model, tok, text, policy


def test_agreement():
    ref = torch.tensor([5, 6, 7, 8])
    assert agreement(ref, ref.clone()) == (4, 1.0)
    assert agreement(ref, torch.tensor([5, 6, 0, 8])) == (2, 0.75)
    assert agreement(ref, torch.tensor([0, 6, 7, 8])) == (0, 0.75)


def test_spread_over_prompts():
    got = spread("first_divergence", [2, 4, 9])
    assert got["first_divergence"] == pytest.approx(5.0)
    # sample standard deviation sqrt(13) over sqrt(3 prompts)
    assert got["first_divergence_sem"] == pytest.approx((13 / 3) ** 0.5)
    assert got["first_divergence_per_prompt"] == [2, 4, 9]
    assert spread("match_rate", [0.5])["match_rate_sem"] == 0.0


def test_perplexity_matches_the_model_loss(setup):
    model, tok, text, _ = setup
    windows = tok(text, return_tensors="pt").input_ids[:, :150].reshape(1, 150)
    with torch.no_grad():
        loss = model(windows, labels=windows).loss.float()
    assert perplexity(model, windows) == pytest.approx(float(loss.exp()), rel=1e-3)


def test_running_policy_changes_and_restores_the_attention(setup):
    model, tok, text, _ = setup
    ids = tok(text, return_tensors="pt").input_ids[:, :260]
    with torch.no_grad():
        before = model(ids).logits
        with running_policy(model, ModelPolicy(AttentionPolicy.preset("all_mxfp4"))):
            assert model.config._attn_implementation == "dma"
            coarse = model(ids).logits
        after = model(ids).logits
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(before, after)
    assert not torch.equal(before, coarse)


def test_compare_tables_and_json(setup, tmp_path):
    model, tok, text, policy = setup
    result = compare(
        model, text, policy, tokenizer=tok, windows=2, window_len=160, prompts=2, prompt_len=60, new_tokens=5,
        plot=tmp_path / "errors.png", progress=False,
    )
    names = list(standard_policies(policy))
    assert names == ["sdpa", "all_mxfp8", "all_mxfp4", "paper", "paper_rotated", "hopper", "calibrated (sm100)"]
    assert list(result.policies) == names
    sdpa = result.policies["sdpa"]
    assert sdpa["first_divergence"] == 5 and sdpa["match_rate"] == 1.0 and sdpa["cost_sm100"] == 1.0
    assert sdpa["first_divergence_per_prompt"] == [5, 5] and sdpa["first_divergence_sem"] == 0.0
    for r in result.policies.values():
        assert len(r["match_rate_per_prompt"]) == 2 and r["match_rate_sem"] >= 0
    for name, r in result.policies.items():
        assert r["perplexity"] > 1 and 0 <= r["match_rate"] <= 1 and 0 <= r["first_divergence"] <= 5
    assert result.policies["all_mxfp4"]["mxfp4_fraction"] == 1.0
    assert result.policies["paper"]["cost_sm100"] < 1.0
    # All-MXFP4 is the coarsest: its per-layer error exceeds the paper's.
    for row in result.layers:
        assert row["all_mxfp4"]["rel_l2"] > row["paper"]["rel_l2"] > 0
    assert len(result.layers) == 2

    report = result.report()
    for heading in ("(a) per-layer", "(b) held-out perplexity"):
        assert heading in report
    assert "calibrated policy" in result.tables["layers"]
    assert "calib. rel L2: calibration's own, on 1 x 200-token windows" in result.tables["layers"]
    assert "5.0 ± 0.0" in result.tables["model"] and "mean ± standard error over the prompts" in report
    # Calibrated at 200 tokens, compared at 160: the report says why errors differ.
    assert "calibrated on 200-token windows and is compared on 160-token ones" in report
    assert "(c)" not in report  # no GPU: no speed table
    assert "CPU run" in report
    assert "holds 1 x 160 tokens of evaluation windows (asked for 2 x 160)" in report
    assert "tokens of prompts" not in report
    assert (tmp_path / "errors.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    result.save_json(tmp_path / "out.json")
    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["policies"]["paper"]["perplexity"] == result.policies["paper"]["perplexity"]
    assert saved["settings"]["window_len"] == 160


def test_no_length_note_when_calibrated_at_the_compared_length(setup):
    model, tok, text, policy = setup
    result = compare(model, text, policy, tokenizer=tok, windows=1, window_len=200, prompts=1, prompt_len=40,
                     new_tokens=2, progress=False)
    assert "Errors grow with length" not in result.report()


def test_plot_into_a_missing_folder_fails_before_any_work(setup, tmp_path, monkeypatch):
    import dma_compile.compare.entry

    def no_work(*args, **kwargs):
        raise AssertionError("the plot path must be checked first")

    monkeypatch.setattr(dma_compile.compare.entry, "load_model", no_work)
    model, tok, text, policy = setup
    with pytest.raises(ValueError, match="plot: directory .* does not exist"):
        compare(model, text, policy, tokenizer=tok, plot=tmp_path / "missing" / "errors.png", progress=False)


def test_compare_rejects_a_policy_for_another_model(setup):
    model, tok, text, policy = setup
    other = ModelPolicy(policy.default, num_layers=30)
    with pytest.raises(ValueError, match="30 attention layers"):
        compare(model, text, other, tokenizer=tok, windows=1, window_len=64, prompts=1, prompt_len=32,
                new_tokens=2, progress=False)
    with pytest.raises(ValueError, match="window_len"):
        compare(model, text, tokenizer=tok, window_len=0, progress=False)


def _wall_clock_timer(monkeypatch):
    """A wall-clock stand-in for `cuda_time_ms`, so that part (c)'s measuring
    code runs on the CPU; returns the list of `graph` flags it was asked for."""
    import time

    import dma_compile.timing

    graph_flags = []

    def wall_ms(fn, repeats=20, graph=True):
        graph_flags.append(graph)
        fn()
        start = time.perf_counter()
        for _ in range(2):
            fn()
        return (time.perf_counter() - start) * 500

    monkeypatch.setattr(dma_compile.timing, "cuda_time_ms", wall_ms)
    return graph_flags


def test_speed_table_with_a_wall_clock_timer(setup, monkeypatch):
    """Part (c) runs on a GPU only (CUDA event timing); here it runs on the CPU
    reference with a wall-clock timer, eager prefill only."""
    from dma_compile.compare import build_tables, measure_speed

    graph_flags = _wall_clock_timer(monkeypatch)
    model, tok, text, policy = setup
    policies = standard_policies(policy)
    window = tok(text, return_tensors="pt").input_ids[0, :64]
    speed = measure_speed(model, policies, window, num_layers=2, compiled=False)
    assert list(speed) == list(policies)
    assert all(set(s) == {"prefill_ms", "attention_ms"} for s in speed.values())
    assert all(s["prefill_ms"] > 0 and s["attention_ms"] > 0 for s in speed.values())
    # Eager prefill is timed with its host work; attention calls by their GPU time (graph replay).
    assert False in graph_flags and True in graph_flags

    result = compare(model, text, policy, tokenizer=tok, windows=1, window_len=64, prompts=1, prompt_len=40,
                     new_tokens=2, progress=False)
    result.speed = speed
    build_tables(result, policies, policy)
    table = result.tables["speed"]
    assert "(c)" in table and "eager prefill ms" in table and "compiled prefill ms" not in table
    for name in policies:
        assert name in table


def test_compiled_prefill_column(setup, monkeypatch):
    """The compiled prefill (torch.compile with mode="reduce-overhead", Inductor
    for SDPA, the dma backend for a policy) is timed and tabulated; on the CPU
    Inductor runs without CUDA graphs."""
    from dma_compile.compare import build_tables, measure_speed

    _wall_clock_timer(monkeypatch)
    model, tok, text, policy = setup
    policies = {"sdpa": None, "calibrated (sm100)": policy}
    window = tok(text, return_tensors="pt").input_ids[0, :64]
    speed = measure_speed(model, policies, window, num_layers=2, compiled=True)
    assert all(s["compiled_prefill_ms"] > 0 for s in speed.values())
    assert model.config._attn_implementation == "sdpa"

    result = compare(model, text, policy, tokenizer=tok, windows=1, window_len=64, prompts=1, prompt_len=40,
                     new_tokens=2, progress=False)
    result.speed = speed
    build_tables(result, policies, policy)
    header = result.tables["speed"].splitlines()[1]
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "policy", "eager prefill ms", "speedup", "compiled prefill ms", "speedup", "attention ms", "speedup"]


@pytest.mark.gpu
def test_cuda_time_ms_replays_a_captured_graph():
    """graph=True: fn runs 3 warm-ups and one capture, then the graph replays;
    graph=False and uncapturable fns (a host sync) run fn every repeat, and
    finding a fn uncapturable leaves the process's CUDA random numbers working."""
    from dma_compile.timing import cuda_time_ms
    from dma_compile.ops import dma_attention

    q, k, v = (torch.randn(1, 4, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    calls = []

    def attention():
        calls.append(1)
        return dma_attention(q, k, v, is_causal=True, policy="hopper")

    assert cuda_time_ms(attention, repeats=7) > 0
    assert len(calls) == 4
    calls.clear()
    assert cuda_time_ms(attention, repeats=7, graph=False) > 0
    assert len(calls) == 10
    calls.clear()

    def syncing():
        calls.append(1)
        return (q.sum() > 0).item()

    assert cuda_time_ms(syncing, repeats=7) > 0
    assert len(calls) == 3 + 7
    assert torch.randn(4, device="cuda").isfinite().all()


@pytest.mark.gpu
def test_speed_on_the_gpu_with_cuda_graphs(setup):
    """Part (c) on CUDA: eager and compiled (CUDA graphs) prefill, attention GPU time."""
    from dma_compile.compare import measure_speed

    model, tok, text, policy = setup
    model = model.cuda()
    try:
        window = tok(text, return_tensors="pt").input_ids[0, :256]
        speed = measure_speed(model, {"sdpa": None, "hopper": standard_policies()["hopper"]}, window, num_layers=2)
        for s in speed.values():
            assert s["prefill_ms"] > 0 and s["compiled_prefill_ms"] > 0 and s["attention_ms"] > 0
    finally:
        model.cpu()
