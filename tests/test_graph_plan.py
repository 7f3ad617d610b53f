"""The graph of a pass is walked once (``graph.search``), and its structure's plan is cached once
(``core.plans``).

* one walk of the graph per extended loss per pass, whatever is requested (first order, GGN
  diagonals, Kronecker factors, the Hessian diagonal, through a reentrant checkpoint), and no
  other module of curvopt reads an autograd node's ``next_functions``;
* the plan of a structure is frozen, made on the first pass and reused (the row probes run once);
* keys cannot collide: graphs with the same node types but other edges, and fresh models that
  reuse the ids of freed ones, get plans of their own.
"""

import dataclasses
import weakref
import pathlib
import re

import pytest
import torch
from conftest import DT, collect_if_alive
from torch import nn
from torch.utils.checkpoint import checkpoint

import curvopt
from curvopt import extensions as ext
from curvopt.core import plans
from curvopt.core.records import records_on, token
from curvopt.engine import rows
from curvopt.graph import walk as walk_module
from fixtures import zoo

N = 5


class _Blocks(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.reentrant = reentrant

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.reentrant:
            h = checkpoint(lambda t: torch.sigmoid(self.b(t)), h, use_reentrant=True)
        else:
            h = torch.sigmoid(self.b(h))
        return self.c(h)


def _model(reentrant=False, seed=0):
    torch.manual_seed(seed)
    return curvopt.extend(_Blocks(reentrant).to(DT)), curvopt.extend(nn.CrossEntropyLoss())


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, 3, dtype=DT, generator=g), torch.randint(0, 2, (N,), generator=g)


@pytest.fixture
def walks(monkeypatch):
    """Every full walk made (``within`` None: not a re-read of a part of one)."""
    made = []
    original = walk_module.Walk._walk

    def counted(self, start, recompute, within):
        original(self, start, recompute, within)
        if within is None:
            made.append(self)

    monkeypatch.setattr(walk_module.Walk, "_walk", counted)
    return made


@pytest.fixture
def probed(monkeypatch):
    """Every verification of a row layout by probes (``rows._verified``)."""
    made = []
    verified = rows._verified
    monkeypatch.setattr(rows, "_verified", lambda *a, **k: made.append(1) or verified(*a, **k))
    return made


def _pass(model, lossfunc, exts, seed=0):
    x, y = _data(seed)
    with curvopt.collect(*exts):
        lossfunc(model(x), y).backward()


CASES = {
    "first order": [ext.BatchGrad(), ext.SumGradSquared()],
    "GGN": [ext.DiagGGNExact(), ext.BatchDiagGGNExact()],
    "Kronecker": [ext.KFAC(), ext.KFLR(), ext.BatchGrad()],
    "Hessian": [ext.DiagHessian(), ext.BatchDiagHessian()],
    "KFRA": [ext.KFRA()],
}


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
def test_one_walk_per_pass(walks, case, reentrant):
    model, lossfunc = _model(reentrant)
    for seed in range(3):
        walks.clear()
        _pass(model, lossfunc, CASES[case], seed)
        assert len(walks) == 1, walks  # from the loss's input, nothing else
        assert all(p.grad is not None for p in model.parameters())


def test_one_walk_without_an_extended_loss(walks):
    """First order with a plain loss (Hugging Face's ``labels=``): one walk at the first
    module hook."""
    model, _ = _model()
    x, y = _data()
    with curvopt.collect(ext.BatchGrad()):
        nn.functional.cross_entropy(model(x), y).backward()
    assert len(walks) == 1
    assert model.a.weight.grad_batch.shape == (N, 4, 3)


def test_no_other_module_reads_next_functions():
    """Reading the graph is ``graph.search``'s (``edges_of``; torch's own accessors aside)."""
    root = pathlib.Path(curvopt.__file__).parent
    allowed = {"search.py", "torch_internals.py"}
    readers = {
        path.name
        for path in root.rglob("*.py")
        if re.search(r"\.next_functions\b", path.read_text()) and path.name not in allowed
    }
    assert not readers, readers
    text = (root / "graph" / "search.py").read_text()
    assert text.count(".next_functions") == 1  # ``edges_of``, the one read


def test_every_graph_walk_is_the_one_search():
    """No module of curvopt walks nodes with a stack of its own: every traversal of the
    autograd graph is ``graph.search.search`` with its own ``expand``."""
    root = pathlib.Path(curvopt.__file__).parent
    walkers = {
        path.name
        for path in root.rglob("*.py")
        if re.search(r"while stack|stack\.pop\(\)|\.popleft\(\)", path.read_text())
    }
    assert walkers == {"search.py"}, walkers


def test_plan_is_frozen_and_made_once(walks, probed):
    model, lossfunc = _model()
    for seed in range(3):
        _pass(model, lossfunc, [ext.DiagGGNExact()], seed)
    assert len(probed) == 1  # the row layout is verified on the first pass only
    (key,) = {walk.key for walk in walks}
    plan = plans.plan_cache()[key]
    assert all(walk.plan is plan for walk in walks[1:])  # the later passes bind it as it is
    assert plan.layouts and plan.sums_checked
    assert [shapes for _, _, shapes in plan.calls] == [((N, 2),), ((N, 4),), ((N, 4),)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.sums_checked = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.layouts = ()


def test_fresh_models_reusing_ids_get_their_own_plans(walks, probed):
    """A model freed and a fresh one built in its place (at the same ids or not): the fresh one's
    graph gets a key and a plan of its own, and its rows are probed again."""
    for seed in range(3):
        model, lossfunc = _model(seed=seed)
        _pass(model, lossfunc, [ext.DiagGGNExact()])
        freed = weakref.ref(model)
        del model, lossfunc
        collect_if_alive(freed)
    assert len({walk.key for walk in walks}) == 3
    assert len({id(walk.plan) for walk in walks}) == 3
    assert len(probed) == 3


def _types(walk):
    return [entry for entry in walk.key[0] if isinstance(entry, str)]


def test_same_node_types_other_edges_differ():
    """``exp(sin x) + sin x`` and ``exp(x) + sin x`` visit the same node types in the same order
    (a key of types alone would take one for the other); their keys differ."""
    x = torch.randn(3, requires_grad=True)
    s = x.sin()
    first = walk_module.Walk(s.exp() + s)
    second = walk_module.Walk(x.exp() + x.sin())
    assert _types(first) == _types(second)
    assert first.key != second.key
    a, b = torch.randn(2, 3, requires_grad=True).unbind(0)
    assert walk_module.Walk(a.sin()).key != walk_module.Walk(b.sin()).key  # output 0 vs 1
    assert walk_module.Walk(x.exp() + x.sin()).key == second.key  # a fresh graph, one structure


def _decoded(key):
    """A walk's key read back: per node, ``(type, calls, [(discovery number, output nr)])``
    (a string opens a node's entry, a tuple holds its calls, pairs of ints its edges)."""
    nodes = []
    for entry in key:
        if isinstance(entry, str):
            nodes.append((entry, None, []))
        elif isinstance(entry, tuple):
            nodes[-1] = (nodes[-1][0], entry, nodes[-1][2])
        else:
            nodes[-1][2].append(entry)
    return [(kind, calls, list(zip(flat[::2], flat[1::2]))) for kind, calls, flat in nodes]


def test_the_key_gives_the_graph_back():
    """On the zoo's decoder (branches, residual adds, shared inputs, constants, modules called
    on several nodes): the key read back gives every node walked, in the order walked, its type,
    its calls and its edges, each the discovery number of the node it passes gradient to (-1:
    none) and the output it takes."""
    problem = zoo.gpt()
    model = curvopt.extend(problem.model)
    x, _ = problem.make_batch(2)
    walk = walk_module.Walk(model(x))
    numbers = walk.numbers
    expected = []
    for node in walk.edges:  # (the order the walk expanded them in)
        calls = tuple((token(r.module), index, r.out_shapes) for r, index, _ in records_on(node))
        edges = [(numbers.get(fn, -1), nr) for fn, nr in walk.edges[node]]
        expected.append((type(node).__name__, calls, edges))
    assert any(calls for _, calls, _ in expected) and any(len(e) > 1 for *_, e in expected)
    assert _decoded(walk.key[0]) == expected


def test_plan_names_the_broadcast_calls(walks):
    """GPT's positions ``pos(arange(T))`` are broadcast over the batch: the plan says which call
    (by its position in ``calls``), and each pass binds it to its own records and nodes."""
    model, lossfunc, make_batch, _ = zoo.gpt()[:4]
    model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
    for seed in range(2):
        x, y = make_batch(3, seed)
        with curvopt.collect(ext.DiagGGNExact()):
            lossfunc(model(x).reshape(-1, 7), y.reshape(-1)).backward()
    first, second = walks
    assert first.key == second.key  # one structure: the second pass binds the first one's plan
    records = list(second.calls)
    assert [records[i].module for i in second.plan.broadcasts] == [model.pos]
    assert all((r.broadcast is not None) == (r.module is model.pos) for r in records)
    assert model.pos.weight.diag_ggn_exact.shape == model.pos.weight.shape
