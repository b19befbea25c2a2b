"""FX rewrite of scaled_dot_product_attention call sites into `dma::attention`.

`rewrite_sdpa(graph, policy)` finds every SDPA node (`F.scaled_dot_product_attention`
in Torch IR, as Dynamo and Inductor's pre-grad passes see it, and
`aten.scaled_dot_product_attention` in ATen graphs such as torch.export's),
reads its arguments however they were passed, works out the attention layer
from the node's `nn_module_stack`, and replaces the node by
`torch.ops.dma.attention` with that layer's policy string as an argument, so
compiled-graph caches see the policy.

K/V that the model expanded for grouped-query attention (transformers'
`repeat_kv`: unsqueeze, expand, reshape; or `repeat_interleave` on the head
dimension) are traced back to the unexpanded tensors: the op serves GQA
natively, and the expanded copies disappear from the graph. A mask that was
only broadcast by `expand` is passed as its source: the op broadcasts masks.

Call sites the op cannot serve keep stock SDPA; each distinct reason is logged
once per process. So do, with impl="auto", call sites whose queries are
shorter than the policy's `min_q_len` in every call (decode steps: the op
would hand them to stock SDPA at run time), so that a compiled decode step is
the graph stock Inductor builds; those are logged at INFO, being by design.
"""

from __future__ import annotations

import logging
import operator
import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from dma_compile.formats import BLOCK_SIZE
from dma_compile.ops import MAX_HEAD_DIM, check_impl  # also registers torch.ops.dma.attention
from dma_compile.policy import AttentionPolicy, ModelPolicy, default_policy
from dma_compile.rotation import is_power_of_two
from dma_compile.validate import INPUT_DTYPES

logger = logging.getLogger(__name__)

SDPA_TARGETS = (
    torch._C._nn.scaled_dot_product_attention,
    torch.ops.aten.scaled_dot_product_attention.default,
)
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}

# Ops that reshape in row-major order without reordering elements: between
# shapes that differ only by singleton dims or by merging adjacent dims they
# are unsqueeze / flatten.
_RESHAPE_METHODS = {"reshape", "view", "flatten", "unsqueeze"}
_RESHAPE_FUNCTIONS = {
    torch.reshape,
    torch.flatten,
    torch.unsqueeze,
    torch.ops.aten.reshape.default,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.flatten.using_ints,
}
_COPY_METHODS = {"contiguous", "clone"}
_COPY_FUNCTIONS = {torch.clone, torch.ops.aten.clone.default}
_EXPAND_METHODS = {"expand"}
_EXPAND_FUNCTIONS = {torch.ops.aten.expand.default}
_REPEAT_INTERLEAVE = {torch.repeat_interleave, torch.ops.aten.repeat_interleave.self_int}

_logged_reasons: set[str] = set()


@dataclass(frozen=True)
class CallSite:
    """One SDPA call site: rewritten (`policy` set) or kept (`reason` set)."""

    node: str
    module: str | None
    layer: int | None
    policy: str | None = None
    reason: str | None = None
    unexpanded_kv: bool = False
    # Kept because stock SDPA serves such calls by design (decode steps), not for want of support.
    by_design: bool = False


@dataclass
class RewriteReport:
    """What `rewrite_sdpa` did to one graph."""

    sites: list[CallSite] = field(default_factory=list)

    @property
    def rewritten(self) -> list[CallSite]:
        return [s for s in self.sites if s.reason is None]

    @property
    def kept(self) -> list[CallSite]:
        return [s for s in self.sites if s.reason is not None]


def is_sdpa(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in SDPA_TARGETS


def _value(arg):
    """The example value (usually a FakeTensor) an FX argument stands for."""
    if isinstance(arg, fx.Node):
        return arg.meta.get("val", arg.meta.get("example_value"))
    return arg


def _tensor(arg) -> torch.Tensor | None:
    value = _value(arg)
    return value if isinstance(value, torch.Tensor) else None


def _same(a, b) -> bool:
    return statically_known_true(a == b)


def _same_shape(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def _is_call(node, methods: set[str], functions: set) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_method":
        return node.target in methods
    return node.op == "call_function" and node.target in functions


def _is_pure_view_getitem(node: fx.Node) -> bool:
    """x[:, :, None, ...]: only full slices, None and Ellipsis, so a view that
    just inserts singleton dims."""
    if not (node.op == "call_function" and node.target is operator.getitem):
        return False
    index = node.args[1]
    index = index if isinstance(index, tuple) else (index,)
    return all(i is None or i is Ellipsis or i == slice(None) for i in index)


def bind_sdpa_args(node: fx.Node) -> dict | None:
    """SDPA's arguments by name, defaults filled in; None if the call does not
    match SDPA's signature."""
    if len(node.args) > len(SDPA_PARAMS):
        return None
    bound = dict(zip(SDPA_PARAMS, node.args))
    for name, value in node.kwargs.items():
        if name not in SDPA_PARAMS or name in bound:
            return None
        bound[name] = value
    if not {"query", "key", "value"} <= bound.keys():
        return None
    return {**SDPA_DEFAULTS, **bound}


def unexpanded_kv(node) -> fx.Node | None:
    """The (B, Hkv, L, D) tensor that `node` repeats into (B, Hkv*R, L, D) with
    head h reading KV head h // R, or None if `node` is not such a repeat."""
    if not isinstance(node, fx.Node):
        return None
    out = _tensor(node)
    if out is None or out.dim() != 4:
        return None
    if _is_call(node, {"repeat_interleave"}, _REPEAT_INTERLEAVE):
        source = node.args[0]
        repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
        src = _tensor(source)
        if not isinstance(repeats, int) or dim not in (1, -3) or src is None or src.dim() != 4:
            return None
        b, h, l, d = src.shape
        return source if _same_shape(tuple(out.shape), (b, h * repeats, l, d)) else None
    # transformers' repeat_kv: x[:, :, None].expand(B, Hkv, R, L, D).reshape(B, Hkv*R, L, D)
    if not _is_call(node, _RESHAPE_METHODS, _RESHAPE_FUNCTIONS):
        return None
    expanded = node.args[0]
    if _is_call(expanded, _COPY_METHODS, _COPY_FUNCTIONS):
        expanded = expanded.args[0]
    if not _is_call(expanded, _EXPAND_METHODS, _EXPAND_FUNCTIONS):
        return None
    unsqueezed = expanded.args[0]
    if not (
        _is_call(unsqueezed, _RESHAPE_METHODS, _RESHAPE_FUNCTIONS)
        or (isinstance(unsqueezed, fx.Node) and _is_pure_view_getitem(unsqueezed))
    ):
        return None
    source = unsqueezed.args[0]
    src, uns, exp = _tensor(source), _tensor(unsqueezed), _tensor(expanded)
    if src is None or uns is None or exp is None or src.dim() != 4 or exp.dim() != 5:
        return None
    b, h, l, d = src.shape
    r = exp.shape[2]
    if not (
        _same_shape(tuple(uns.shape), (b, h, 1, l, d))
        and _same_shape(tuple(exp.shape), (b, h, r, l, d))
        and _same_shape(tuple(out.shape), (b, h * r, l, d))
    ):
        return None
    return source


def unexpanded_mask(mask):
    """The tensor an `expand` broadcast into `mask`, or `mask` itself.

    The op broadcasts masks itself, and Inductor computes an unexpanded mask
    once for all layers, where it would rebuild an expanded view per consumer."""
    while _is_call(mask, _EXPAND_METHODS, _EXPAND_FUNCTIONS):
        source = _tensor(mask.args[0])
        if source is None or source.dim() > 4:
            break
        mask = mask.args[0]
    return mask


def module_path(node: fx.Node) -> str | None:
    """Dotted path of the innermost module around `node` ("model.layers.3.self_attn")."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    source = list(stack.values())[-1][0]
    # Dynamo names modules from the frame's locals: L['self'].model... or L['args'][0].model...
    path = re.sub(r"^[A-Za-z_]\w*\[['\"][^'\"]*['\"]\](\[\d+\])*", "", source)
    path = re.sub(r"\[['\"]?([^'\"\]]+)['\"]?\]", r".\1", path)
    parts = [p for p in path.split(".") if p and p != "_modules"]
    return ".".join(parts) or None


def layer_index(path: str | None) -> int | None:
    """The layer a module path belongs to: its first integer component (the
    decoder layer's position in its ModuleList, which transformers also uses
    as `layer_idx`)."""
    if path is None:
        return None
    for part in path.split("."):
        if part.isdigit():
            return int(part)
    return None


def unsupported_reason(args: dict, policy: AttentionPolicy) -> str | None:
    """Why the op cannot serve this call site, or None if it can."""
    dropout_p, is_causal, enable_gqa, scale = (args[k] for k in ("dropout_p", "is_causal", "enable_gqa", "scale"))
    if not isinstance(dropout_p, (int, float)):
        return "dropout_p is not a constant"
    if dropout_p > 0:
        return "dropout_p > 0 (DMA has no dropout)"
    if not isinstance(is_causal, bool):
        return "is_causal is not a constant bool"
    if not isinstance(enable_gqa, bool):
        return "enable_gqa is not a constant bool"
    if isinstance(scale, fx.Node) and not isinstance(_value(scale), (float, torch.SymFloat)):
        return "scale is not a float"
    q, k, v = (_tensor(args[n]) for n in ("query", "key", "value"))
    if q is None or k is None or v is None:
        return "no shape metadata on query/key/value"
    mask = args["attn_mask"]
    if mask is not None and _tensor(mask) is None:
        return "attn_mask has no shape metadata"
    if mask is not None and is_causal:
        return "attn_mask together with is_causal=True"
    if any(t.requires_grad for t in (q, k, v)):
        return "query/key/value require grad (DMA has no backward yet)"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "query/key/value are not 4-D (batch, heads, length, head_dim)"
    if q.dtype not in INPUT_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype}/{k.dtype}/{v.dtype} (accepted: bfloat16, float16, float32, all alike)"
    head_dim, v_head_dim = q.shape[-1], v.shape[-1]
    if not isinstance(head_dim, int) or not isinstance(v_head_dim, int):
        return "symbolic head_dim"
    if max(head_dim, v_head_dim) > MAX_HEAD_DIM:
        return f"head_dim {max(head_dim, v_head_dim)} > {MAX_HEAD_DIM}"
    if policy.uses_mx and head_dim % BLOCK_SIZE:
        return f"head_dim {head_dim} is not a multiple of {BLOCK_SIZE} (the policy uses MX formats)"
    if policy.uses_mx and policy.rotate != "none" and not is_power_of_two(head_dim):
        return f"head_dim {head_dim} is not a power of two (the policy rotates Q and K: rotate={policy.rotate})"
    if not (_same(k.shape[0], q.shape[0]) and _same(v.shape[0], q.shape[0])):
        return "batch sizes of query/key/value differ (SDPA broadcasting)"
    # A KV cache's keys and values carry two length symbols that no guard ties
    # together: the op checks their equality at run time.
    if not _same(k.shape[1], v.shape[1]) or statically_known_true(k.shape[2] != v.shape[2]):
        return "key and value differ in heads or length"
    heads = f"({q.shape[1]} query, {k.shape[1]} key/value)"
    if enable_gqa and not statically_known_true(q.shape[1] % k.shape[1] == 0):
        return f"enable_gqa with incompatible heads {heads}"
    if not enable_gqa and not (_same(k.shape[1], q.shape[1]) or _same(k.shape[1], 1)):
        return f"query and key/value heads differ without enable_gqa {heads}"
    return None


def decode_reason(args: dict, policy: AttentionPolicy, impl: str) -> str | None:
    """Why a call site is a decode step that stock SDPA serves (impl="auto",
    queries provably shorter than the policy's `min_q_len`), or None."""
    query = _tensor(args["query"])
    if impl != "auto" or query is None or query.dim() != 4:
        return None
    if not statically_known_true(query.shape[2] < policy.min_q_len):
        return None
    return (f"queries shorter than the policy's min_q_len ({policy.min_q_len}): decode steps, "
            "which stock SDPA serves")


def _report_kept(site: CallSite) -> None:
    if site.reason in _logged_reasons:
        return
    _logged_reasons.add(site.reason)
    logger.log(
        logging.INFO if site.by_design else logging.WARNING,
        "dma: kept stock SDPA at %s (node %s): %s",
        site.module or "<no module>",
        site.node,
        site.reason,
    )


def _mutates(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("_") or node.target == "__setitem__"
    if node.op != "call_function":
        return False
    if node.target is operator.setitem:
        return True
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.is_mutable
    name = getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.startswith("_")


def _mutation_between(base: fx.Node, expanded: fx.Node, use: fx.Node) -> bool:
    """Whether an in-place op runs between the expansion of `base` into
    `expanded` (a copy) and `use`: then `base` at `use` may differ from the copy."""
    start = expanded
    while start.args and start.args[0] is not base:
        start = start.args[0]
    node = start
    while node is not use:
        if _mutates(node):
            return True
        node = node.next
    return False


def _erase_if_dead(graph: fx.Graph, node, stop: fx.Node) -> None:
    """Erase the chain that produced `node` back to `stop` where nothing else uses it."""
    while isinstance(node, fx.Node) and node is not stop and not node.users:
        producer = node.args[0] if node.args else None
        graph.erase_node(node)
        node = producer


def _replace(graph: fx.Graph, node: fx.Node, args: dict, policy: AttentionPolicy, impl: str) -> CallSite | str:
    """Replace `node` by dma.attention on unexpanded K/V where possible.
    Returns the site's record, or the reason if the op rejects the inputs."""
    name, path = node.name, module_path(node)
    key, value = args["key"], args["value"]
    base_k, base_v = unexpanded_kv(key), unexpanded_kv(value)
    peeled = (
        base_k is not None
        and base_v is not None
        and _same(_tensor(base_k).shape[1], _tensor(base_v).shape[1])
        and not _mutation_between(base_k, key, node)
        and not _mutation_between(base_v, value, node)
    )
    if peeled:
        key, value = base_k, base_v
    mask = unexpanded_mask(args["attn_mask"])
    op_args = (args["query"], key, value, mask, args["is_causal"], args["scale"], policy.to_string(), impl)
    try:
        out = torch.ops.dma.attention.default(*(_value(a) for a in op_args))
    except (ValueError, RuntimeError, TypeError) as e:
        return f"dma.attention rejects the inputs: {e}"
    with graph.inserting_before(node):
        new = graph.call_function(torch.ops.dma.attention.default, op_args)
    new.meta.update(node.meta)
    new.meta["val" if "val" in node.meta else "example_value"] = out
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    if peeled:
        _erase_if_dead(graph, args["key"], base_k)
        _erase_if_dead(graph, args["value"], base_v)
    if mask is not args["attn_mask"]:
        _erase_if_dead(graph, args["attn_mask"], mask)
    return CallSite(name, path, layer_index(path), policy=policy.to_string(), unexpanded_kv=peeled)


def _layer_policy(policy: ModelPolicy | None, layer: int | None, path: str | None, query) -> AttentionPolicy:
    if policy is None:
        return default_policy(query.device if query is not None else None)
    if policy.num_layers is not None and layer is not None and layer >= policy.num_layers:
        raise ValueError(
            f"policy was calibrated for {policy.num_layers} layers, but the attention at {path} is layer {layer}"
        )
    return policy.for_layer(layer)


def rewrite_sdpa(graph: fx.Graph, policy: ModelPolicy | None = None, impl: str = "auto") -> RewriteReport:
    """Rewrite every SDPA call site in `graph` that the op can serve.

    policy: per-layer policies; None takes `default_policy` of each call's
    device. impl: the op's `impl` argument ("auto" picks the kernel).
    """
    check_impl(impl)
    report = RewriteReport()
    for node in [n for n in graph.nodes if is_sdpa(n)]:
        name, path = node.name, module_path(node)
        layer = layer_index(path)
        args = bind_sdpa_args(node)
        if args is None:
            outcome = "arguments do not match SDPA's signature"
        else:
            layer_policy = _layer_policy(policy, layer, path, _tensor(args["query"]))
            decode = decode_reason(args, layer_policy, impl)
            if decode is not None:
                outcome = CallSite(name, path, layer, reason=decode, by_design=True)
            else:
                outcome = unsupported_reason(args, layer_policy) or _replace(graph, node, args, layer_policy, impl)
        if isinstance(outcome, str):
            outcome = CallSite(name, path, layer, reason=outcome)
        if outcome.reason is not None:
            _report_kept(outcome)
        report.sites.append(outcome)
    if report.rewritten:
        graph.lint()
    return report
