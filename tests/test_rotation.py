"""The Hadamard rotation (dma_compile.rotation) and what it does to the reference.

The transform must be orthonormal with an exact inverse, its butterfly must
be the matrix it claims, exact attention must not change under it, and with
a rotating policy the reference must quantize the rotated operands (and
thereby lose less to an outlier channel than without it).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from dma_compile.formats import fake_quantize
from dma_compile.policy import AttentionPolicy
from dma_compile.reference import dma_attention_reference, key_mean
from dma_compile.rotation import ROTATIONS, SIGN_SEED, rotate, rotation_matrix, sign_vector, unrotate

KINDS = ["hadamard", "signed_hadamard"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_matrix_is_orthonormal_and_symmetric_up_to_signs(kind, d):
    r = rotation_matrix(d, kind)
    eye = torch.eye(d, dtype=torch.float64)
    assert torch.allclose(r @ r.T, eye, atol=1e-13, rtol=0)
    assert torch.allclose(r.T @ r, eye, atol=1e-13, rtol=0)
    # Every entry is +-1/sqrt(d): the energy of any channel spreads over all of them.
    assert torch.allclose(r.abs(), torch.full_like(r, 1 / math.sqrt(d)), atol=1e-15, rtol=0)
    signs = torch.diag(sign_vector(d, kind).double())
    hadamard = signs @ r
    assert torch.equal(hadamard, hadamard.T)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_butterfly_is_the_matrix_and_the_inverse_is_exact(kind, d, seed):
    x = torch.randn(4, 7, d, dtype=torch.float64) * torch.exp2(torch.randint(-8, 9, (4, 7, 1)).double())
    r = rotation_matrix(d, kind)
    y = rotate(x.float(), kind)
    assert y.dtype == torch.float32
    # float32 butterfly: log2(d) + 1 roundings of values of size |x|.
    tol = 8 * math.log2(d) * 2.0**-24 * x.abs().amax(dim=-1, keepdim=True) * math.sqrt(d)
    assert ((y.double() - x @ r).abs() <= tol).all(), f"seed {seed}"
    back = unrotate(y, kind)
    assert ((back.double() - x).abs() <= 2 * tol).all(), f"seed {seed}"
    # The inverse in exact arithmetic: the transpose.
    assert torch.allclose(x @ r @ r.T, x, atol=1e-12 * float(x.abs().max()), rtol=0)
    assert not torch.allclose(y.double(), x, atol=1e-3)


def test_signs_are_fixed_and_documented():
    s = sign_vector(128, "signed_hadamard")
    expected = torch.randint(0, 2, (128,), generator=torch.Generator().manual_seed(SIGN_SEED)).float() * 2 - 1
    assert torch.equal(s, expected)
    assert 32 < int((s < 0).sum()) < 96
    assert torch.equal(sign_vector(128, "hadamard"), torch.ones(128))
    assert torch.equal(rotate(torch.eye(4), "hadamard") * 2, rotation_matrix(4, "hadamard").float() * 2)


@pytest.mark.parametrize("d", [48, 96, 1])
def test_other_head_dims_are_refused(d):
    with pytest.raises(ValueError, match="power of two"):
        rotate(torch.randn(2, d), "hadamard")
    assert torch.equal(rotate(x := torch.randn(2, d), "none"), x)
    with pytest.raises(ValueError, match="rotate must be one of"):
        rotate(torch.randn(2, 64), "walsh")


@pytest.mark.parametrize("kind", KINDS)
def test_exact_attention_is_unchanged(kind, seed):
    """(QR)(KR)^T = QK^T: rotated exact attention equals exact attention to float32 rounding."""
    q = torch.randn(2, 4, 50, 64) * 3
    k = torch.randn(2, 2, 70, 64) + torch.randn(64) * 4
    v = torch.randn(2, 2, 70, 64)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    got = F.scaled_dot_product_attention(rotate(q, kind), rotate(k, kind), v, is_causal=True, enable_gqa=True)
    # Scores reach ~50 here: float32 rounding moves them by ~1e-5, the outputs by that times |v|.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    assert not torch.allclose(F.scaled_dot_product_attention(rotate(q, kind), k, v, is_causal=True, enable_gqa=True),
                              want, rtol=0, atol=1e-2)
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)
    rotated = rotate(q, kind) @ rotate(k, kind).repeat_interleave(2, dim=1).transpose(-1, -2)
    assert (rotated - scores).abs().max() <= 1e-5 * scores.abs().max()


@pytest.mark.parametrize("kind", KINDS)
def test_policy_none_tiles_ignore_the_rotation(kind, seed):
    """Formats "none" compute with Q and K as given: the rotation changes nothing there."""
    q, k, v = (torch.randn(1, 2, 40, 64).bfloat16() for _ in range(3))
    exact = AttentionPolicy.preset("exact")
    assert torch.equal(dma_attention_reference(q, k, v, policy=exact.replace(rotate=kind)),
                       dma_attention_reference(q, k, v, policy=exact))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["exact", "folded"])
def test_reference_quantizes_the_rotated_smoothed_operands(kind, mode, seed):
    q = torch.randn(1, 2, 32, 64).bfloat16()
    k = (torch.randn(1, 1, 32, 64) + 2).bfloat16()
    v = torch.randn(1, 1, 32, 64).bfloat16()
    policy = AttentionPolicy.preset("all_mxfp4").replace(tile=32, mx_mode=mode, rotate=kind)
    got = dma_attention_reference(q, k, v, policy=policy)
    folded = mode == "folded"
    qf = fake_quantize(rotate(q.float(), kind), "mxfp4_e2m1", folded=folded)
    kf = fake_quantize(rotate(k.float() - key_mean(k), kind), "mxfp4_e2m1", folded=folded)
    probs = torch.softmax(qf @ kf.transpose(-1, -2) / 8, dim=-1)
    want = probs.to(torch.bfloat16).float() @ v.float() / probs.to(torch.bfloat16).float().sum(-1, keepdim=True)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)
    unrotated = dma_attention_reference(q, k, v, policy=policy.replace(rotate="none"))
    assert not torch.equal(got, unrotated)


@pytest.mark.parametrize("kind", KINDS)
def test_rotation_recovers_channels_an_outlier_flushes(kind, seed):
    """One large channel per token flushes the rest of its MXFP4 block; the
    rotation spreads it, so all-MXFP4 attention gets much closer to exact."""
    q = torch.randn(1, 8, 128, 64)
    k = torch.randn(1, 8, 128, 64)
    q[..., 5] *= 16
    k[..., 5] *= 16
    v = torch.randn(1, 8, 128, 64)
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    policy = AttentionPolicy.preset("all_mxfp4")

    def error(p):
        out = dma_attention_reference(q, k, v, is_causal=True, policy=p)
        return float((out - exact).norm() / exact.norm())

    # The rotated error is typically a quarter of the unrotated one; 0.6 leaves a margin over seeds.
    assert error(policy.replace(rotate=kind)) < 0.6 * error(policy), f"seed {seed}"


def test_rotations_listed():
    assert ROTATIONS == ("none", "hadamard", "signed_hadamard")
