"""NaN and Inf reach exactly the rows whose softmax includes them
(docs/semantics.md, "Non-finite inputs"), for the reference and the
interpreted sm90 and sm100 kernels (on a GPU, the compiled ones).

The oracle is SDPA run on the keys each row attends (causal: keys 0..i):
for a NaN key that is what SDPA itself returns; for V, SDPA's math backend
multiplies the zero probabilities of masked keys by the NaN too and spreads it
to every row, which DMA does not follow.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from dma_compile import AttentionPolicy, dma_attention

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
IMPLS = ["reference", "sm90", "sm100"]
HOPPER = AttentionPolicy.preset("hopper_input_pv").replace(tile=32)
L, BAD = 40, 35
CHANNEL = 3


def _inputs(seed, where, value):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 2, L, 64, generator=g)
    k = torch.randn(1, 1, L, 64, generator=g) + 0.5
    v = torch.randn(1, 1, L, 64, generator=g)
    # A positive query channel makes an Inf key's scores +Inf (NaN after the
    # softmax) in every row that sees it, as a NaN key's are.
    q[..., CHANNEL] = q[..., CHANNEL].abs() + 0.1
    (k if where == "k" else v)[0, 0, BAD, CHANNEL] = value
    return [x.to(torch.bfloat16) for x in (q, k, v)]


def _bad_rows(out):
    return set((~torch.isfinite(out.float())).flatten(3).any(-1).any(1)[0].nonzero().flatten().tolist())


def _oracle_rows(q, k, v):
    """Rows whose SDPA over the keys they attend (0..i) is not finite."""
    rows = set()
    for i in range(L):
        o = F.scaled_dot_product_attention(q[:, :, i:i + 1].float(), k[:, :, :i + 1].float(), v[:, :, :i + 1].float(),
                                           enable_gqa=True)
        if not torch.isfinite(o).all():
            rows.add(i)
    return rows


def _run(impl, q, k, v, policy, **kw):
    return dma_attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), policy=policy, impl=impl, **kw).cpu()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pv", ["input", "fp8"])
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_reaches_the_rows_that_attend_it(impl, pv, where, value, seed):
    q, k, v = _inputs(seed, where, value)
    expected = _oracle_rows(q, k, v)
    assert expected == set(range(BAD, L))
    if where == "k":
        sdpa = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
        assert _bad_rows(sdpa) == expected
    got = _bad_rows(_run(impl, q, k, v, HOPPER.replace(pv=pv), is_causal=True))
    if impl == "reference" or where == "k":
        assert got == expected, f"seed {seed}"
    else:
        # The kernels' P·V multiplies a whole key block's V by each row's
        # probabilities, zeros included: a non-finite V element also reaches
        # the rows of its query block that mask its key (docs/semantics.md).
        assert expected <= got <= set(range(BAD // HOPPER.tile * HOPPER.tile, L)), f"seed {seed}: {sorted(got)}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_masked_nan_key_is_selected_out(impl, kind, seed):
    """A NaN key masked by an explicit mask (-inf added: NaN + -inf is NaN) stays out of the rows."""
    q, k, v = _inputs(seed, "k", float("nan"))
    keep = torch.ones(L, L, dtype=torch.bool).tril()
    mask = keep if kind == "bool" else torch.zeros(L, L).masked_fill(~keep, float("-inf")).to(torch.bfloat16)
    got = _bad_rows(_run(impl, q, k, v, HOPPER, attn_mask=mask.to(DEVICE)))
    assert got == set(range(BAD, L)), f"seed {seed}"
