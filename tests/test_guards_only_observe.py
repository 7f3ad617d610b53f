"""No guard writes a result or feeds a quantity: the guards (``curvopt/guards/``) receive the
pass's events and values and raise.

Read statically from each guard module:

* it imports none of the engine's writers (the result buffer, the reducer, the site readings,
  the accumulation, the contributions they take) and none of the plan's writers that decide
  which code computes (``add_layout``, ``add_site``, ``add_cut``); ``mark_sums_checked`` is
  the one plan fact a guard keeps, that its own check ran on a structure
  (``docs/architecture.md``);
* on what the engine hands it (``results``, ``reducer``, ``readings``, ``accumulator``) it calls
  only readers, and it assigns into none of them;
* it calls no ``setattr`` and no ``put``: no attribute is written onto a parameter.
"""

import ast
import pathlib

import curvopt
from curvopt.engine.reducer import FirstOrderReducer

GUARDS = pathlib.Path(curvopt.__file__).parent / "guards"

#: the engine's objects a guard may be handed, by the names guards give them
HANDED = {"results", "reducer", "readings", "accumulator", "sites"}
#: what a guard may call on them: readers
READERS = {"missing", "has_factors", "basis", "bases", "pending"}
#: imports that would let a guard write results or decide which code runs
WRITER_IMPORTS = {
    ("curvopt.engine.results", "ResultBuffer"),
    ("curvopt.engine.results", "Term"),
    ("curvopt.engine.results", "Factors"),
    ("curvopt.engine.reducer", "FirstOrderReducer"),
    ("curvopt.engine.parameter_sites", "SiteReadings"),
    ("curvopt.engine.accumulate", "Accumulator"),
    ("curvopt.core.plans", "add_layout"),
    ("curvopt.core.plans", "add_site"),
    ("curvopt.core.plans", "add_cut"),
}


def _chain(node) -> list:
    """The names along an attribute chain, outermost last (``ending.results.put`` ->
    ``["ending", "results", "put"]``)."""
    names = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        names.append(node.id)
    return names[::-1]


def _reads(chain: list) -> bool:
    """Whether the call ``chain`` (receiver names, then the method) on a handed object goes
    through a reader first (``readings.pending.values()``, ``results.missing(...)``)."""
    handed = next(i for i, name in enumerate(chain) if name in HANDED)
    return chain[handed + 1] in READERS


def _writes(source: str) -> list:
    """What ``source`` (a guard module) does that writes a result, one line each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (node.module, alias.name) in WRITER_IMPORTS:
                    found.append(f"line {node.lineno}: imports {node.module}.{alias.name}")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "setattr":
                found.append(f"line {node.lineno}: setattr")
            elif isinstance(func, ast.Attribute):
                receiver = _chain(func.value)
                if func.attr == "put":
                    found.append(f"line {node.lineno}: .put")
                elif set(receiver) & HANDED and not _reads(receiver + [func.attr]):
                    found.append(f"line {node.lineno}: {'.'.join(receiver)}.{func.attr}()")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if not isinstance(node, ast.AugAssign) else [node.target]
            for target in targets:
                chain = _chain(target)
                if len(chain) > 1 and set(chain[:-1]) & HANDED:
                    found.append(f"line {node.lineno}: assigns into {'.'.join(chain)}")
    return found


def test_the_check_sees_each_kind_of_planted_write():
    planted = {
        # the site reading as a guard did it: a result fed to the reducer
        "def read(self, p, call, g):\n    self.reducer.add(p, PARAMETER, call, 'w', False)\n": 1,
        "def finish(self, ending):\n    ending.results.put(self.p, 'kfac', None)\n": 1,
        "def finish(self, ending):\n    ending.results.skip(self.p, 'kfac', None, None)\n": 1,
        "def finish(self, ending):\n    ending.results.clear()\n": 1,
        "def f(self, p, total):\n    self.reducer.moments_from_grad.append((p, total))\n": 1,
        "def f(self, p):\n    self.reducer.grads[id(p)] = p.grad\n": 1,
        "def f(self, p):\n    setattr(p, 'batch_l2', None)\n": 1,
        "from curvopt.core.plans import add_site\n": 1,
        "from curvopt.engine.results import Term, name_of\n": 1,
    }
    for source, count in planted.items():
        assert len(_writes(source)) == count, (source, _writes(source))
    assert _writes("def f(self):\n    return list(self.readings.pending.values())\n") == []
    reading = (
        "from curvopt.engine.results import name_of\n\n"
        "def finish(self, ending):\n    return ending.results.missing(self.p, {'kfac'})\n"
    )
    assert _writes(reading) == []


def test_no_guard_writes_a_result():
    found = {path.name: _writes(path.read_text()) for path in sorted(GUARDS.glob("*.py"))}
    assert not {name: lines for name, lines in found.items() if lines}


def test_the_reducer_takes_nothing_from_a_guard():
    """The reducer is handed the pass's probes and gradients; the sums go to the guards as an
    event it emits (``observers``), never through a guard's method it calls."""
    import inspect

    assert "checks" not in inspect.signature(FirstOrderReducer).parameters
    source = (pathlib.Path(curvopt.__file__).parent / "engine" / "reducer.py").read_text()
    assert "self.checks" not in source and "from curvopt.guards" not in source
