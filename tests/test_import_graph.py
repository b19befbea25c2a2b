"""The package's import graph: no cycles, no upward imports, no private names from outside.

Imports inside functions count (a lazy import is still a dependency). The
graph is read from the sources with `ast`; nothing here imports the package.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "dma_compile"

# Top to bottom: a module may import its own layer's modules and lower ones.
LAYERS = [
    ["cli"],
    ["compare"],
    ["calibrate"],
    ["backend", "passes", "prepare"],
    ["hf", "hf_cache", "hf_config", "capture", "loading", "timing", "assets"],
    ["kv_cache"],
    ["ops", "ops_decode"],
    ["validate", "kernels"],
    ["reference", "cache_formats"],
    ["policy", "formats", "rotation", "balancing"],
]


def _modules() -> dict[str, Path]:
    modules = {}
    for path in (ROOT / PACKAGE).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _imported(tree: ast.AST, module: str, is_package: bool) -> set[str]:
    """Dotted names `module`'s source imports (absolute, any depth of the tree)."""
    package = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        deps = set()
        for target in _imported(ast.parse(path.read_text()), name, path.name == "__init__.py"):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            # The root package re-exports lazily; importing it is no dependency on its contents.
            if target and target != name and target != PACKAGE:
                deps.add(target)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, done, stack = [], set(), []

    def visit(node):
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if dep in stack:
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in done:
                visit(dep)
        stack.pop()
        done.add(node)

    for node in sorted(graph):
        if node not in done:
            visit(node)
    return cycles


def _layer(module: str) -> int:
    top = module.split(".")[1]
    return next(i for i, layer in enumerate(LAYERS) if top in layer)


def test_the_graph_is_read_from_the_sources():
    graph = _graph()
    # Known edges, lazy ones included, so an empty graph cannot pass the tests below.
    assert "dma_compile.calibrate.scoring" in graph["dma_compile.compare.measures"]
    assert "dma_compile.hf" in graph["dma_compile.calibrate.allocation"]  # inside layer_sensitivity
    assert "dma_compile.kernels.numerics" in graph["dma_compile.kernels.quantize"]


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_upward_imports():
    graph = _graph()
    assert all(module.count(".") for module in graph if module != PACKAGE)
    upward = [
        f"{module} -> {dep}"
        for module, deps in graph.items() if module != PACKAGE
        for dep in deps if _layer(dep) < _layer(module)
    ]
    assert upward == []


def test_every_module_has_a_layer_and_a_docstring():
    for name, path in _modules().items():
        if name != PACKAGE:
            _layer(name)
        assert ast.get_docstring(ast.parse(path.read_text())), f"{name} has no docstring"


def test_benchmarks_and_examples_use_public_names():
    """They time what users call: the op, or a kernel's documented public hooks."""
    private = []
    for path in [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "examples").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
                private += [f"{path.name}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert private == []
