"""Experiment for issue 18: two changes to how Q and K are quantized, tried in the reference first.

--balance: before MX quantization (and the rotation), channel j of Q is
multiplied, and channel j of K divided, by one power of two per (batch, KV
head): 2^round(log2(amax_K[j] / amax_Q[j]) / 2), the amaxes over the call's
tokens (and over the query heads of the group for Q). Scores are unchanged
in exact arithmetic; the two operands' channel ranges meet halfway
(SmoothQuant's balancing, applied between Q and K). "none" tiles keep Q and
K as they are. `--balance k` takes K's statistics alone (no query row's
content moves another's output, as a padded batch needs):
2^round(log2(amax_K[j] / g) / 2), g the geometric mean of amax_K over channels.

--least-squares-exponents: each MXFP4 block takes rceil's exponent or the one
below it, whichever gives the smaller squared error (the one below clips the
block's largest values).

Both are patched into the PyTorch reference, so this runs on the CPU only,
where the "dma" attention is the reference; no kernel has them. The other
arguments go to rotation_accuracy.py, whose table this prints.

    export DMA_COMPILE_CACHE=/work/dma-cache
    python benchmarks/qk_scaling_accuracy.py --balance --windows 4 --skip-windows 2 \\
        --policies all_mxfp4,paper,hopper --rotations none,signed_hadamard
"""

from __future__ import annotations

import argparse
import sys

import torch

import dma_compile.formats as formats
import dma_compile.reference as reference


def balanced(format_scores, by: str = "qk"):
    """`reference.format_scores` with Q and K balanced per channel before MX
    quantization, from both operands' statistics ("qk") or K's alone ("k")."""

    def scores(qc, kc, fmt, policy, scale, q_dtype, k_dtype):
        if fmt == "none":
            return format_scores(qc, kc, fmt, policy, scale, q_dtype, k_dtype)
        b, hq, lq, d = qc.shape
        hk = kc.shape[1]
        q_rows = qc.reshape(b, hk, hq // hk * lq, d)
        k_amax = kc.abs().amax(2, keepdim=True).clamp_min(1e-6)
        if by == "k":
            reference_amax = torch.exp2(torch.log2(k_amax).mean(-1, keepdim=True))
        else:
            reference_amax = q_rows.abs().amax(2, keepdim=True).clamp_min(1e-6)
        s = torch.exp2(torch.round(0.5 * torch.log2(k_amax / reference_amax)))
        return format_scores((q_rows * s).reshape(qc.shape), kc / s, fmt, policy, scale, q_dtype, k_dtype)

    return scores


def least_squares(scale_exponents):
    """`formats.scale_exponents` choosing, for MXFP4, rceil's exponent or the one below by squared error."""

    def exponents(x, fmt, scale_rule="rceil"):
        exp = scale_exponents(x, fmt, scale_rule)
        if fmt != "mxfp4_e2m1":
            return exp
        element = formats.check_format(fmt)
        blocks = formats._block_view(x).float()
        lower = torch.clamp(exp - 1, min=-formats.E8M0_BIAS)
        errors = []
        for e in (exp, lower):
            shift = e.unsqueeze(-1).float()
            values = torch.ldexp(formats.round_to_element(torch.ldexp(blocks, -shift), element), shift)
            errors.append(torch.nan_to_num((values - blocks).square().sum(-1), nan=0.0))
        return torch.where(errors[1] < errors[0], lower, exp)

    return exponents


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--balance", nargs="?", const="qk", choices=["qk", "k"],
                        help="balance Q and K per channel, from both operands' statistics (qk, the default) or K's")
    parser.add_argument("--least-squares-exponents", action="store_true", help="MXFP4 exponents by squared error")
    parser.add_argument("-h", "--help", action="store_true")
    args, rest = parser.parse_known_args(argv)
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import rotation_accuracy

    if args.help:
        print(__doc__)
        parser.print_help()
        return rotation_accuracy.main(["--help"])
    if torch.cuda.is_available():
        raise SystemExit("qk_scaling_accuracy: CPU only (on a GPU the kernels, which lack these changes, would run)")
    if args.balance:
        reference.format_scores = balanced(reference.format_scores, args.balance)
    if args.least_squares_exponents:
        formats.scale_exponents = least_squares(formats.scale_exponents)
    print(f"balance {args.balance}, least-squares MXFP4 exponents {args.least_squares_exponents}", flush=True)
    return rotation_accuracy.main(rest)


if __name__ == "__main__":
    sys.exit(main())
