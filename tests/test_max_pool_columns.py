"""Exact curvature through max pooling with the columns crossing it all at once, scattered at
the pooling's saved indices (``torch_internals.max_pool_transpose``, ``graph/pooling.py``):
DiagGGNExact / BatchDiagGGNExact / KFLR / DiagHessian equal torch.func references in float64
for every pooling configuration (kernel, stride, padding, dilation, ``ceil_mode``, overlapping
windows, 1-D, 2-D, 3-D, poolings in parallel), and the pooling's own backward never runs for
the columns (counted by a hook on its node). Where a path goes around a pooling, the columns
go one at a time, still exact."""

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, extended_copy, ggn_reference, trainable
from reference import hessian, kronecker
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.graph import pooling
from curvopt.autograd import torch_internals

DT = torch.float64
N, CLASSES = 3, 4


class Parallel(nn.Module):
    """Two poolings of one tensor, summed (an inception-like fork): both stages add up."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.wide, self.narrow = nn.MaxPool2d(3, stride=2, padding=1), nn.MaxPool2d(2)
        self.fc = nn.Linear(3 * 4 * 4, CLASSES)

    def forward(self, x):
        h = torch.relu(self.conv(x))
        return self.fc((self.wide(h) + self.narrow(h)).flatten(1))


class Around(nn.Module):
    """A path around the pooling (max plus average of the same tensor): not staged."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 4 * 4, CLASSES)

    def forward(self, x):
        h = torch.tanh(self.conv(x))
        return self.fc((F.max_pool2d(h, 2) + F.avg_pool2d(h, 2)).flatten(1))


def _cnn2d(pool, flat):
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.ReLU(),
        pool,
        nn.Conv2d(3, 2, 2),
        nn.Sigmoid(),
        nn.MaxPool2d(2, stride=1),  # a second pooling, overlapping
        nn.Flatten(),
        nn.Linear(flat, CLASSES),
    )


#: name -> (model, input shape)
MODELS = {
    "overlapping k3 s2 p1": (
        lambda: _cnn2d(nn.MaxPool2d(3, stride=2, padding=1), 2 * 2 * 2),
        (2, 8, 8),
    ),
    "ceil_mode": (lambda: _cnn2d(nn.MaxPool2d(2, ceil_mode=True), 2 * 2 * 2), (2, 7, 7)),
    "dilation": (lambda: _cnn2d(nn.MaxPool2d(2, stride=1, dilation=2), 2 * 3 * 3), (2, 7, 7)),
    "rectangular": (lambda: _cnn2d(nn.MaxPool2d((2, 3), stride=(1, 2)), 2 * 4 * 1), (2, 7, 8)),
    "1d": (
        lambda: nn.Sequential(
            nn.Conv1d(2, 3, 3),
            nn.Tanh(),
            nn.MaxPool1d(3, stride=2, padding=1),
            nn.Flatten(),
            nn.Linear(3 * 4, CLASSES),
        ),
        (2, 9),
    ),
    "3d": (
        lambda: nn.Sequential(
            nn.Conv3d(2, 3, 2),
            nn.ReLU(),
            nn.MaxPool3d(2, stride=1, padding=1, ceil_mode=True),
            nn.Flatten(),
            nn.Linear(3 * 4 * 4 * 4, CLASSES),
        ),
        (2, 4, 4, 4),
    ),
    "parallel": (Parallel, (2, 8, 8)),
}


def _problem(name, reduction):
    make, shape = MODELS[name]
    torch.manual_seed(0)
    plain = make().to(DT)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N, *shape, generator=gen, dtype=DT)
    y = torch.randint(0, CLASSES, (N,), generator=gen)
    return plain, x, y, nn.CrossEntropyLoss(reduction=reduction)


def _pool_nodes(out):
    found, stack, seen = [], [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ in torch_internals.MAX_POOL:
            found.append(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return found


def _run(plain, x, y, lossfunc, *extensions):
    """Two passes (the first settles the plan); ``(model, runs of each pooling's backward in
    the second pass, max_pool_transpose calls in it)``."""
    model = extended_copy(plain)
    loss = curvopt.extend(lossfunc)
    runs = [0]
    for _ in range(2):
        out = model(x)
        runs[0] = 0
        for node in _pool_nodes(out):
            node.register_prehook(lambda grads: runs.__setitem__(0, runs[0] + 1))
        with curvopt.collect(*extensions):
            loss(out, y).backward()
    return model, runs[0], len(_pool_nodes(out))


def _column_counts(monkeypatch, name: str) -> list:
    """The number of columns of each call of ``pooling.<name>``, recorded as it runs."""
    calls = []
    plain = getattr(pooling, name)

    def counted(node, columns):
        calls.append(columns.shape[0])
        return plain(node, columns)

    monkeypatch.setattr(pooling, name, counted)
    return calls


@pytest.fixture
def scatters(monkeypatch):
    return _column_counts(monkeypatch, "max_pool_transpose")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_ggn_diagonals_through_max_pooling(name, reduction, scatters):
    plain, x, y, lossfunc = _problem(name, reduction)
    _, per_sample = ggn_reference(plain, lossfunc, x, y)
    model, runs, pools = _run(plain, x, y, lossfunc, ext.DiagGGNExact(), ext.BatchDiagGGNExact())
    for key, p in trainable(model).items():
        assert_close(p.diag_ggn_exact_batch, per_sample[key], key)
        assert_close(p.diag_ggn_exact, per_sample[key].sum(0), key)
    assert runs == pools  # each pooling's backward ran once: the loss's own backward
    assert scatters and min(scatters) > 1  # all columns of a chunk at once


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", ["overlapping k3 s2 p1", "ceil_mode", "dilation", "parallel"])
def test_kflr_through_max_pooling(name, reduction, scatters):
    plain, x, y, lossfunc = _problem(name, reduction)
    expected = kronecker(plain, lossfunc, x, y)
    model, runs, pools = _run(plain, x, y, lossfunc, ext.KFLR())
    modules = dict(model.named_modules())
    for key, (b, a) in expected.items():
        assert_close(modules[key].weight.kflr[0], b, f"{key} B")
        assert_close(modules[key].weight.kflr[1], a, f"{key} A")
    assert runs == pools
    assert scatters


@pytest.mark.parametrize("name", ["overlapping k3 s2 p1", "1d", "3d"])
def test_hessian_diagonal_through_max_pooling(name, scatters):
    plain, x, y, lossfunc = _problem(name, "mean")
    expected, per_sample = hessian(plain, lossfunc, x, y)
    model, _, _ = _run(plain, x, y, lossfunc, ext.DiagHessian(), ext.BatchDiagHessian())
    for key, p in trainable(model).items():
        assert_close(p.diag_h, expected[key], key)
        assert_close(p.diag_h_batch, per_sample[key], key)
    assert scatters


def test_a_path_around_the_pooling_goes_column_by_column_and_is_exact(scatters):
    torch.manual_seed(0)
    plain = Around().to(DT)
    x, y = torch.randn(N, 2, 8, 8, dtype=DT), torch.randint(0, CLASSES, (N,))
    lossfunc = nn.CrossEntropyLoss()
    _, per_sample = ggn_reference(plain, lossfunc, x, y)
    model, runs, pools = _run(plain, x, y, lossfunc, ext.DiagGGNExact())
    for key, p in trainable(model).items():
        assert_close(p.diag_ggn_exact, per_sample[key].sum(0), key)
    assert not scatters and runs > pools  # the pooling's backward ran for the columns


@pytest.mark.parametrize(
    "pool",
    [
        lambda x: F.max_pool2d(x, 3, stride=2, padding=1),
        lambda x: F.max_pool2d(x, 2, ceil_mode=True, dilation=2),
        lambda x: F.max_pool1d(x.flatten(2), 4, stride=3, padding=2),
        lambda x: F.max_pool3d(x, 2, stride=1, padding=1),
        lambda x: F.max_pool2d(x[0], 3, stride=1),  # unbatched [C, H, W]
    ],
    ids=["overlapping", "ceil+dilation", "1d", "3d", "unbatched"],
)
def test_max_pool_transpose_is_the_pooling_backward(pool):
    """Each of ``k`` columns scattered at the indices equals the pooling's own backward."""
    x = torch.randn(2, 3, 7, 9, dtype=DT, requires_grad=True)
    out = pool(x)
    node = out.grad_fn
    while type(node).__name__ not in torch_internals.MAX_POOL:
        node = node.next_functions[0][0]
    columns = torch.randn(5, *node._input_metadata[0].shape, dtype=DT)
    got = torch_internals.max_pool_transpose(node, columns)
    assert got.shape == (5, *node._saved_self.shape)
    for c, g in zip(columns, got):
        expected = node(c)  # the pooling's own backward, one column
        expected = expected[0] if isinstance(expected, tuple) else expected
        torch.testing.assert_close(g, expected, rtol=0, atol=0)


class SamePadded(nn.Module):
    """DeepOBS 3C3D's 'same' layers: a ``ZeroPad2d`` before a max pooling and before a
    convolution, and a crop (a negative pad) before the head."""

    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(2, 3, 3), nn.Conv2d(3, 2, 3)
        self.pool = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.MaxPool2d(3, stride=2))
        self.same = nn.ZeroPad2d(1)
        self.fc = nn.Linear(2 * 3 * 3, CLASSES)

    def forward(self, x):
        h = self.pool(torch.relu(self.conv1(x)))  # [N, 3, 4, 4]
        h = torch.sigmoid(self.conv2(self.same(h)))  # [N, 2, 4, 4]
        return self.fc(F.pad(h, (0, -1, -1, 0)).flatten(1))  # [N, 2, 3, 3]


def _direct_padded():
    """A convolution's output padded directly (the padding's input is a module output)."""
    return nn.Sequential(
        nn.Conv2d(2, 3, 3),
        nn.ZeroPad2d((0, 1, 0, 1)),
        nn.MaxPool2d(3, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3 * 4 * 4, CLASSES),
    )


class AroundPad(SamePadded):
    """A path around a padding (a padded and cropped copy added to the tensor itself)."""

    def forward(self, x):
        h = torch.relu(self.conv1(x))
        h = h + F.pad(h, (1, 1, 1, 1))[..., 1:-1, 1:-1]
        h = F.max_pool2d(h, 2)  # [N, 3, 4, 4]
        return self.fc(torch.tanh(self.conv2(self.same(h)))[..., 1:, 1:].flatten(1))


def _named_nodes(out, name):
    found, stack, seen = [], [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == name:
            found.append(node)
        stack.extend(fn for fn, _ in node.next_functions)
    return found


def _run_counting_pads(plain, x, lossfunc, y, *extensions):
    """Two passes; ``(model, runs of the paddings' backward in the second pass, paddings)``."""
    model = extended_copy(plain)
    loss = curvopt.extend(lossfunc)
    runs = [0]
    for _ in range(2):
        out = model(x)
        pads, runs[0] = _named_nodes(out, torch_internals.CONSTANT_PAD), 0
        for node in pads:
            node.register_prehook(lambda grads: runs.__setitem__(0, runs[0] + 1))
        with curvopt.collect(*extensions):
            loss(out, y).backward()
    return model, runs[0], len(pads)


@pytest.fixture
def crops(monkeypatch):
    return _column_counts(monkeypatch, "pad_transpose")


def _padded_problem(make):
    torch.manual_seed(0)
    plain = make().to(DT)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N, 2, 10, 10, dtype=DT, generator=gen)
    return plain, x, torch.randint(0, CLASSES, (N,), generator=gen), nn.CrossEntropyLoss()


@pytest.mark.parametrize("make, paddings", [(SamePadded, 3), (_direct_padded, 1)])
def test_columns_cross_constant_padding_at_once_and_exactly(make, paddings, crops, scatters):
    plain, x, y, lossfunc = _padded_problem(make)
    _, per_sample = ggn_reference(plain, lossfunc, x, y)
    expected = kronecker(plain, lossfunc, x, y)
    model, runs, pads = _run_counting_pads(
        plain, x, lossfunc, y, ext.DiagGGNExact(), ext.BatchDiagGGNExact(), ext.KFLR()
    )
    for key, p in trainable(model).items():
        assert_close(p.diag_ggn_exact_batch, per_sample[key], key)
        assert_close(p.diag_ggn_exact, per_sample[key].sum(0), key)
    modules = dict(model.named_modules())
    for key, (b, a) in expected.items():
        assert_close(modules[key].weight.kflr[0], b, f"{key} B")
        assert_close(modules[key].weight.kflr[1], a, f"{key} A")
    assert pads == paddings and runs == pads  # each padding's backward ran once: the loss's
    assert crops and min(crops) > 1 and scatters  # all columns of a chunk at once


def test_a_path_around_a_padding_keeps_the_poolings_staged_and_exact(crops, scatters):
    plain, x, y, lossfunc = _padded_problem(AroundPad)
    _, per_sample = ggn_reference(plain, lossfunc, x, y)
    model, runs, pads = _run_counting_pads(plain, x, lossfunc, y, ext.DiagGGNExact())
    for key, p in trainable(model).items():
        assert_close(p.diag_ggn_exact, per_sample[key].sum(0), key)
    assert not crops and runs > pads  # the paddings' backward ran for the columns
    assert scatters and min(scatters) > 1  # the pooling still crossed by its indices


@pytest.mark.parametrize("pad", [(1, 2), (0, 1, 2, 0), (-1, 1, 0, -2), (1, 1, 1, 1, 1, 0)])
def test_pad_transpose_is_the_padding_backward(pad):
    """Each of ``k`` columns cropped (or, for a negative pad, padded back) equals the padding's
    own backward."""
    x = torch.randn(2, 3, 5, 6, dtype=DT, requires_grad=True)
    node = F.pad(x, pad).grad_fn
    assert type(node).__name__ == torch_internals.CONSTANT_PAD
    columns = torch.randn(4, *F.pad(x, pad).shape, dtype=DT)
    got = torch_internals.pad_transpose(node, columns)
    assert got.shape == (4, *x.shape)
    for c, g in zip(columns, got):
        torch.testing.assert_close(g, node(c), rtol=0, atol=0)
