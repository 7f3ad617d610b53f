"""No global steers a pass: the module-level objects of ``curvopt`` that its functions change.

A module-level name that a function of its module changes (``X.add(...)``, ``X[k] = v``,
``global X``) is process-wide state. Such state belongs in the core-data folder
(``curvopt/core/``: the hooks' switch, the records' tokens, the extended modules' registry),
where one place states it. Elsewhere only the registries that declarations fill when their
modules are imported may exist, and the caches named below with the reason each outlives a
pass; a new one fails this test until it is justified here (and in ``docs/architecture.md``).
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "curvopt"

#: calls that change a container in place
MUTATORS = {
    "add",
    "append",
    "extend",
    "insert",
    "pop",
    "popitem",
    "clear",
    "update",
    "setdefault",
    "discard",
    "remove",
    "move_to_end",
}

#: outside ``core``: module -> the names it may change, each with its reason
ALLOWED = {
    # registries, filled at import by the declarations themselves
    "extensions/base.py": {"_WRITERS"},
    "extensions/quantity.py": {"_DECLARED"},
    # and "_RESOLVED": each module type's rule once looked up (the MRO walk that decides whether
    # a subclass computes its parent's function, warned once per type), emptied by registering
    "layers/registry.py": {"_RULES", "_NAMED", "_FALLBACK", "_REPARAMETRIZED", "_RESOLVED"},
    "losses/base.py": {"_RULES"},
    # weak: the modules warned about once
    "guards/unextended.py": {"_WARNED"},
    # how errors name a module (its path): the lookup of the extended registry, set once when
    # ``core.extended`` is imported (errors, below the core, cannot import it)
    "errors.py": {"_PATH_OF"},
}


def _changed(path: pathlib.Path) -> set:
    """The module-level names of ``path`` that a function of it changes."""
    tree = ast.parse(path.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    found = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                found |= set(node.names) & names
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                base = node.func.value
                if node.func.attr in MUTATORS and isinstance(base, ast.Name):
                    found |= {base.id} & names
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if not isinstance(node, ast.AugAssign) else [node.target]
                for target in targets:
                    if isinstance(target, (ast.Subscript, ast.Attribute)):
                        base = target.value
                        if isinstance(base, ast.Name):
                            found |= {base.id} & names
    return found


def test_the_detector_sees_a_changed_global(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("A = {}\nB = set()\nC = 1\n\ndef f(k):\n    A[k] = 1\n    B.add(k)\n")
    assert _changed(source) == {"A", "B"}


def test_process_wide_state_lives_in_core_or_is_declared():
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith("core/"):
            continue
        extra = _changed(path) - ALLOWED.get(relative, set())
        if extra:
            found[relative] = sorted(extra)
    assert not found, found


def test_every_declared_global_still_exists():
    """The list names no state that is gone (it shrinks with the code)."""
    stale = {
        relative: sorted(names - _changed(ROOT / relative))
        for relative, names in ALLOWED.items()
        if names - _changed(ROOT / relative)
    }
    assert not stale, stale
