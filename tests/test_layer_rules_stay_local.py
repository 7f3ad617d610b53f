"""No process-wide state steers a pass: no layer rule touches it, and the suspend switch and
the plan cache belong to their context.

A layer rule (``curvopt/layers/``, all but the registry its declarations fill at import)
computes from its call and nothing else: it names no ``core.state`` switch, declares no
``global``, assigns no attribute or entry of a module-level or imported name (``torch.x = v``,
``_CACHE[k] = v``), calls no in-place change on a module-level container or context variable
(``X.update``, ``V.set``), and calls no process-wide torch setter (``torch.set_*``,
``torch.manual_seed``). Where a rule re-runs its module it silences curvopt's hooks through the
``Call.quiet`` its pass hands it: ``core.state.SUSPENDED``, a context variable, so the switch
holds in the thread that entered it, for the autograd work that thread runs, and nowhere else.
"""

import ast
import pathlib
import threading

import pytest
import torch
from torch import nn
from test_no_global_state import MUTATORS as CONTAINER_MUTATORS

import curvopt
from curvopt import extensions as ext
from curvopt.core import plans
from curvopt.core.state import STATE, SUSPENDED

LAYERS = pathlib.Path(__file__).resolve().parents[1] / "curvopt" / "layers"

#: filled by the declarations when their modules are imported (``test_no_global_state``)
DECLARATIONS = {"registry.py", "__init__.py"}

#: calls that change a container (``test_no_global_state``'s) or a context variable in place
MUTATORS = CONTAINER_MUTATORS | {"set", "reset"}

#: the process-wide switches of ``core.state``
SWITCHES = {"STATE", "SUSPENDED", "_State"}


def _root(node) -> ast.AST:
    """The name an attribute/subscript chain starts from (``torch`` of ``torch.a.b[0]``)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node


def _module_names(tree: ast.Module):
    """The names bound at module level: ``(assigned, imported)``."""
    assigned, imported = set(), set()
    for node in tree.body:
        if isinstance(node, ast.Assign):
            assigned |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            assigned.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return assigned, imported


def _touches(source: str) -> list:
    """What the functions of ``source`` do to process-wide state, one line each."""
    tree = ast.parse(source)
    assigned, imported = _module_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "curvopt.core.state":
            found.append(f"line {node.lineno}: imports curvopt.core.state")
        elif isinstance(node, ast.Name) and node.id in SWITCHES:
            found.append(f"line {node.lineno}: names {node.id}")
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                found.append(f"line {node.lineno}: global {', '.join(node.names)}")
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                targets = (
                    node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                )
                for target in targets:
                    root = _root(target)
                    if target is not root and isinstance(root, ast.Name):
                        if root.id in assigned | imported:
                            found.append(f"line {node.lineno}: assigns into {root.id}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name, root = node.func.attr, _root(node.func.value)
                if not isinstance(root, ast.Name):
                    continue
                if name in MUTATORS and isinstance(node.func.value, ast.Name):
                    if root.id in assigned:
                        found.append(f"line {node.lineno}: {root.id}.{name}(...)")
                if root.id == "torch" and (name.startswith("set_") or name == "manual_seed"):
                    found.append(f"line {node.lineno}: torch setter {name}")
    return found


def test_the_check_sees_each_kind_of_planted_change():
    planted = {
        "from curvopt.core.state import STATE\n\ndef rule(call):\n    with STATE.suspend():\n"
        "        return call\n": 2,  # the import and the name
        "_CACHE = {}\n\ndef rule(call):\n    _CACHE[call] = 1\n": 1,
        "_SEEN = set()\n\ndef rule(call):\n    _SEEN.add(call)\n": 1,
        "import contextvars\nV = contextvars.ContextVar('v')\n\ndef rule(call):\n    V.set(1)\n": 1,
        "import torch\n\ndef rule(call):\n    torch.backends.cudnn.enabled = False\n": 1,
        "import torch\n\ndef rule(call):\n    torch.set_default_dtype(torch.float64)\n": 1,
        "N = 0\n\ndef rule(call):\n    global N\n    N = 1\n": 1,
    }
    for source, count in planted.items():
        assert len(_touches(source)) == count, (source, _touches(source))
    local = "import torch\n\ndef rule(call):\n    out = {}\n    out['a'] = torch.add(call, 1)\n"
    assert _touches(local) == []


def test_no_layer_rule_touches_process_wide_state():
    found = {
        path.name: _touches(path.read_text())
        for path in sorted(LAYERS.glob("*.py"))
        if path.name not in DECLARATIONS
    }
    assert not {name: lines for name, lines in found.items() if lines}


def test_the_suspend_switch_is_restored_on_exit_and_on_error():
    assert not SUSPENDED.get()
    with STATE.suspend():
        with STATE.suspend():
            assert SUSPENDED.get()
        assert SUSPENDED.get()
    assert not SUSPENDED.get()
    with pytest.raises(ValueError):
        with STATE.suspend():
            raise ValueError
    assert not SUSPENDED.get()


def test_nested_autograd_work_sees_the_switch_of_the_hook_that_ran_it():
    """Where a pass silences its hooks (a rule's re-run in a gradient hook), the backward it
    runs there sees the switch: its hooks run in the thread that called it."""
    seen = []
    x = torch.randn(3, requires_grad=True)

    def outer(grad):
        with STATE.suspend(), torch.enable_grad():
            y = torch.randn(3, requires_grad=True)
            z = (y * 2).sum()
            y.register_hook(lambda g: seen.append(SUSPENDED.get()))
            torch.autograd.grad(z, y)
        seen.append(SUSPENDED.get())

    x.register_hook(outer)
    (x * 3).sum().backward()
    assert seen == [True, False]


def test_a_suspend_in_one_thread_leaves_another_threads_pass_alone():
    """The old process-wide counter silenced every thread's hooks: a pass run in a second
    thread while the first re-runs a module computed nothing."""
    torch.manual_seed(0)
    model = curvopt.extend(nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction="sum"))
    X, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 2, (5,))
    results = {}

    def worker():
        with curvopt.collect(ext.BatchGrad()):
            lossfunc(model(X), y).backward()
        results.update({k: p.grad_batch.clone() for k, p in model.named_parameters()})

    with STATE.suspend():
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        assert SUSPENDED.get()
    for k, p in model.named_parameters():
        want = torch.stack(
            [
                torch.autograd.grad(lossfunc(model(X[n : n + 1]), y[n : n + 1]), p)[0]
                for n in range(5)
            ]
        )
        torch.testing.assert_close(results[k], want, rtol=1e-12, atol=1e-12)


def test_the_plan_cache_is_the_contexts():
    """A structure's plan is kept in the context whose pass made it (``core.plans.PLANS``): a
    pass in another thread starts from no plan, makes its own, right, and leaves this
    thread's cache as it was."""
    torch.manual_seed(1)
    model = curvopt.extend(nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction="sum"))
    X, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 2, (5,))

    def diagonal():
        with curvopt.collect(ext.DiagGGNExact()):
            lossfunc(model(X), y).backward()
        return {k: p.diag_ggn_exact.clone() for k, p in model.named_parameters()}

    mine = diagonal()
    before = dict(plans.plan_cache())
    assert before  # this thread's pass made a plan
    seen = {}

    def worker():
        seen["empty"] = not plans.plan_cache()
        seen["values"] = diagonal()
        seen["plans"] = len(plans.plan_cache())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen["empty"] and seen["plans"] >= 1
    assert dict(plans.plan_cache()) == before
    for k, value in mine.items():
        torch.testing.assert_close(seen["values"][k], value, rtol=1e-12, atol=1e-12)
