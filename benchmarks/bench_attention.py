"""DMA attention (Hopper Triton kernel) against stock SDPA and its backends.

First checks every DMA policy against the reference on a smaller shape, then
times DMA policies and SDPA (default backend, flash, cuDNN, efficient) on the
same inputs in the same run with `triton.testing.do_bench` (median). DMA times
include the quantization pass. TFLOPS count 4*B*H*Lq*Lk*D (half of it when
causal). Prints a table, writes JSON and a PNG plot of TFLOPS against
sequence length; `--breakdown` also times the quantization pass and the
attention kernel alone, with `--rotate` for each rotation of Q and K
(`AttentionPolicy.rotate`), and the pass's time against the unrotated one;
`--balance` adds each MX policy with Q/K balancing (`AttentionPolicy.balance_qk`)
and its pass's time against the unbalanced one.

    python benchmarks/bench_attention.py --quick
    python benchmarks/bench_attention.py --seq-lens 16384 --head-dims 128 --causal yes --breakdown \
        --methods dma_paper_folded dma_exact dma_hopper sdpa --rotate none hadamard signed_hadamard
    python benchmarks/bench_attention.py --seq-lens 1024 4096 16384 --head-dims 128 --causal yes
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
import triton
from tabulate import tabulate
from tqdm import tqdm

from dma_compile import AttentionPolicy, dma_attention
from dma_compile.reference import dma_attention_reference
from dma_compile.rotation import ROTATIONS

PAPER_FOLDED = AttentionPolicy(mx_mode="folded")
DMA_POLICIES = {
    "dma_hopper": AttentionPolicy.preset("hopper_input_pv"),
    "dma_hopper_fp8pv": AttentionPolicy.hopper(),
    "dma_paper_folded": PAPER_FOLDED,
    "dma_paper_folded_fp8pv": PAPER_FOLDED.replace(pv="fp8"),
    "dma_all_mxfp8": AttentionPolicy.preset("all_mxfp8").replace(mx_mode="folded"),
    "dma_all_mxfp8_fp8pv": AttentionPolicy.preset("all_mxfp8").replace(mx_mode="folded", pv="fp8"),
    "dma_exact": AttentionPolicy(),
    "dma_exact_fp8pv": AttentionPolicy(pv="fp8"),
}
SDPA_BACKENDS = {
    "sdpa": None,
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
}
# Breakdown extras: the kernel with no quantization at all (plain bf16 attention).
PLAIN = AttentionPolicy.preset("exact")
QUICK_SHAPES = [(1, 32, 16384, 128, True), (4, 32, 4096, 64, True)]


def flops(b, h, s, d, causal):
    return 4 * b * h * s * s * d / (2 if causal else 1)


def sdpa_fn(backend, q, k, v, causal):
    if backend is None:
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, backend)

    def run():
        with sdpa_kernel([chosen]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def check(modes, names, device, rotations=("none",)):
    """Each DMA policy (with each rotation) against the reference (error bound of tests/test_kernels_sm90.py)."""
    rows = []
    for d, causal in modes:
        q, k, v = (torch.randn(1, 4, 1024, d, device=device, dtype=torch.bfloat16) for _ in range(3))
        for name, rot in ((n, r) for n in names for r in rotations if r == "none" or DMA_POLICIES[n].uses_mx):
            policy = DMA_POLICIES[name].replace(rotate=rot)
            out = dma_attention(q, k, v, is_causal=causal, policy=policy, impl="sm90")
            # On the CPU: formats' rceil rule was seen to misjudge ties on CUDA.
            ref = dma_attention_reference(q.cpu(), k.cpu(), v.cpu(), None, causal, None, policy).to(device)
            p_round = 2.0**-3 if policy.pv == "fp8" else 2.0**-8
            diff = (out.float() - ref.float()).abs()
            bound = 2.0**-7 * ref.float().abs() + p_round * v.float().abs().max() + 1e-5
            rms = (diff.pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt()).item()
            ok = bool((diff <= bound).all()) and (policy.pv != "fp8" or rms <= 2.0**-5)
            rows.append({"D": d, "causal": causal, "method": name, "rotate": rot, "max_abs_err": diff.max().item(),
                         "rel_rms_err": rms, "ok": ok})
    return rows


def fp8_cast_check(device):
    """How the hardware float32 -> e4m3 cast (used for P in FP8 P·V) compares with
    nearest-even rounding: mismatches among all bf16 values in e4m3's range."""
    import triton.language as tl

    from dma_compile.formats import E4M3, round_to_element

    @triton.jit
    def cast(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n).to(tl.float8e4nv), mask=offs < n)

    x = torch.arange(1 << 16, dtype=torch.int32, device=device).to(torch.int16).view(torch.bfloat16).float()
    x = x[x.abs() <= 448]
    x = torch.cat([x, torch.rand(1 << 20, device=device) * 2.0 ** torch.randint(-16, 9, (1 << 20,), device=device)])
    y = torch.empty(x.numel(), dtype=torch.float8_e4m3fn, device=device)
    cast[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    want = round_to_element(x, E4M3)
    bad = y.float() != want
    return {"values": x.numel(), "mismatches": int(bad.sum()),
            "mismatches_below_2^-6": int((bad & (want.abs() < 2.0**-6)).sum()),
            "examples": [(float(a), float(b), float(c)) for a, b, c in zip(x[bad][:4], y.float()[bad][:4], want[bad][:4])]}


def quant_bytes(q, k, v, qi):
    """Bytes the quantization pass must move at least: inputs read once, outputs written once."""
    inputs = {q.data_ptr(), k.data_ptr(), v.data_ptr()}
    read = q.nbytes + k.nbytes + (v.nbytes if qi.v_scales is not None else 0)
    written, seen = 0, set()
    tensors = [qi.v, qi.v_scales]
    for op in (qi.q_hi, qi.k_hi, qi.q_lo, qi.k_lo):
        tensors += [op.values, op.exponents, op.scales]
    for t in tensors:
        if t is not None and t.data_ptr() not in inputs and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            written += t.nbytes
    return read + written


def breakdown(shape, names, device, rotations=("none",), balance=False):
    from dma_compile.kernels.attention_sm90 import attention_from_quantized, quantize_inputs
    from dma_compile.timing import cuda_time_ms

    b, h, s, d, causal = shape
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16) for _ in range(3))
    scale = 1.0 / math.sqrt(d)
    dims = (b, h, h, s, s, d, d)
    rows = []
    # Unrotated first: the rotated rows are compared with it.
    rotations = sorted(set(rotations), key=lambda r: (r != "none", r))
    policies = [(n if rot == "none" else f"{n} rot={rot}", DMA_POLICIES[n].replace(rotate=rot), n)
                for n in names for rot in rotations if rot == "none" or DMA_POLICIES[n].uses_mx]
    if balance:
        policies += [(f"{name} balanced", policy.replace(balance_qk=True), name)
                     for name, policy, _ in list(policies) if policy.uses_mx]
    policies.append(("plain_bf16_kernel", PLAIN, "plain_bf16_kernel"))
    unrotated, unbalanced = {}, {}
    for name, policy, base in policies:
        qi = quantize_inputs(q, k, v, policy)
        # GPU time by CUDA graph replay: the pass's launches take longer on the host than on the GPU.
        t_quant = cuda_time_ms(lambda: quantize_inputs(q, k, v, policy), repeats=50)
        t_kernel = bench(lambda: attention_from_quantized(qi, dims, None, causal, scale, policy))
        t_full = bench(lambda: dma_attention(q, k, v, is_causal=causal, policy=policy, impl="sm90"))
        rows.append({
            "B": b, "H": h, "S": s, "D": d, "causal": causal, "method": name,
            "full_ms": t_full, "quant_ms": t_quant, "kernel_ms": t_kernel,
            "quant_TBps": quant_bytes(q, k, v, qi) / (t_quant * 1e-3) / 1e12 if policy.uses_mx else None,
            "kernel_TFLOPS": flops(b, h, s, d, causal) / (t_kernel * 1e-3) / 1e12,
            "full_TFLOPS": flops(b, h, s, d, causal) / (t_full * 1e-3) / 1e12,
        })
        if policy.balance_qk:
            # Balancing's share: its added time over the same pass without it.
            rows[-1]["quant_vs_unbalanced"] = t_quant / unbalanced[base] - 1
        elif policy.rotate == "none":
            unrotated[base] = unbalanced[name] = t_quant
        elif base in unrotated:
            # The rotation's share: its added time over the unrotated pass.
            rows[-1]["quant_vs_unrotated"] = t_quant / unrotated[base] - 1
            unbalanced[name] = t_quant
        tqdm.write(str(rows[-1]))
    return rows


def run_shapes(shapes, names, sdpa_names, device):
    from dma_compile.kernels.attention_sm90 import tuned_config

    results = []
    todo = [(shape, m) for shape in shapes for m in sdpa_names + names]
    inputs = {}
    for shape, method in tqdm(todo, desc="timing", file=sys.stderr):
        b, h, s, d, causal = shape
        if shape not in inputs:
            inputs.clear()
            inputs[shape] = tuple(torch.randn(b, h, s, d, device=device, dtype=torch.bfloat16) for _ in range(3))
        q, k, v = inputs[shape]
        if method in SDPA_BACKENDS:
            fn = sdpa_fn(SDPA_BACKENDS[method], q, k, v, causal)
        else:
            policy = DMA_POLICIES[method]
            fn = lambda: dma_attention(q, k, v, is_causal=causal, policy=policy, impl="sm90")  # noqa: E731
        config = None
        try:
            fn()
            if method in DMA_POLICIES:
                config = str(tuned_config(
                    torch.cuda.get_device_capability(device)[0], d, policy.tile, policy.pv == "fp8"))
            ms = bench(fn)
        except RuntimeError as e:  # an SDPA backend that does not take this shape
            print(f"{method} {shape}: {str(e).splitlines()[0]}", file=sys.stderr)
            ms = None
        tflops = flops(b, h, s, d, causal) / (ms * 1e-3) / 1e12 if ms else None
        results.append({"B": b, "H": h, "S": s, "D": d, "causal": causal, "method": method, "ms": ms,
                        "TFLOPS": tflops, "config": config})
        tqdm.write(f"{shape} {method}: {ms} ms, {tflops} TFLOPS, {config}")
    return results


def table(results, sdpa_names):
    by_shape = {}
    for r in results:
        by_shape.setdefault((r["S"], r["D"], r["causal"], r["B"], r["H"]), {})[r["method"]] = r
    rows = []
    for (s, d, causal, b, h), methods in by_shape.items():
        for name, r in methods.items():
            row = [s, d, "yes" if causal else "no", f"{b}x{h}", name,
                   f"{r['ms']:.3f}" if r["ms"] else "-", f"{r['TFLOPS']:.0f}" if r["TFLOPS"] else "-"]
            for base in sdpa_names:
                other = methods.get(base)
                ok = r["ms"] and other and other["ms"]
                row.append(f"{other['ms'] / r['ms']:.2f}" if ok else "-")
            rows.append(row)
    headers = ["S", "D", "causal", "BxH", "method", "ms", "TFLOPS"] + [f"x {n}" for n in sdpa_names]
    return tabulate(rows, headers=headers)


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["D"], r["causal"]) for r in results})
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, (d, causal) in zip(axes[0], panels):
        methods = sorted({r["method"] for r in results if (r["D"], r["causal"]) == (d, causal)})
        for m in methods:
            pts = sorted((r["S"], r["TFLOPS"]) for r in results
                         if (r["D"], r["causal"], r["method"]) == (d, causal, m) and r["TFLOPS"])
            if pts:
                ax.plot(*zip(*pts), marker="o", label=m, linestyle="--" if m.startswith("sdpa") else "-")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel("TFLOPS")
        ax.set_title(f"head_dim {d}, {'causal' if causal else 'non-causal'}")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the target shapes (B=1 H=32 S=16k D=128 and "
                        "B=4 H=32 S=4k D=64, causal), with --breakdown")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--causal", choices=["yes", "no", "both"], default="both")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=16384, help="batch = max(1, tokens // seq_len)")
    parser.add_argument("--methods", nargs="+", choices=list(DMA_POLICIES) + list(SDPA_BACKENDS),
                        default=list(DMA_POLICIES) + list(SDPA_BACKENDS))
    parser.add_argument("--breakdown", action="store_true", help="also time the quantization pass and the kernel alone")
    parser.add_argument("--rotate", nargs="+", choices=list(ROTATIONS), default=["none"],
                        help="--breakdown: time the quantization pass with each rotation of Q and K")
    parser.add_argument("--balance", action="store_true",
                        help="--breakdown: also time each MX policy's pass with Q/K balancing")
    parser.add_argument("--no-check", action="store_true", help="skip the correctness check")
    parser.add_argument("--out-dir", default="dma-out/bench")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention needs a CUDA GPU (the sm90 kernel)")
    device = "cuda"
    names = [m for m in args.methods if m in DMA_POLICIES]
    sdpa_names = [m for m in args.methods if m in SDPA_BACKENDS]
    causal = {"yes": [True], "no": [False], "both": [True, False]}[args.causal]
    if args.quick:
        shapes = QUICK_SHAPES
    else:
        shapes = [(max(1, args.tokens // s), args.heads, s, d, c) for d in args.head_dims for c in causal
                  for s in args.seq_lens]
    os.makedirs(args.out_dir, exist_ok=True)
    report = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(sys.argv),
    }
    if not args.no_check:
        report["check"] = check(sorted({(s[3], s[4]) for s in shapes}), names, device, args.rotate)
        report["fp8_cast"] = fp8_cast_check(device)
        print("hardware float32 -> e4m3 cast vs nearest-even:", report["fp8_cast"])
        print(tabulate(report["check"], headers="keys", floatfmt=".3g"))
        if not all(r["ok"] for r in report["check"]):
            raise SystemExit("correctness check failed: not timing")
    report["results"] = run_shapes(shapes, names, sdpa_names, device)
    save(report, args.out_dir)
    plot(report["results"], os.path.join(args.out_dir, "bench_attention.png"))
    print(f"{report['device']}  torch {report['torch']}  triton {report['triton']}  {report['date']}")
    print(table(report["results"], sdpa_names))
    if args.breakdown or args.quick:
        report["breakdown"] = [r for shape in shapes for r in breakdown(shape, names, device, args.rotate, args.balance)]
        save(report, args.out_dir)
        print(tabulate(report["breakdown"], headers="keys", floatfmt=".3f"))


def save(report, out_dir):
    with open(os.path.join(out_dir, "bench_attention.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
