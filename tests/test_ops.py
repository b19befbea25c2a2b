"""The dma::attention custom op and the dma_attention entry point."""

import importlib.util
import logging

import pytest
import torch
import torch.nn.functional as F

from dma_compile import AttentionPolicy, dma_attention, ops
from dma_compile.ops import Route
from dma_compile.reference import dma_attention_reference

POLICY = AttentionPolicy(tile=32, min_q_len=4)


def qkv(b=1, hq=4, hkv=2, lq=40, lk=40, d=64, dtype=torch.float32):
    return torch.randn(b, hq, lq, d, dtype=dtype), torch.randn(b, hkv, lk, d, dtype=dtype), torch.randn(b, hkv, lk, d, dtype=dtype)


def test_opcheck():
    q, k, v = qkv()
    mask = torch.rand(1, 1, 40, 40) > 0.2
    for args in [
        (q, k, v, None, True, None, POLICY.to_string(), "reference"),
        (q, k, v, mask, False, 0.2, POLICY.to_string(), "auto"),
    ]:
        torch.library.opcheck(torch.ops.dma.attention.default, args)


def test_eager_matches_reference(seed):
    q, k, v = qkv()
    out = dma_attention(q, k, v, is_causal=True, policy=POLICY)
    ref = dma_attention_reference(q, k, v, is_causal=True, policy=POLICY)
    assert torch.equal(out, ref), f"seed {seed}"


def test_compiled_equals_eager_without_recompiles(seed):
    torch._dynamo.reset()
    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    def f(q, k, v):
        return dma_attention(q, k, v, is_causal=True, policy=POLICY) * 2

    compiled = torch.compile(f, backend=backend, fullgraph=True, dynamic=True)
    for length in (40, 57, 96):
        q, k, v = qkv(lq=length, lk=length)
        assert torch.equal(compiled(q, k, v), f(q, k, v)), f"seed {seed} length {length}"
    assert len(compiles) == 1
    assert any(n.target in (torch.ops.dma.attention, torch.ops.dma.attention.default) for n in compiles[0].graph.nodes)


def test_inductor_compile_equals_eager(seed):
    torch._dynamo.reset()

    def f(q, k, v, mask):
        return dma_attention(q, k, v, attn_mask=mask, policy=POLICY) + 1

    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for length in (40, 70):
        q, k, v = qkv(lq=length, lk=length)
        mask = torch.rand(1, 1, length, length) > 0.3
        torch.testing.assert_close(compiled(q, k, v, mask), f(q, k, v, mask), rtol=0, atol=1e-6, msg=f"seed {seed}")


def test_short_queries_run_stock_sdpa_with_auto():
    q, k, v = qkv(lq=2, lk=50)
    out = dma_attention(q, k, v, policy=POLICY)
    assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, enable_gqa=True), atol=1e-6)
    forced = dma_attention(q, k, v, policy=POLICY, impl="reference")
    assert not torch.allclose(forced, out, atol=1e-3)  # the forced reference quantizes


@pytest.mark.parametrize("groups", [1, 3])
def test_repeat_heads_is_repeat_interleave(seed, groups):
    x = torch.randn(2, 3, 5, 8)[:, :, 1:]  # not contiguous
    out = ops.repeat_heads(x, groups)
    assert torch.equal(out, x.repeat_interleave(groups, dim=1)) and out.is_contiguous(), f"seed {seed}"


def test_default_policy_and_strings_are_accepted():
    q, k, v = qkv()
    a = dma_attention(q, k, v, is_causal=True, policy=None)
    b = dma_attention(q, k, v, is_causal=True, policy=AttentionPolicy().to_string())
    c = dma_attention(q, k, v, is_causal=True, policy="paper")
    assert torch.equal(a, b) and torch.equal(a, c)


BAD_INPUTS = [
    (lambda q, k, v: (q[0], k, v, {}), "q must have 4 dimensions"),
    (lambda q, k, v: (q, k[:, :, :, :32], v, {}), "k: head_dim must match"),
    (lambda q, k, v: (q, k[:, :1].repeat(1, 3, 1, 1), v[:, :1].repeat(1, 3, 1, 1), {}), "must divide"),
    (lambda q, k, v: (q, k[:, :0], v[:, :0], {}), "k: the number of KV heads must be positive"),
    (lambda q, k, v: (q, k[:1].expand(2, -1, -1, -1), v, {}), "k, v: batch size must match"),
    (lambda q, k, v: (q.to(torch.int32), k.to(torch.int32), v.to(torch.int32), {}), "q: dtype must be one of"),
    (lambda q, k, v: (q, k.half(), v, {}), "k, v: dtype must match"),
    (lambda q, k, v: (q, k, v[:, :, :7], {}), "v: \\(batch, heads, length\\) must match"),
    (lambda q, k, v: (q, k, v, {"attn_mask": torch.ones(3, 40, 40, dtype=torch.bool)}), "not broadcastable"),
    (lambda q, k, v: (q, k, v, {"attn_mask": torch.ones(40, 41, dtype=torch.bool)}), "not broadcastable"),
    (lambda q, k, v: (q, k, v, {"attn_mask": torch.ones(40, 40, dtype=torch.int64)}), "attn_mask: dtype"),
    (lambda q, k, v: (q, k, v, {"attn_mask": torch.ones(40, 40, dtype=torch.bool), "is_causal": True}), "cannot be used together"),
    (lambda q, k, v: (q, k, v, {"impl": "cuda"}), "impl must be one of"),
    (lambda q, k, v: (q.double(), k.double(), v.double(), {}), "q: dtype must be one of .* with impl='auto'"),
    (lambda q, k, v: (q[..., :48], k[..., :48], v, {}), "multiple of 32 for MX formats"),
]


@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_rotation_needs_a_power_of_two_head_dim_at_both_doors(impl):
    q, k, v = (torch.randn(1, 2, 20, 96) for _ in range(3))
    policy = AttentionPolicy(rotate="hadamard")
    with pytest.raises(ValueError, match="q: head_dim must be a power of two .* rotate=hadamard, got 96"):
        dma_attention(q, k, v, policy=policy, impl=impl)
    for device in (None, "meta"):
        args = tuple(x.to(device) if device else x for x in (q, k, v))
        with pytest.raises(ValueError, match="power of two"):
            torch.ops.dma.attention(*args, None, False, None, policy.to_string(), impl)
    # Without MX formats there is nothing to rotate: any head_dim runs.
    exact = AttentionPolicy.preset("exact").replace(rotate="hadamard")
    assert dma_attention(q, k, v, policy=exact, impl=impl).shape == q.shape


def op_arguments(q, k, v, kwargs, device=None):
    args = (q, k, v, kwargs.get("attn_mask"), kwargs.get("is_causal", False), None, POLICY.to_string(), kwargs.get("impl", "auto"))
    return tuple(a.to(device) if device and isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("change,msg", BAD_INPUTS)
def test_bad_input_names_the_argument_at_both_doors(change, msg):
    """dma_attention, the op called directly and the op's fake kernel (meta
    tensors, as torch.compile runs it) raise the same ValueError."""
    q, k, v, kwargs = change(*qkv())
    with pytest.raises(ValueError, match=msg):
        dma_attention(q, k, v, policy=POLICY, **kwargs)
    for device in (None, "meta"):
        with pytest.raises(ValueError, match=msg):
            torch.ops.dma.attention(*op_arguments(q, k, v, kwargs, device))


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        ({"policy": 3}, "policy must be"),
        ({"policy": "tile=32,tile=64"}, "given more than once"),
        ({"scale": "0.1"}, "scale must be a float or None"),
        ({"is_causal": 1}, "is_causal must be a bool"),
        ({"attn_mask": [[True]]}, "attn_mask must be a torch.Tensor or None"),
    ],
)
def test_bad_arguments_of_dma_attention(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        dma_attention(*qkv(), **kwargs)


def test_fake_kernel_serves_valid_meta_inputs():
    q, k, v = (x.to("meta") for x in qkv(lq=24, d=64))
    out = torch.ops.dma.attention(q, k, v, None, True, None, POLICY.to_string(), "auto")
    assert out.device.type == "meta" and out.shape == (1, 4, 24, 64)


def _query_major(x):
    """Whether x (B, H, L, D) is laid out as (B, L, H, D) in memory, strides and all."""
    b, h, length, d = x.shape
    return x.stride() == (length * h * d, d, h * d, 1)


@pytest.mark.parametrize("q_layout", ["contiguous", "query-major"])
@pytest.mark.parametrize("impl", ["reference", "sm90", "sm100", "sdpa-fallback", "no-keys"])
def test_output_layout_is_the_fake_kernels_whatever_runs(monkeypatch, impl, q_layout, seed):
    """Every path returns what the fake kernel promises torch.compile: (B, H, L, D)
    laid out as (B, L, H, D), the layout a transformers layer transposes back for free."""
    kernel = impl in ("sm90", "sm100")
    if kernel:
        from dma_compile.kernels.numerics import INTERPRET

        if not INTERPRET:
            pytest.skip("the kernels take CPU tensors under TRITON_INTERPRET=1 only")
    dtype = torch.bfloat16 if kernel else torch.float32
    q, k, v = qkv(hq=4, hkv=2, lq=36, lk=0 if impl == "no-keys" else 36, d=32, dtype=dtype)
    if q_layout == "query-major":
        q = q.transpose(1, 2).contiguous().transpose(1, 2)
    fake = torch.ops.dma.attention(*(x.to("meta") for x in (q, k, v)), None, True, None, POLICY.to_string(), "auto")
    if impl == "sdpa-fallback":
        # What a GPU runs where no kernel serves the call; stock SDPA on CPU returns (B, H, L, D).
        monkeypatch.setattr(ops, "route", lambda *a: Route(fallback="sdpa"))
    out = torch.ops.dma.attention(q, k, v, None, True, None, POLICY.to_string(), impl if kernel or
                                  impl == "reference" else "auto")
    assert out.shape == fake.shape and out.stride() == fake.stride(), (out.stride(), fake.stride())
    assert _query_major(out), out.stride()
    # transformers' next step, (B, L, H, D) contiguous, is a view of the op's output.
    assert out.transpose(1, 2).contiguous().data_ptr() == out.data_ptr()
    if impl == "no-keys":
        assert not out.any()
    elif impl == "sdpa-fallback":
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    else:
        ref = dma_attention_reference(q.float(), k.float(), v.float(), is_causal=True, policy=POLICY)
        torch.testing.assert_close(out.float(), ref, atol=0.05 if kernel else 1e-6, rtol=0, msg=f"seed {seed}")


@pytest.mark.parametrize(
    "shape",
    [dict(b=0), dict(lq=0), dict(hq=0, hkv=0), dict(lk=0)],
    ids=["batch-0", "no-queries", "no-heads", "no-keys"],
)
def test_empty_inputs_give_what_sdpa_gives(shape):
    q, k, v = qkv(**shape)
    expected = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    for impl in ("auto", "reference"):
        out = dma_attention(q, k, v, policy=POLICY, impl=impl)
        assert out.shape == expected.shape and torch.equal(out, expected), impl


def test_mask_with_is_causal_is_refused_as_sdpa_documents_it():
    """The error message says SDPA's math backend refuses the pair: keep it true."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = qkv(hkv=4)
    mask = torch.rand(40, 40) > 0.3
    with sdpa_kernel(SDPBackend.MATH), pytest.raises(RuntimeError, match="attn_mask should not be set when is_causal"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    with pytest.raises(ValueError, match="SDPA documents the pair as an error .* fold the causal rule into attn_mask"):
        dma_attention(q, k, v, attn_mask=mask, is_causal=True)


def test_inputs_requiring_grad_are_refused():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="no backward yet"):
        dma_attention(q.requires_grad_(), k, v)
    with torch.no_grad():
        dma_attention(q, k, v)


def test_float64_only_on_the_reference():
    q, k, v = qkv(dtype=torch.float64)
    dma_attention(q, k, v, policy=POLICY, impl="reference")
    with pytest.raises(ValueError, match="q: dtype"):
        dma_attention(q, k, v, policy=POLICY)


def test_head_dim_not_multiple_of_32_runs_with_formats_off(seed):
    q, k, v = qkv(d=40)
    out = dma_attention(q, k, v, is_causal=True, policy="exact")
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.allclose(out, ref, atol=1e-5), f"seed {seed}"


CAUSAL = AttentionPolicy(tile=32, min_q_len=16)


@pytest.mark.parametrize(
    "impl, device, capability, short_query, expected",
    [
        ("auto", "cpu", None, False, Route(fallback="reference")),
        ("auto", "cuda", (9, 0), False, Route(kernels=("sm90_gluon", "sm90"), fallback="sdpa")),
        ("auto", "cuda", (10, 0), False, Route(kernels=("sm100",), fallback="sdpa")),
        ("auto", "cuda", (8, 0), False, Route(fallback="sdpa", reason="no DMA kernel for compute capability 8.0")),
        ("auto", "cuda", (12, 0), False, Route(fallback="sdpa", reason="no DMA kernel for compute capability 12.0")),
        ("auto", "mps", None, False, Route(fallback="sdpa", reason="no DMA kernel for mps tensors")),
        ("auto", "cuda", (9, 0), True, Route(fallback="sdpa")),
        ("auto", "cpu", None, True, Route(fallback="sdpa")),
        ("reference", "cuda", (9, 0), False, Route(fallback="reference")),
        ("reference", "cuda", (9, 0), True, Route(fallback="reference")),
        ("sm100", "cuda", (9, 0), False, Route(kernels=("sm100",))),
        ("sm90", "cpu", None, True, Route(kernels=("sm90",))),
        ("sm90_gluon", "cuda", (9, 0), False, Route(kernels=("sm90_gluon",))),
    ],
)
def test_routing_decision(impl, device, capability, short_query, expected):
    assert ops.route(impl, device, capability, short_query) == expected


def test_every_kernel_is_an_impl():
    assert ops.IMPLS == ("auto", "reference", *ops.KERNELS)
    for kernel in ops.KERNELS.values():
        assert importlib.util.find_spec(kernel.module) is not None


def test_unsupported_kernel_falls_back_to_stock_sdpa_logged_once(monkeypatch, caplog, seed):
    """On a GPU a kernel that cannot serve the call (head_dim 96 on sm90, say)
    hands it to stock SDPA, with the same mask and scale, and says why once."""
    from dma_compile.kernels import Unsupported

    def kernel(*args, hand_over=False):
        raise Unsupported("head_dim 96 is not served")

    monkeypatch.setattr(ops, "_kernel", lambda name: kernel)
    ops._warn_fallback_once.cache_clear()
    q, k, v = qkv(d=96)
    mask = torch.rand(1, 1, 40, 40) > 0.3
    plan = Route(kernels=("sm90",), fallback="sdpa")
    with caplog.at_level(logging.WARNING, logger="dma_compile.ops"):
        for _ in range(3):
            out = ops.run(plan, q, k, v, mask, False, 0.3, CAUSAL)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    assert torch.equal(out, expected), f"seed {seed}"
    assert [r.getMessage() for r in caplog.records] == [
        "dma attention: stock SDPA runs instead of the kernel: sm90: head_dim 96 is not served"
    ]
    with pytest.raises(Unsupported, match="head_dim 96"):
        ops.run(Route(kernels=("sm90",)), q, k, v, mask, False, 0.3, CAUSAL)


def test_a_kernel_hands_calls_to_the_next_one_logged_once_per_reason(monkeypatch, caplog, seed):
    """On an auto route the first kernel passes on the calls its `passes_on`
    names (asked only where a later kernel could take them: hand_over) or
    that it cannot serve, to the next kernel, saying why once per reason; a
    route of one kernel (an explicit impl) never asks."""
    from dma_compile.kernels import Unsupported

    ran, refuse, slower = [], {}, {}

    def kernel_named(name):
        def kernel(q, *args, hand_over=False):
            if name in refuse:
                raise Unsupported(refuse[name])
            if hand_over and name in slower:
                raise Unsupported(slower[name])
            ran.append(name)
            return q
        return kernel

    monkeypatch.setattr(ops, "_kernel", kernel_named)
    ops._log_handover_once.cache_clear()
    q, k, v = qkv()
    auto = Route(kernels=("sm90_gluon", "sm90"), fallback="sdpa")
    with caplog.at_level(logging.INFO, logger="dma_compile.ops"):
        ops.run(auto, q, k, v, None, True, None, CAUSAL)
        slower["sm90_gluon"] = "the other one is faster here"
        for _ in range(3):
            ops.run(auto, q, k, v, None, True, None, CAUSAL)
        slower.clear()
        refuse["sm90_gluon"] = "masks are not read"
        for _ in range(2):
            ops.run(auto, q, k, v, None, True, None, CAUSAL)
        slower["sm90_gluon"] = "the other one is faster here"
        refuse.clear()
        ops.run(Route(kernels=("sm90_gluon",)), q, k, v, None, True, None, CAUSAL)
    assert ran == ["sm90_gluon", "sm90", "sm90", "sm90", "sm90", "sm90", "sm90_gluon"], f"seed {seed}"
    assert [r.getMessage() for r in caplog.records] == [
        "dma attention: sm90_gluon hands the call to sm90: the other one is faster here",
        "dma attention: sm90_gluon hands the call to sm90: masks are not read",
    ]


def test_passes_on_asks_the_kernel_only_within_its_limits_and_with_hand_over():
    """The Gluon kernel's speed rule is asked, with hand_over, for the calls
    its limits take; those they refuse (float32 here) say the limits' reason."""
    from dma_compile.kernels import Unsupported

    gluon = ops._kernel("sm90_gluon")
    q, k, v = qkv(d=128, dtype=torch.float32)
    with pytest.raises(Unsupported, match="bfloat16 or float16"):
        gluon(q, k, v, None, True, None, CAUSAL, hand_over=True)
    q, k, v = qkv(d=128, dtype=torch.bfloat16)
    with pytest.raises(Unsupported, match="Triton"):  # the speed rule (on CPU: no timed sizes, or no timed Triton)
        gluon(q, k, v, None, True, None, CAUSAL, hand_over=True)
    with pytest.raises(Unsupported, match="needs CUDA tensors"):  # without hand_over the kernel itself answers
        gluon(q, k, v, None, True, None, CAUSAL)


def test_gpu_without_a_kernel_runs_stock_sdpa(caplog, seed):
    ops._warn_fallback_once.cache_clear()
    q, k, v = qkv()
    plan = ops.route("auto", "cuda", (8, 0), False)
    with caplog.at_level(logging.WARNING, logger="dma_compile.ops"):
        out = ops.run(plan, q, k, v, None, True, None, CAUSAL)
        ops.run(plan, q, k, v, None, True, None, CAUSAL)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)), f"seed {seed}"
    assert len(caplog.records) == 1 and "compute capability 8.0" in caplog.records[0].getMessage()


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, dtype", [(96, torch.bfloat16), (128, torch.float32)])
@pytest.mark.parametrize("masked", [False, True])
def test_auto_on_the_gpu_runs_stock_sdpa_where_no_kernel_serves(caplog, seed, head_dim, dtype, masked):
    ops._warn_fallback_once.cache_clear()
    q, k, v = (x.cuda() for x in qkv(lq=300, lk=300, d=head_dim, dtype=dtype))
    mask = torch.ones(300, 300, dtype=torch.bool, device="cuda").tril() if masked else None
    with caplog.at_level(logging.WARNING, logger="dma_compile.ops"):
        out = dma_attention(q, k, v, attn_mask=mask, is_causal=not masked, policy="exact")
    k4, v4 = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    expected = F.scaled_dot_product_attention(q, k4, v4, attn_mask=mask, is_causal=not masked)
    torch.testing.assert_close(out, expected, msg=f"seed {seed}")
    assert any("stock SDPA runs instead of the kernel" in r.getMessage() for r in caplog.records)
