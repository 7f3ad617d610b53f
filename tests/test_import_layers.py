"""The project's imports point one way: no import cycle anywhere, and the core's layers.

Walks every module of ``curvopt``, ``experiments`` and ``paper_figs`` with ``ast`` (imports at
module level and inside functions alike) and checks that the graph of project-internal
imports has no cycle, that ``curvopt`` never imports a project module inside a function, and
that every core module imports only from its own layer or the layers below it
(``docs/architecture.md``).
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("curvopt", "experiments", "paper_figs")

#: core layers, bottom up (docs/architecture.md); a module may import its layer or lower ones
LAYERS = [
    {
        "errors",
        "state",
        "records",
        "params",
        "reductions",
        "buffers",
        "extensions",
        "inputs",
        "torch_internals",
    },
    {"layers", "losses"},
    {"broadcast", "checkpointing", "propagate", "rows", "results", "diagonals", "hessian", "kfra"},
    {"reducer", "checks", "curvature", "accumulate", "backward"},
    {"hooks", "collect", "verify"},
    {"optim", "linalg"},
]


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules():
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            found[_module_name(path)] = path
    return found


def _imports(name: str, path: pathlib.Path, modules):
    """``(imported project module, inside a function?)`` pairs of one module."""
    tree = ast.parse(path.read_text())
    in_function = {
        id(node)
        for fn in ast.walk(tree)
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(fn)
    }
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    result = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")
                parent = parent[: len(parent) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                result.append((target, id(node) in in_function))
    return result


@pytest.fixture(scope="module")
def graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _is_ancestor(package: str, module: str) -> bool:
    return module.startswith(package + ".")


def test_no_import_cycle(graph):
    edges = {
        name: {t for t, _ in targets if not _is_ancestor(t, name) and not _is_ancestor(name, t)}
        for name, targets in graph.items()
    }
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt) :] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for name in sorted(edges):
        if name not in state:
            visit(name)


def test_core_imports_no_project_module_inside_a_function(graph):
    local = [
        f"{name} imports {target}"
        for name, targets in graph.items()
        if name.startswith("curvopt")
        for target, inside in targets
        if inside
    ]
    assert not local, local


def _layer(module: str):
    part = module.split(".")[1] if module.count(".") else None
    for level, members in enumerate(LAYERS):
        if part in members:
            return level
    return None


def test_core_layers_point_down(graph):
    for name, targets in graph.items():
        if not name.startswith("curvopt.") or _layer(name) is None:
            continue
        for target, _ in targets:
            if target.startswith("curvopt.") and _layer(target) is not None:
                assert _layer(target) <= _layer(name), (
                    f"{name} (layer {_layer(name)}) imports {target} (layer {_layer(target)})"
                )


def test_figures_never_import_the_experiments(graph):
    bad = [
        f"{name} imports {target}"
        for name, targets in graph.items()
        if name.startswith("paper_figs")
        for target, _ in targets
        if target.startswith("experiments")
    ]
    assert not bad, bad


def test_every_core_module_has_a_layer():
    missing = [
        path.stem
        for path in (ROOT / "curvopt").glob("*.py")
        if path.stem != "__init__" and _layer(f"curvopt.{path.stem}") is None
    ]
    dirs = [
        p.name
        for p in (ROOT / "curvopt").iterdir()
        if p.is_dir() and (p / "__init__.py").exists() and _layer(f"curvopt.{p.name}") is None
    ]
    assert not missing + dirs, missing + dirs
