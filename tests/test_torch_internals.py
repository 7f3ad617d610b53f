"""Every autograd node name and private accessor curvopt relies on still exists in the installed
torch (``curvopt/autograd/torch_internals.py``): the names are node classes of torch and the
nodes that small graphs create; the accessors answer as documented inside and outside a backward
pass."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from curvopt.autograd import second_derivatives, torch_rerun
from curvopt.autograd import torch_internals as ti

#: the tables of node names generated from torch's derivatives (``torch._C._functions``)
GENERATED = {
    "SHAPE_OPS": ti.SHAPE_OPS,
    "BROADCASTING_OPS": ti.BROADCASTING_OPS,
    "NO_BATCHING_RULE": ti.NO_BATCHING_RULE,
    "MAX_POOL": set(ti.MAX_POOL),
    "CONSTANT_PAD": {ti.CONSTANT_PAD},
    "FROZEN_PRODUCTS": set(ti.FROZEN_PRODUCTS),
    "DATA_INDEXING": ti.DATA_INDEXING,
    "LINEAR_OPS": ti.LINEAR_OPS,
    "BILINEAR_OPS": ti.BILINEAR_OPS,
    "SECOND_DERIVATIVES": set(second_derivatives.SECOND_DERIVATIVES),
    "ACCUMULATE_GRAD": {ti.ACCUMULATE_GRAD},
    "ADD": {ti.ADD},
    "IN_PLACE_ON_VIEW": {ti.IN_PLACE_ON_VIEW},
    "LOSS_COMBINATIONS": ti.LOSS_COMBINATIONS,
    "LOSS_NODES": {
        ti.NLL_LOSS,
        ti.NLL_LOSS_2D,
        ti.VIEW,
        ti.LOG_SOFTMAX,
        ti.MSE_LOSS,
        ti.BCE_WITH_LOGITS,
    },
}


@pytest.mark.parametrize("table", sorted(GENERATED))
def test_every_name_is_a_node_class_of_torch(table):
    missing = sorted(n for n in GENERATED[table] if not hasattr(torch._C._functions, n))
    assert not missing, f"{table}: no autograd node class {missing} in torch {torch.__version__}"


def _names(t: torch.Tensor):
    """Class names of every autograd node upstream of ``t``."""
    found, stack = set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or type(node).__name__ in found:
            continue
        found.add(type(node).__name__)
        stack.extend(fn for fn, _ in node.next_functions)
    return found


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


def _frozen(*shape):
    return torch.ones(*shape, dtype=torch.float64)


#: (graph builder, table, node name the graph must contain)
GRAPHS = [
    (lambda: _x(3).unsqueeze(0), ti.SHAPE_OPS, "UnsqueezeBackward0"),
    (lambda: _x(2, 3).view(6), ti.SHAPE_OPS, "ViewBackward0"),
    (lambda: _x(2, 3) + _x(3), ti.BROADCASTING_OPS, "AddBackward0"),
    (lambda: _x(1, 3).expand(4, 3), ti.BROADCASTING_OPS, "ExpandBackward0"),
    (lambda: F.max_pool2d(_x(1, 1, 4, 4), 2), ti.NO_BATCHING_RULE, "MaxPool2DWithIndicesBackward0"),
    (lambda: F.max_pool1d(_x(1, 1, 4), 2), ti.NO_BATCHING_RULE, "MaxPool2DWithIndicesBackward0"),
    (lambda: F.max_pool3d(_x(1, 1, 2, 4, 4), 2), set(ti.MAX_POOL), "MaxPool3DWithIndicesBackward0"),
    (lambda: F.pad(_x(1, 2, 3), (1, -1)), {ti.CONSTANT_PAD}, "ConstantPadNdBackward0"),
    (lambda: F.linear(_x(2, 3, 4), _frozen(5, 4)), set(ti.FROZEN_PRODUCTS), "MmBackward0"),
    (
        lambda: F.linear(_x(2, 3, 4), _frozen(5, 4), _frozen(5)),
        set(ti.FROZEN_PRODUCTS),
        "AddmmBackward0",
    ),
    (lambda: _x(4, 2)[torch.tensor([0, 2])], ti.DATA_INDEXING, "IndexBackward0"),
    (
        lambda: _x(4).masked_select(torch.tensor([1, 0, 1, 0]).bool()),
        ti.DATA_INDEXING,
        "MaskedSelectBackward0",
    ),
    (lambda: _x(4, 2).index_select(0, torch.tensor([1])), ti.DATA_INDEXING, "IndexSelectBackward0"),
    (lambda: _x(4, 2).gather(1, torch.tensor([[0]] * 4)), ti.DATA_INDEXING, "GatherBackward0"),
    (lambda: _x(4).take(torch.tensor([3])), ti.DATA_INDEXING, "TakeBackward0"),
    (lambda: _x(2, 3) @ _x(3, 2), ti.BILINEAR_OPS, "MmBackward0"),
    (lambda: _x(2, 3) * _x(2, 3), ti.BILINEAR_OPS, "MulBackward0"),
    (lambda: F.linear(_x(2, 3), _x(4, 3), _x(4)), ti.BILINEAR_OPS, "AddmmBackward0"),
    (lambda: F.prelu(_x(2, 3), _x(1)), ti.BILINEAR_OPS, "PreluKernelBackward0"),
    (lambda: F.relu(_x(3)), ti.LINEAR_OPS, "ReluBackward0"),
    (lambda: _x(2, 3).transpose(0, 1).reshape(6), ti.LINEAR_OPS, "CloneBackward0"),
    (lambda: F.pad(_x(1, 2, 3), (1, 1)), ti.LINEAR_OPS, "ConstantPadNdBackward0"),
    (lambda: torch.cat([_x(2), _x(3)]), ti.LINEAR_OPS, "CatBackward0"),
    (lambda: _x(2).view_as(torch.empty(2)), {ti.ACCUMULATE_GRAD}, "AccumulateGrad"),
    (lambda: (_x(2, 3) * 1).view(6).relu_(), {ti.IN_PLACE_ON_VIEW}, "CopySlices"),
]


@pytest.mark.parametrize("build, table, name", GRAPHS, ids=[g[2] for g in GRAPHS])
def test_node_names_seen_in_graphs(build, table, name):
    out = build()
    assert name in table
    assert name in _names(out), sorted(_names(out))


def test_loss_nodes_and_their_saved_attributes():
    """What ``recognize`` reads off a functional loss's nodes: the node names, the saved input,
    target and options, the signed integers (saved unsigned) and the reduction enum."""
    x, y, w = _x(3, 4), torch.tensor([0, -100, 3]), torch.rand(4, dtype=torch.float64)
    nll = F.cross_entropy(x, y, weight=w, reduction="sum").grad_fn
    log_softmax = nll.next_functions[0][0]
    assert (type(nll).__name__, type(log_softmax).__name__) == (ti.NLL_LOSS, ti.LOG_SOFTMAX)
    assert ti.saved(nll, "ignore_index") == -100 and ti.saved(log_softmax, "dim") == 1
    assert ti.REDUCTIONS[ti.saved(nll, "reduction")] == "sum"
    assert ti.saved(nll, "target") is y and ti.saved(nll, "weight") is w
    assert ti.saved(nll, "self").grad_fn is log_softmax
    assert ti.saved(F.log_softmax(x, -1).grad_fn, "dim") == -1
    nll_2d = F.cross_entropy(_x(2, 4, 3), torch.zeros(2, 3, dtype=torch.long)).grad_fn
    view = nll_2d.next_functions[0][0]
    assert (type(nll_2d).__name__, type(view).__name__) == (ti.NLL_LOSS_2D, ti.VIEW)
    assert type(view.next_functions[0][0]).__name__ == ti.LOG_SOFTMAX
    target = torch.rand(3, 4, dtype=torch.float64)
    mse = F.mse_loss(x, target).grad_fn
    assert type(mse).__name__ == ti.MSE_LOSS and ti.saved(mse, "self") is x
    assert ti.REDUCTIONS[ti.saved(mse, "reduction")] == "mean"
    bce = F.binary_cross_entropy_with_logits(x, target, pos_weight=w, reduction="none").grad_fn
    assert type(bce).__name__ == ti.BCE_WITH_LOGITS and ti.saved(bce, "pos_weight") is w
    assert ti.saved(bce, "weight") is None and ti.saved(bce, "target") is target
    assert ti.REDUCTIONS[ti.saved(bce, "reduction")] == "none"


def test_python_node_names():
    """The reentrant checkpoint's node and a ``torch.compile`` graph's node."""
    x = _x(3)
    out = checkpoint(torch.sin, x, use_reentrant=True)
    assert type(out.grad_fn).__name__ == ti.REENTRANT_CHECKPOINT
    assert isinstance(out.grad_fn, ti.PYTHON_FUNCTION_NODE)  # a Python backward
    assert not isinstance(torch.sin(x).grad_fn, ti.PYTHON_FUNCTION_NODE)  # a C++ op's
    compiled = torch.compile(torch.sin, backend="aot_eager")
    assert type(compiled(_x(3)).grad_fn).__name__ in ti.COMPILED


OPS = {
    "SigmoidBackward0": torch.sigmoid,
    "TanhBackward0": torch.tanh,
    "GeluBackward0": lambda u: F.gelu(u, approximate="tanh"),
    "SiluBackward0": F.silu,
    "MishBackward0": F.mish,
    "LogSigmoidBackward0": F.logsigmoid,
    "SoftplusBackward0": lambda u: F.softplus(u, 2.0, 1.5),
    "CeluBackward0": lambda u: F.celu(u, 0.7),
    "EluBackward0": F.selu,
}


def test_every_curved_op_is_covered():
    assert set(OPS) == set(second_derivatives.SECOND_DERIVATIVES)


@pytest.mark.parametrize("name", sorted(OPS))
def test_second_derivative_from_saved_tensors(name):
    """``phi''(u)`` read off the node's saved tensors equals the second derivative by autograd
    (an accessor such as ``_saved_alpha`` renamed would raise or give a different value)."""
    u = torch.linspace(-3, 3, 13, dtype=torch.float64)
    y = OPS[name](u.clone().requires_grad_(True))
    assert type(y.grad_fn).__name__ == name
    expected = torch.func.vmap(torch.func.grad(torch.func.grad(OPS[name])))(u)
    torch.testing.assert_close(second_derivatives.SECOND_DERIVATIVES[name](y.grad_fn), expected)


def test_accessors_outside_a_backward_pass():
    assert ti.current_graph_task_id() == -1
    assert ti.current_autograd_node() is None


def test_accessors_inside_a_backward_pass():
    x, w = _x(3), _x(3)
    y = x.sin() * w
    seen, order = {}, []

    def accumulator(leaf):
        with torch.enable_grad():
            return leaf.view_as(leaf).grad_fn.next_functions[0][0]

    def hook(grad):
        seen["task"] = ti.current_graph_task_id()
        seen["node"] = ti.current_autograd_node()
        seen["x"] = ti.will_engine_execute_node(accumulator(x))
        seen["w"] = ti.will_engine_execute_node(accumulator(w))
        ti.queue_callback(lambda: order.append("callback"))
        order.append("hook")

    y.register_hook(hook)
    y.sum().backward(inputs=[x])
    assert seen["task"] >= 0
    assert seen["node"] is y.grad_fn
    assert seen["x"] is True and seen["w"] is False
    assert order == ["hook", "callback"]  # the callback runs once the pass has ended


def test_node_metadata_accessors():
    x = _x(1, 3)
    assert ti.input_shape(x.expand(2, 3).grad_fn, 0) == (2, 3)
    assert ti.add_alpha(torch.add(x, _x(1, 3), alpha=2.5).grad_fn) == 2.5
    assert type(torch.add(x, x).grad_fn).__name__ == ti.ADD


def test_grad_accumulator():
    p = torch.nn.Parameter(torch.randn(3))
    with torch.no_grad():  # made with grad on, whatever the mode
        node = ti.grad_accumulator(p)
    assert type(node).__name__ == ti.ACCUMULATE_GRAD and node.variable is p
    assert ti.grad_accumulator(p) is node  # one node per leaf


def test_drop_empty_tensor_hooks():
    p = torch.nn.Parameter(torch.randn(3))
    calls = []
    handle = p.register_hook(lambda g: calls.append("removed"))
    handle.remove()
    ti.drop_empty_tensor_hooks(p)
    assert p._backward_hooks is None  # as on a tensor never hooked
    (2 * p).sum().backward()
    assert calls == [] and torch.equal(p.grad, torch.full((3,), 2.0))
    p.register_hook(lambda g: calls.append("new"))  # hooking again works
    ti.drop_empty_tensor_hooks(p)  # a tensor that still has hooks keeps them
    (2 * p).sum().backward()
    assert calls == ["new"]


def test_storage_use_count():
    t = torch.empty(3)
    before = ti.storage_use_count(t.untyped_storage())
    view = t[1:]
    assert ti.storage_use_count(t.untyped_storage()) == before + 1
    del view
    assert ti.storage_use_count(t.untyped_storage()) == before


def _segment(h, scale):
    """Dropout (random) and a non-tensor argument; two outputs."""
    u = F.dropout(torch.tanh(h), 0.5, training=True)
    return u * scale, h.sum()


@pytest.mark.parametrize("preserve", [True, False])
def test_rerun_checkpoint(preserve):
    """The re-run of a reentrant checkpoint's segment: the forward's outputs where the RNG is
    preserved, a graph hanging from the saved inputs, the global generator left alone, and
    ``drew`` telling whether unrestored random numbers were drawn."""
    h = _x(4, 3) * 1.0
    torch.manual_seed(0)
    plain, total = _segment(h, 2.0)
    torch.manual_seed(0)
    out, _ = checkpoint(_segment, h, 2.0, use_reentrant=True, preserve_rng_state=preserve)
    assert torch.equal(out, plain)
    before = torch.get_rng_state()
    outputs, drew = torch_rerun.rerun_checkpoint(out.grad_fn)
    assert torch.equal(torch.get_rng_state(), before)
    assert drew == (not preserve)
    assert len(outputs) == 2 and torch.equal(outputs[1], total)
    if preserve:
        assert torch.equal(outputs[0], plain)
    (g,) = torch.autograd.grad(outputs[0].sum(), h)  # through the graph upstream: h = x * 1.0
    assert g.shape == h.shape and outputs[0].grad_fn is not None


@pytest.mark.parametrize("leaf", [False, True])
def test_hook_gradient_runs_where_register_hook_would(leaf):
    """``hook_gradient`` is ``register_hook`` without its handle: on a leaf and on a node's
    output, between two hooks of torch's in registration order, its return value replaces the
    gradient as theirs does, and a handle of torch's still removes only its own hook."""
    x = _x(3)
    t = x if leaf else x * 2
    seen = []
    first = t.register_hook(lambda g: seen.append(("first", g.clone())))
    ti.hook_gradient(t, lambda g: seen.append(("ours", g.clone())) or g * 10)
    t.register_hook(lambda g: seen.append(("last", g.clone())))
    first.remove()
    (t * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)).sum().backward()
    assert [name for name, _ in seen] == ["ours", "last"]
    torch.testing.assert_close(seen[0][1], torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    torch.testing.assert_close(seen[1][1], 10 * seen[0][1])
    expected = 10 * seen[0][1] * (1 if leaf else 2)
    torch.testing.assert_close(x.grad, expected)


def test_hook_gradient_of_a_subclass_goes_through_register_hook():
    """A tensor subclass's ``register_hook`` (its ``__torch_function__``) is honoured."""
    calls = []

    class Logged(torch.Tensor):
        def register_hook(self, hook):
            calls.append(hook)
            return super().register_hook(hook)

    t = (_x(2) * 2).as_subclass(Logged)
    hook = lambda g: None  # noqa: E731
    ti.hook_gradient(t, hook)
    assert calls == [hook]
    with pytest.raises(RuntimeError, match="doesn't require gradient"):
        ti.hook_gradient(torch.zeros(2), hook)


def test_any_autocast_enabled():
    """One read answers what asking each device type does, on and off, nested."""
    assert not ti.any_autocast_enabled()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert ti.any_autocast_enabled() and torch.is_autocast_enabled("cpu")
        with torch.autocast("cpu", enabled=False):
            assert not ti.any_autocast_enabled()
        assert ti.any_autocast_enabled()
    assert not ti.any_autocast_enabled()


def test_batched_vjp_is_grad_with_batched_columns_bit_for_bit():
    """``batched_vjp`` gives what ``torch.autograd.grad(..., is_grads_batched=True)`` gives,
    bit for bit: from a tensor and a gradient edge, to gradient edges and a leaf, ``None``
    for an input the outputs do not reach; the graph is kept for the next call."""
    x, w, unused = _x(4, 3), _x(3, 5), _x(2)
    h = x @ w
    y = torch.tanh(h) * h.sum(1, keepdim=True)
    z = y.exp().sum(1)
    outputs = (z, torch.autograd.graph.get_gradient_edge(y))
    inputs = (torch.autograd.graph.get_gradient_edge(h), w, unused)
    columns = (torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, 5, dtype=torch.float64))
    ours = ti.batched_vjp(outputs, inputs, columns)
    theirs = torch.autograd.grad(
        outputs, inputs, columns, retain_graph=True, is_grads_batched=True, allow_unused=True
    )
    assert ours[2] is None and theirs[2] is None
    for a, b in zip(ours[:2], theirs[:2]):
        assert a.shape == b.shape and torch.equal(a, b)
    again = ti.batched_vjp(outputs, inputs, columns)  # the graph was retained
    assert all(torch.equal(a, b) for a, b in zip(again[:2], ours[:2]))


def test_batched_vjp_raises_where_grad_raises_and_leaves_no_vmap_level():
    """A backward without a batching rule raises (``propagate`` then goes column by column),
    and the ``vmap`` level is left again: a later batched call works."""

    class Opaque(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            return torch.from_numpy(g.numpy() * 2)  # no batching rule: vmap cannot run it

    x = _x(3)
    y = Opaque.apply(x)
    columns = (torch.ones(2, 3, dtype=torch.float64),)
    with pytest.raises((RuntimeError, NotImplementedError)):
        torch.autograd.grad((y,), (x,), columns, retain_graph=True, is_grads_batched=True)
    before = _vmap_level()
    with pytest.raises((RuntimeError, NotImplementedError)):
        ti.batched_vjp((y,), (x,), columns)
    assert _vmap_level() == before
    (g,) = ti.batched_vjp((x * 3,), (x,), columns)
    assert torch.equal(g, torch.full((2, 3), 3.0, dtype=torch.float64))


def _vmap_level() -> int:
    """The level the next ``vmap`` would take (torch's nesting, left as it was)."""
    level = torch._C._vmapmode_increment_nesting()
    torch._C._vmapmode_decrement_nesting()
    return level
