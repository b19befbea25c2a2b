"""Hopper DMA kernels (Gluon and portable Triton) against stock SDPA and FlashAttention-3.

First checks the Gluon kernel against the reference (CPU, exact math) on
small awkward shapes, then times, on the same inputs in the same run with
`triton.testing.do_bench` (median), stock SDPA (cuDNN on an H200) on
contiguous inputs (the ratios' base) and on inputs laid out as models pass
them (`sdpa_model_layout`) and through CUDA-graph replay (`graphed_sdpa`),
FA3 bf16 and FP8 when `fa3_fwd_interface` (PyPI `fa3-fwd`) imports, and the
DMA kernels through CUDA-graph replay, quantization pass included. FA3 FP8 gets
inputs cast to e4m3 with one scale per batch·head, its quantization not
counted (as FA3 is used). Prints ratios to SDPA and each method's relative L2
error against bf16 SDPA; writes JSON.

    python benchmarks/bench_hopper.py                       # the issue's table shapes
    python benchmarks/bench_hopper.py --shapes 1,32,32,16384,128,1 --check-only
    git show main:dma_compile/kernels/attention_sm90_gluon.py > /tmp/before.py
    python benchmarks/bench_hopper.py --baseline /tmp/before.py   # a change against the kernel it replaces

`--baseline` takes a version of either kernel's module: attention_sm90_gluon.py
(rows `baseline_<policy>` and `baseline_<policy>_kernel_only`) or the portable
kernel's attention_sm90.py (rows `baseline_triton_<policy>`, beside
`triton_<policy>`).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
import triton
from tabulate import tabulate
from tqdm import tqdm

from dma_compile import AttentionPolicy
from dma_compile.kernels.attention_sm90 import PASS_LAUNCH_LAYOUTS, attention_sm90, pass_launches, quantize_inputs
from dma_compile.kernels.attention_sm90_gluon import (
    attention_sm90_gluon,
    gluon_attention_from_quantized,
    pass_options,
)
from dma_compile.reference import dma_attention_reference

# "hopper" is the default on sm_90 (FP8 P·V); HOPPER keeps P·V in the input dtype.
HOPPER = AttentionPolicy.preset("hopper_input_pv")
POLICIES = {
    "hopper_input_pv": HOPPER,
    "hopper": AttentionPolicy.hopper(),
    "paper_folded": AttentionPolicy(mx_mode="folded"),
    "all_fp8_fp8pv": AttentionPolicy.preset("all_mxfp8").replace(mx_mode="folded", pv="fp8"),
}
# (B, Hq, Hkv, S, D, causal): the shapes of the Gluon-kernel issue's table.
SHAPES = [
    (1, 32, 32, 16384, 128, True), (1, 32, 32, 16384, 128, False), (1, 32, 8, 16384, 128, True),
    (4, 32, 32, 4096, 128, True), (16, 32, 32, 1024, 128, True), (4, 32, 32, 4096, 64, True),
    (1, 32, 32, 16384, 64, True),
]
CHECK_CASES = [  # (name, policy, B, Hq, Hkv, Lq, Lk, D, causal, dtype)
    ("hopper_causal_gqa_tail", HOPPER, 2, 4, 2, 300, 300, 128, True, torch.bfloat16),
    ("hopper_causal", AttentionPolicy.hopper(), 1, 4, 4, 517, 517, 128, True, torch.bfloat16),
    ("paper_folded_lq_lt_lk", AttentionPolicy(mx_mode="folded"), 1, 2, 1, 200, 455, 128, False, torch.bfloat16),
    ("hopper_d64_fp16", HOPPER, 2, 3, 1, 390, 390, 64, True, torch.float16),
    ("all_fp8_fp8pv_lq_gt_lk", POLICIES["all_fp8_fp8pv"], 1, 2, 2, 400, 260, 64, False, torch.bfloat16),
    ("hopper_diag2_sink0", HOPPER.replace(diag_tiles=2, sink_tiles=0), 1, 2, 1, 700, 700, 128, True, torch.bfloat16),
    ("hopper_tile256", HOPPER.replace(tile=256), 1, 2, 2, 640, 640, 128, True, torch.bfloat16),
    ("hopper_short_q", HOPPER, 1, 2, 1, 20, 333, 128, False, torch.bfloat16),
]
# Launch variants of the Gluon kernel (attention_sm90_gluon._kernel_args); _s3 with
# block_n 128 fits shared memory at D 64 only; _pertile: one program per tile
# instead of the persistent grid; _qprologue: Q quantized in the kernel's prologue, not by the pass;
# _pp: the two consumer warpgroups take turns issuing their matmuls (ping-pong).
VARIANTS = {"": {}, "_pp": {"pingpong": True}, "_s3": {"stages": 3}, "_bn64": {"block_n": 64},
            "_bn64_s3": {"block_n": 64, "stages": 3}, "_bn128": {"block_n": 128}, "_pertile": {"programs": 2**31 - 1},
            "_qprologue": {"q_prologue": True}}


def rel_l2(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check(variants):
    """The Gluon kernel against the reference: the bound of tests/test_kernels_sm90.py."""
    rows = []
    for name, policy, b, hq, hk, lq, lk, d, causal, dtype in CHECK_CASES:
        q = torch.randn(b, hq, lq, d, device="cuda").to(dtype)
        k = (torch.randn(b, hk, lk, d, device="cuda") + 0.5).to(dtype)
        v = torch.randn(b, hk, lk, d, device="cuda").to(dtype)
        ref = dma_attention_reference(q.cpu(), k.cpu(), v.cpu(), None, causal, None, policy)
        for vname, variant in variants.items():
            out = attention_sm90_gluon(q, k, v, None, causal, None, policy, **variant).cpu()
            diff = (out.float() - ref.float()).abs()
            ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
            p_round = 2.0**-3 if policy.pv == "fp8" else (2.0**-8 if dtype == torch.bfloat16 else 2.0**-11)
            bound = ulp * ref.float().abs() + p_round * v.float().abs().max().cpu() + 1e-5
            rms = rel_l2(out, ref)
            ok = bool((diff <= bound).all()) and not out.isnan().any() and (policy.pv != "fp8" or rms <= 2.0**-5)
            rows.append({"case": name + vname, "max_abs_err": diff.max().item(), "rel_l2": rms, "ok": ok})
            tqdm.write(str(rows[-1]))
    return rows


def graphed(fn):
    """fn replayed from a CUDA graph: its launches cost no host time."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def fa3():
    try:
        import fa3_fwd_interface
    except ImportError as e:
        print(f"FA3 not timed: {e}", file=sys.stderr)
        return None
    return fa3_fwd_interface.flash_attn_func


def load_baseline(path):
    """Another version of the Gluon or the portable Triton kernel's module (a
    file), to time a change against."""
    spec = importlib.util.spec_from_file_location("kernel_baseline", path)
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: dataclasses look their module up there.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def model_layout(x: torch.Tensor) -> torch.Tensor:
    """x (B, H, S, D) with the memory of a (B, S, H, D) tensor, as transformers passes Q, K and V."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


def in_layout(fn, layout: str):
    """fn run (and so captured in a CUDA graph) with the pass in `layout`'s launches."""
    def run():
        with pass_launches(layout):
            return fn()
    return run


def methods_for(q, k, v, causal, variants, names, baseline=None, layouts=("rule",)):
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # FA3 takes (B, S, H, D)
    gqa = q.shape[1] != k.shape[1]
    qm, km, vm = (model_layout(x) for x in (q, k, v))
    found = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa),
             # cuDNN's speed depends on the layout (BENCHMARKS.md, 2026-12-06): models pass (B, S, H, D) memory.
             "sdpa_model_layout": lambda: F.scaled_dot_product_attention(qm, km, vm, is_causal=causal, enable_gqa=gqa)}
    # The same call replayed from a CUDA graph, as the DMA rows are: whatever
    # SDPA's eager call adds to its GPU time then drops out of the comparison.
    found["graphed_sdpa"] = found["sdpa"]
    flash = fa3()
    if flash is not None:
        found["fa3_bf16"] = lambda: flash(qt, kt, vt, causal=causal)
        q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (qt, kt, vt))
        b, hk = q.shape[0], k.shape[1]
        ones_q = torch.ones(b, hk, device=q.device)
        found["fa3_fp8"] = lambda: flash(q8, k8, v8, causal=causal, q_descale=ones_q, k_descale=ones_q,
                                         v_descale=ones_q)
    shape = (q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3])
    scale = 1.0 / math.sqrt(q.shape[-1])
    for name in names:
        policy = POLICIES[name]
        found[f"triton_{name}"] = lambda p=policy: attention_sm90(q, k, v, None, causal, None, p)
        first = dict(next(iter(variants.values())))
        options = pass_options(first.pop("q_prologue", False))
        qi = quantize_inputs(q, k, v, policy, **options)
        found[f"quant_pass_{name}"] = lambda p=policy: quantize_inputs(q, k, v, p, **options).v
        found[f"gluon_{name}_kernel_only"] = lambda p=policy, qi=qi: gluon_attention_from_quantized(
            qi, shape, causal, scale, p, **first)
        for vname, variant in variants.items():
            found[f"gluon_{name}{vname}"] = lambda p=policy, var=variant: attention_sm90_gluon(
                q, k, v, None, causal, None, p, **var)
        for layout in layouts:
            if layout != "rule":
                found[f"quant_pass_{name}_{layout}_launches"] = in_layout(found[f"quant_pass_{name}"], layout)
                found[f"gluon_{name}_{layout}_launches"] = in_layout(found[f"gluon_{name}{next(iter(variants))}"],
                                                                     layout)
        if baseline is not None and not hasattr(baseline, "attention_sm90_gluon"):
            # A version of the portable kernel's module: its call, beside triton_<policy>.
            found[f"baseline_triton_{name}"] = lambda p=policy: baseline.attention_sm90(q, k, v, None, causal, None, p)
        elif baseline is not None:
            # The baseline's own pass output (its V^T key order may differ from this version's).
            qi_base = baseline.quantize_inputs(q, k, v, policy, **baseline_pass_options(baseline))
            found[f"baseline_{name}_kernel_only"] = lambda p=policy, qi=qi_base: baseline.gluon_attention_from_quantized(
                qi, shape, causal, scale, p, **first)
            found[f"baseline_{name}"] = lambda p=policy: baseline.attention_sm90_gluon(q, k, v, None, causal, None, p)
    return found


def baseline_pass_options(baseline) -> dict:
    """What the baseline's own entry asks of the quantization pass."""
    import inspect

    if hasattr(baseline, "pass_options"):
        return baseline.pass_options()
    return {"v_wgmma_order": True} if "v_wgmma_order=True" in inspect.getsource(baseline.attention_sm90_gluon) else {}


def run(shapes, variants, names, baseline=None, layouts=("rule",)):
    results = []
    for shape in tqdm(shapes, desc="shapes", file=sys.stderr):
        b, hq, hk, s, d, causal = shape
        q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16)
        flops = 4 * b * hq * s * s * d / (2 if causal else 1)
        methods = methods_for(q, k, v, causal, variants, names, baseline, layouts)
        base = methods["sdpa"]()
        row = {"shape": f"B{b} H{hq}/{hk} S{s} D{d}{'' if causal else ' non-causal'}"}
        for name, fn in methods.items():
            try:
                out = fn()
                if isinstance(out, tuple):
                    out = out[0]
                if out.dim() == 4 and out.shape[1] == s and out.shape[2] == hq:
                    out = out.transpose(1, 2)
                err = rel_l2(out, base) if out.shape == base.shape else float("nan")
                ms = bench(graphed(fn) if name.startswith(("gluon", "triton", "quant", "baseline", "graphed")) else fn)
            except Exception as e:  # report and go on: one broken variant must not hide the rest
                tqdm.write(f"{row['shape']} {name}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            results.append({**row, "method": name, "ms": ms, "TFLOPS": flops / ms / 1e9, "rel_l2_vs_sdpa": err})
            tqdm.write(str(results[-1]))
    return results


def table(results):
    sdpa = {r["shape"]: r["ms"] for r in results if r["method"] == "sdpa"}
    methods = list(dict.fromkeys(r["method"] for r in results))
    shapes = list(dict.fromkeys(r["shape"] for r in results))
    cell = {(r["shape"], r["method"]): r for r in results}
    rows = []
    for shape in shapes:
        row = [shape, f"{cell[(shape, 'sdpa')]['TFLOPS']:.0f}" if (shape, "sdpa") in cell else "-"]
        for m in methods[1:]:
            r = cell.get((shape, m))
            row.append(f"{sdpa[shape] / r['ms']:.2f}x" if r and shape in sdpa else "-")
        rows.append(row)
    errors = [["rel L2 vs SDPA (first shape)", ""] + [
        f"{cell[(shapes[0], m)]['rel_l2_vs_sdpa']:.3f}" if (shapes[0], m) in cell else "-" for m in methods[1:]]]
    return tabulate(rows + errors, headers=["shape", "SDPA TFLOPS"] + methods[1:])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", help="B,Hq,Hkv,S,D,causal(0/1) each (default: the issue's table)")
    parser.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["", "_pp"])
    parser.add_argument("--baseline", help="another version of attention_sm90_gluon.py or attention_sm90.py, "
                                           "timed beside this one")
    parser.add_argument("--pass-launches", nargs="+", choices=list(PASS_LAUNCH_LAYOUTS), default=["rule"],
                        help="also time the pass and the Gluon call in these launch layouts (attention_sm90.pass_launches)")
    parser.add_argument("--check-only", action="store_true")
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--out", default="dma-out/bench_hopper.json")
    args = parser.parse_args(argv)
    variants = {v: VARIANTS[v] for v in args.variants}
    shapes = SHAPES if not args.shapes else [
        tuple(int(x) for x in s.split(",")[:5]) + (s.split(",")[5] == "1",) for s in args.shapes]
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv)}
    if not args.no_check:
        torch.manual_seed(0)
        report["check"] = check(variants)
        print(tabulate(report["check"], headers="keys", floatfmt=".3g"))
        if not all(r["ok"] for r in report["check"]):
            print("correctness check FAILED", file=sys.stderr)
    if not args.check_only:
        baseline = load_baseline(args.baseline) if args.baseline else None
        report["results"] = run(shapes, variants, args.policies, baseline, args.pass_launches)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"{report['device']}  torch {report['torch']}  triton {report['triton']}  {report['date']}")
    if not args.check_only:
        print(table(report["results"]))


if __name__ == "__main__":
    main()
