"""The project's imports point one way: no import cycle anywhere, and the core's layers.

Walks every module of ``curvopt``, ``experiments``, ``paper_figs``, ``benchmarks`` and
``fixtures`` with ``ast`` (imports at module level and inside functions alike) and checks that
the graph of project-internal imports has no cycle, that every package imports only the
packages below it (``PACKAGE_USES``), that nothing loads a module by file path or edits
``sys.path`` (an import the graph cannot see), that the experiments' subpackages are used only
where ``SUBPACKAGE_USERS`` says, that ``curvopt`` (and the packages of ``NO_LOCAL_IMPORTS``)
never imports a project module inside a function, and that every core module imports only from
its own layer or the layers below it (``docs/architecture.md``).
"""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("curvopt", "experiments", "paper_figs", "benchmarks", "fixtures")

#: the packages each package may import, bottom up: the fixtures (models written the way users
#: write them) and the library import nothing of the project; the figures read result files;
#: the experiments run the library on fixtures and draw figures; the benchmarks time both
PACKAGE_USES = {
    "fixtures": set(),
    "curvopt": set(),
    "paper_figs": set(),
    "experiments": {"curvopt", "fixtures", "paper_figs"},
    "benchmarks": {"curvopt", "fixtures", "experiments"},
}

#: which modules outside an experiments subpackage may import it, besides ``experiments.cli``
#: (the one entry point registers every command): the main job measures the overhead table
SUBPACKAGE_USERS = {"experiments.overhead": {"experiments.reproduce"}}

#: packages that import project modules at module level only
NO_LOCAL_IMPORTS = (
    "curvopt",
    "fixtures",
    "benchmarks",
    "experiments.overhead",
    "experiments.compare",
    "experiments.reproduce",
)

#: calls that load code by file path or change where imports look
BY_PATH = {"spec_from_file_location", "SourceFileLoader", "run_path", "exec_module"}


def _read_layers():
    """The layers ``curvopt/__init__.py``'s docstring states: ``N. ``a``, ``b``: job`` lines,
    bottom up."""
    doc = ast.get_docstring(ast.parse((ROOT / "curvopt" / "__init__.py").read_text()))
    layers = []
    for line in doc.splitlines():
        match = re.match(r"(\d+)\. ((?:``\w+``(?:, )?)+):", line)
        if match:
            assert int(match[1]) == len(layers), f"layer {match[1]} out of order"
            layers.append(set(re.findall(r"``(\w+)``", match[2])))
    return layers


#: the library's folders and top-level modules, bottom up (``curvopt/__init__.py``); a part may
#: import its layer or lower ones
LAYERS = _read_layers()


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


#: result files and the scripts that produced them (``experiments/results/ttr/logs/``)
RESULTS = ROOT / "experiments" / "results"


def _modules():
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if RESULTS not in path.parents:  # run records kept beside their results: data
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


def _within(module: str, package: str) -> bool:
    return module == package or _is_ancestor(package, module)


def test_no_project_module_imported_inside_a_function(graph):
    local = [
        f"{name} imports {target}"
        for name, targets in graph.items()
        if any(_within(name, package) for package in NO_LOCAL_IMPORTS)
        for target, inside in targets
        if inside
    ]
    assert not local, sorted(set(local))


def test_packages_import_only_the_packages_below_them(graph):
    bad = [
        f"{name} imports {target}"
        for name, targets in graph.items()
        for target, _ in targets
        if target.split(".")[0] != name.split(".")[0]
        and target.split(".")[0] not in PACKAGE_USES[name.split(".")[0]]
    ]
    assert not bad, sorted(set(bad))


def _subpackage(module: str):
    """``experiments.X`` when ``module`` is in the subpackage ``experiments/X/``, else None."""
    parts = module.split(".")
    if parts[0] == "experiments" and len(parts) > 1:
        path = ROOT.joinpath(*parts[:2])
        if (path / "__init__.py").exists():
            return ".".join(parts[:2])
    return None


def test_experiments_subpackages_are_used_where_declared(graph):
    bad = []
    for name, targets in graph.items():
        if not name.startswith("experiments.") or name == "experiments.cli":
            continue
        for target, _ in targets:
            package = _subpackage(target)
            if package is None or _within(name, package):
                continue
            if not any(_within(name, user) for user in SUBPACKAGE_USERS.get(package, ())):
                bad.append(f"{name} imports {target} (declare it in SUBPACKAGE_USERS)")
    assert not bad, sorted(set(bad))


def test_nothing_loads_a_module_by_path():
    found = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            called = node.func if isinstance(node, ast.Call) else None
            attr = getattr(called, "attr", getattr(called, "id", None))
            if attr in BY_PATH:
                found.append(f"{name}:{node.lineno} {attr}")
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "path"
                and getattr(node.value, "id", None) == "sys"
            ):
                found.append(f"{name}:{node.lineno} sys.path")
    assert not found, found


def _part(module: str):
    """The folder (or top-level module) of ``curvopt`` that ``module`` is in, or None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "curvopt" and len(parts) > 1 else None


def _layer(module: str):
    for level, members in enumerate(LAYERS):
        if _part(module) in members:
            return level
    return None


def test_the_layers_point_down(graph):
    for name, targets in graph.items():
        if _layer(name) is None:
            continue
        for target, _ in targets:
            if _layer(target) is not None:
                assert _layer(target) <= _layer(name), (
                    f"{name} (layer {_layer(name)}) imports {target} (layer {_layer(target)})"
                )


def test_no_two_folders_import_each_other(graph):
    """At folder level the imports form no circle (within one layer too)."""
    edges = {}
    for name, targets in graph.items():
        for target, _ in targets:
            if None not in (_part(name), _part(target)) and _part(name) != _part(target):
                edges.setdefault(_part(name), set()).add(_part(target))
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            assert state.get(nxt) != "open", "folders import in a circle: " + " -> ".join(
                path + [node, nxt]
            )
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [])


def test_every_part_has_a_layer():
    parts = {
        p.stem if p.suffix == ".py" else p.name
        for p in (ROOT / "curvopt").iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()
    }
    stated = set().union(*LAYERS)
    assert parts == stated, (
        f"in curvopt but not in its layers: {sorted(parts - stated)}; "
        f"in its layers but not in curvopt: {sorted(stated - parts)}"
    )


#: the consumers of one layer that share what they need through a layer below instead of
#: importing each other: ``linalg``'s operators apply the optimizers' damped inverses, which live
#: in ``inversion`` beneath both
SIBLING_CONSUMERS = ("optim", "linalg")


def _imports_between_consumers(graph) -> list[str]:
    return sorted(
        f"{name} imports {target}"
        for name, targets in graph.items()
        for target, _ in targets
        if {_part(name), _part(target)} == set(SIBLING_CONSUMERS)
    )


def test_the_consumers_import_each_other_not(graph):
    """``linalg`` imports nothing of ``optim``, nor ``optim`` of ``linalg`` (the layer test lets
    folders of one layer import each other one way)."""
    assert not _imports_between_consumers(graph)


def test_the_consumer_check_can_fail(graph):
    """The check above names an import of ``optim`` added to ``linalg``."""
    edited = dict(graph)
    edited["curvopt.linalg.kronecker"] = [*graph["curvopt.linalg.kronecker"], ("curvopt.optim", 0)]
    assert _imports_between_consumers(edited) == ["curvopt.linalg.kronecker imports curvopt.optim"]


#: what the per-module math (``layers``, ``losses``) may read of the core: the call it is
#: given, the reductions, which parameters a module owns; nothing that knows of hooks or passes
#: (``core.state``, ``core.records``, ``core.extended``)
RULES_READ_OF_CORE = {"curvopt.core.calls", "curvopt.core.reductions", "curvopt.core.params"}


def test_layer_rules_know_nothing_of_hooks_or_passes(graph):
    bad = sorted(
        f"{name} imports {target}"
        for name, targets in graph.items()
        if _part(name) in ("layers", "losses")
        for target, _ in targets
        if _part(target) == "core" and target not in RULES_READ_OF_CORE
    )
    assert not bad, bad


#: the folders whose ``__init__`` docstring is their map, naming each of their modules
MAPPED = ("autograd", "core", "graph", "engine", "guards", "loop", "entry", "frontend", "inversion")


@pytest.mark.parametrize("folder", MAPPED)
def test_every_folder_map_names_its_modules(folder):
    path = ROOT / "curvopt" / folder
    doc = ast.get_docstring(ast.parse((path / "__init__.py").read_text())) or ""
    unnamed = [
        p.stem
        for p in sorted(path.glob("*.py"))
        if p.stem != "__init__" and f"``{p.stem}``" not in doc
    ]
    assert not unnamed, f"curvopt/{folder}/__init__.py does not name {unnamed}"
