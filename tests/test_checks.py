"""The one tolerance policy of the checks (``tolerance.mismatch``): its decisions are those of the
textbook formula ``max |a - b| > factor * eps * max(max |a|, max |b|)`` (and, where ``a - b`` is
not finite, a mismatch exactly when the reference ``b`` is finite), written here with full
``abs`` temporaries as an independent reference, on the edge cases where a cheaper formula
could differ (zeros, signed zeros, inf, nan, subnormal and huge values, mixed dtypes, the
``floor`` argument, broadcasting, 0-dim and empty tensors)."""

import contextlib
import itertools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import curvopt
from curvopt import extensions as ext
from curvopt.core.reductions import probe_columns
from curvopt.guards import checks as checks_module
from curvopt.guards.checks import Checks
from curvopt.guards.tolerance import mismatch, mismatches, roundoff, stacked_mismatches
from curvopt.errors import UnsupportedModuleError
from curvopt.layers.linear import LinearRule


def reference(a, b, factor, floor=0.0):
    if not a.numel():
        return False
    eps = max([floor, *(torch.finfo(t.dtype).eps for t in (a, b) if t.is_floating_point())])
    b = b.to(a.dtype)
    difference = (a - b).abs()
    if not bool(difference.isfinite().all()):
        return bool(b.isfinite().all())  # wrong unless the reference itself is not finite
    scale = torch.maximum(a.abs().max(), b.abs().max())
    return bool(difference.max() > factor * eps * scale)


INF, NAN = float("inf"), float("nan")
TINY = torch.finfo(torch.float64).tiny


def _pairs():
    """``(a, b)`` pairs of float64 values where the decision is delicate."""
    with _float64():
        yield from _float64_pairs()


@contextlib.contextmanager
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _float64_pairs():
    base = torch.tensor([1.0, -2.0, 3.0, -0.5])
    rel = 64 * torch.finfo(torch.float64).eps * 3.0  # the threshold of factor 64 at scale 3
    yield base, base.clone()
    yield base, base + torch.tensor([0.0, 0.0, rel * 0.999, 0.0])  # just inside
    yield base, base + torch.tensor([0.0, 0.0, rel * 1.001, 0.0])  # just outside
    yield base, base - torch.tensor([0.0, rel * 1.001, 0.0, 0.0])  # negative side
    yield -base, -base + torch.tensor([0.0, 0.0, 0.0, rel * 1.001])  # largest |x| is a min
    yield -base, -base + torch.tensor([0.0, 0.0, 0.0, rel * 0.999])  # inside only at scale 3
    yield torch.zeros(4), torch.zeros(4)
    yield torch.zeros(4), torch.tensor([0.0, -0.0, 0.0, -0.0])
    yield torch.zeros(4), torch.tensor([0.0, 0.0, 1e-300, 0.0])  # only b nonzero
    yield torch.tensor([TINY / 4, -TINY / 8]), torch.tensor([TINY / 4, TINY / 8])  # subnormal
    yield torch.tensor([1e300, -1e300]), torch.tensor([1e300, -1e300 * (1 + 1e-13)])
    yield torch.tensor([1e300, -1e300]), torch.tensor([-1e300, 1e300])  # a - b overflows
    yield base, torch.tensor([1.0, INF, 3.0, -0.5])
    yield torch.tensor([INF, 1.0]), torch.tensor([INF, 1.0])
    yield torch.tensor([-INF, 1.0]), torch.tensor([INF, 1.0])
    yield base, torch.tensor([1.0, NAN, 3.0, -0.5])
    yield torch.tensor([NAN, 1.0]), torch.tensor([0.0, 1.0])
    yield torch.tensor([NAN, NAN]), torch.tensor([NAN, NAN])
    yield torch.tensor(2.0), torch.tensor(2.0 + 1e-12)  # 0-dim
    yield torch.tensor(2.0), torch.tensor(2.0 + 1e-9)
    yield torch.empty(0), torch.empty(0)
    yield torch.ones(3, 1), torch.ones(1, 4) * (1 + 1e-10)  # broadcasting
    yield torch.randn(50, 7, generator=torch.Generator().manual_seed(0)), torch.zeros(50, 7)


@pytest.mark.parametrize(
    "dtypes",
    list(
        itertools.product([torch.float64, torch.float32, torch.float16, torch.bfloat16], repeat=2)
    ),
)
def test_mismatch_decides_as_the_reference(dtypes):
    """Every pair in every dtype combination, every factor and floor: the same decision (and
    the cases do not all decide alike, so the comparison can fail)."""
    decisions = set()
    for a, b in _pairs():
        a, b = a.to(dtypes[0]), b.to(dtypes[1])
        for factor, floor in itertools.product((0.0, 1.0, 64.0, 256.0), (0.0, 1e-3, 2.0)):
            expected = reference(a, b, factor, floor)
            assert mismatch(a, b, factor, floor) is expected, (a, b, factor, floor)
            decisions.add(expected)
    assert decisions == {True, False}


def test_mismatches_of_many_pairs_decide_each_as_the_reference():
    """All the pairs at once (pairs of every dtype, their values read together, as the spot
    check of materialised per-sample gradients does): each pair's decision is its own
    reference's, in every order of the pairs (a value read into another pair's slot would
    change some decision: checked by swapping the slots)."""
    dtypes = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
    pairs = [
        (a.to(dtypes[k % 4]), b.to(dtypes[(k // 4) % 4]), (0.0, 1e-3)[k % 2])
        for k, (a, b) in enumerate(_pairs())
    ]
    gen = torch.Generator().manual_seed(2)
    for k in range(40):  # just outside the bound, at scales far apart
        a = torch.randn(1 + k % 7, dtype=torch.float64, generator=gen) * 10.0 ** (k % 9 - 4)
        b = a.clone()
        b[0] += 64 * torch.finfo(torch.float64).eps * a.abs().max() * (1.5 if k % 2 else 0.5)
        pairs.append((a, b, 0.0))
    expected = [reference(a, b, 64.0, floor) for a, b, floor in pairs]
    assert any(expected) and not all(expected)
    for _ in range(5):
        order = torch.randperm(len(pairs), generator=gen).tolist()
        found = mismatches([pairs[i] for i in order], 64.0)
        assert found == [expected[i] for i in order]


def test_stacked_mismatches_decide_each_pair_as_the_reference():
    """Pairs stacked by shape and dtype (as the spot check of materialised per-sample gradients
    stacks its parameters), each with its own floor, several stacks read together: each pair's
    decision is its own reference's, wherever it sits in its stack (a value read into another
    pair's slot would change some decision: checked by permuting the pairs in the stacks)."""
    gen = torch.Generator().manual_seed(3)
    by_shape: dict = {}
    for a, b in _pairs():
        by_shape.setdefault((a.shape, a.dtype), []).append((a, b))
    for k in range(24):  # just inside and outside the bound, at scales far apart
        a = torch.randn(4, dtype=torch.float64, generator=gen) * 10.0 ** (k % 9 - 4)
        b = a.clone()
        b[k % 4] += 64 * torch.finfo(torch.float64).eps * a.abs().max() * (1.5 if k % 2 else 0.5)
        by_shape.setdefault((a.shape, a.dtype), []).append((a, b))
    groups = [g for g in by_shape.values() if len(g) > 1]
    assert len(groups) >= 2
    for _ in range(4):
        stacks, expected = [], []
        for group in groups:
            order = torch.randperm(len(group), generator=gen).tolist()
            pairs = [group[i] for i in order]
            floors = [(0.0, 1e-3)[i % 2] for i in order]
            a = torch.stack([x for x, _ in pairs])
            b = torch.stack([y for _, y in pairs])
            stacks.append((a, b, floors))
            expected += [reference(x, y, 64.0, f) for (x, y), f in zip(pairs, floors)]
        assert any(expected) and not all(expected)
        assert stacked_mismatches(stacks, 64.0) == expected


def test_stacks_of_one_pair_decide_as_the_reference():
    """A stack of one pair (a parameter whose shape no other shares) is read whole, as a
    stack of several is: each pair, alone or among stacks of several, in every dtype, decides
    as its reference (and not every pair alike)."""
    dtypes = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    pairs = [(a.to(dtypes[k % 4]), b.to(dtypes[k % 4])) for k, (a, b) in enumerate(_pairs())]
    stacks = [(a[None], b[None], [(0.0, 1e-3)[k % 2]]) for k, (a, b) in enumerate(pairs)]
    expected = [reference(a, b, 64.0, floors[0]) for a, b, floors in stacks]
    assert any(expected) and not all(expected)
    assert stacked_mismatches(stacks, 64.0) == expected
    a = torch.randn(3, 4, dtype=torch.float64, generator=gen)  # among a stack of three
    b = a.clone()
    b[1, 2] += 64 * torch.finfo(torch.float64).eps * a[1].abs().max() * 1.5
    mixed = [stacks[0], (a, b, [0.0, 0.0, 0.0]), *stacks[1:]]
    inner = [reference(x, y, 64.0, 0.0) for x, y in zip(a, b)]
    assert inner == [False, True, False]
    assert stacked_mismatches(mixed, 64.0) == [expected[0], *inner, *expected[1:]]


def test_a_stack_given_as_the_pair_itself_decides_as_the_reference():
    """A stack of one pair may be the pair itself, of any shape (0-dim, empty, broadcasting
    included; ``len(floors) == 1``): each decides as its reference, alone or among stacks of
    several, in every dtype (and not every pair alike)."""
    dtypes = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
    gen = torch.Generator().manual_seed(6)
    pairs = [(a.to(dtypes[k % 4]), b.to(dtypes[k % 4])) for k, (a, b) in enumerate(_pairs())]
    stacks = [(a, b, [(0.0, 1e-3)[k % 2]]) for k, (a, b) in enumerate(pairs)]
    stacks.append((torch.full((2, 3), 1.5), torch.full((2, 3), 1.5), [0.0]))  # two dims
    expected = [reference(a, b, 64.0, floors[0]) for a, b, floors in stacks]
    assert any(expected) and not all(expected)
    assert stacked_mismatches(stacks, 64.0) == expected
    a = torch.randn(3, 2, 2, dtype=torch.float64, generator=gen)  # among a stack of three
    b = a.clone()
    b[2, 1, 0] += 64 * torch.finfo(torch.float64).eps * a[2].abs().max() * 1.5
    mixed = [*stacks[:3], (a, b, [0.0, 1e-3, 0.0]), *stacks[3:]]
    inner = [reference(x, y, 64.0, f) for x, y, f in zip(a, b, [0.0, 1e-3, 0.0])]
    assert inner == [False, False, True]
    assert stacked_mismatches(mixed, 64.0) == [*expected[:3], *inner, *expected[3:]]


class _Operators(TorchDispatchMode):
    """The ATen operators dispatched while it is active (``names``)."""

    def __init__(self):
        super().__init__()
        self.names: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_each_stack_is_read_by_four_operators():
    """The spot check's cost where every sum is right: a stack, of one pair given whole or of
    several, is four operators (its difference, the join, one ``abs_`` and one maximum), and
    all stacks on a device are read by one ``cat`` (the read itself, ``tolist``, dispatches
    none)."""
    gen = torch.Generator().manual_seed(7)
    sums = [torch.randn(shape, generator=gen) for shape in ((10,), (16, 256), (3, 5, 2))]
    stacks = [(a, a.clone(), [0.0] * (3 if a.ndim == 3 else 1)) for a in sums]
    with _Operators() as seen:
        found = stacked_mismatches(stacks, 64.0)
    assert found == [False] * 5
    joins = ["stack", "stack", "cat"]
    assert sorted(seen.names) == sorted(["sub", "abs_", "amax"] * 3 + joins + ["cat"])


def test_probe_columns_reads_spread_runs_of_each_row():
    """``probe_columns`` against the runs cut out by hand (``spans`` runs of ``width`` entries,
    the ``k``-th starting at ``k (M - width) // (spans - 1)`` of the flattened row): rows of
    several dims, a non-contiguous ``x`` (a copy read), a single row without its dim
    (``rows=False``), and a row short enough to be read whole."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, 7, 50, dtype=torch.float64, generator=gen)  # M = 350
    spans, width = 4, 20
    step = (350 - width) // (spans - 1)
    flat = x.reshape(3, -1)
    by_hand = torch.stack([flat[:, k * step : k * step + width] for k in range(spans)], 1)
    assert torch.equal(probe_columns(x, spans, width), by_hand)
    assert probe_columns(x, spans, width).data_ptr() == x.data_ptr()  # a view, no copy
    assert torch.equal(probe_columns(x[0], spans, width, rows=False), by_hand[0])
    turned = x.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, not contiguous
    assert torch.equal(probe_columns(turned, spans, width), by_hand)
    assert torch.equal(probe_columns(turned[1], spans, width, rows=False), by_hand[1])
    assert torch.equal(probe_columns(x, 16, 256), flat[:, None])  # M <= 16 * 256: whole
    assert torch.equal(probe_columns(x[2], 16, 256, rows=False), flat[2][None])


def test_non_finite_sums_of_a_finite_gradient_are_mismatches():
    """NaN or inf in the per-sample sum where ``p.grad`` is finite is never a pass (it was,
    before: ``max`` of a NaN difference compares False); a non-finite ``p.grad`` is not
    verifiable and not reported as a mismatch."""
    grad = torch.tensor([1.0, -2.0, 3.0])
    for bad in (float("nan"), float("inf"), -float("inf")):
        assert mismatch(torch.tensor([1.0, bad, 3.0]), grad, 256.0)
        assert not mismatch(torch.tensor([1.0, bad, 3.0]), torch.tensor([1.0, bad, 3.0]), 256.0)
    assert not mismatch(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, float("nan"), 3.0]), 64.0)
    big = torch.finfo(torch.float32).max
    assert mismatch(torch.tensor([big]), torch.tensor([-big]), 64.0)  # the difference overflows


def test_mismatch_on_random_near_ties():
    """Random differences scattered around the threshold of the cheap sum bound."""
    gen = torch.Generator().manual_seed(1)
    outcomes = []
    for trial in range(300):
        a = torch.randn(int(torch.randint(1, 40, (1,), generator=gen)), generator=gen)
        a = a * 10.0 ** float(torch.randint(-30, 30, (1,), generator=gen))
        dtype = torch.float32 if trial % 2 else torch.float64
        threshold = 64 * torch.finfo(dtype).eps * a.abs().max()
        noise = torch.rand(a.shape, generator=gen) * threshold * (trial % 3)  # up to 2x
        b = (a + noise).to(dtype)
        expected = reference(a, b, 64.0)
        assert mismatch(a, b, 64.0) is expected
        outcomes.append(expected)
    assert any(outcomes) and not all(outcomes)


def test_roundoff():
    half, single = torch.zeros(1, dtype=torch.float16), torch.zeros(1)
    assert roundoff(single, None) == torch.finfo(torch.float32).eps
    assert roundoff(half, single) == torch.finfo(torch.float16).eps
    assert roundoff(torch.zeros(1, dtype=torch.long), floor=0.5) == 0.5
    assert roundoff(single, floor=1e-3) == 1e-3
    assert roundoff() == 0.0


def _rounding_bound_fails(grads, suspects):
    """The rounding bound of ``Checks.check_suspects``, written out with full temporaries."""
    largest = max(float(g.abs().max()) for g in grads if g.numel())
    for total, grad, magnitude in suspects:
        eps = max(torch.finfo(t.dtype).eps for t in (total, grad))
        tol = 8 * eps * (magnitude + grad.abs()) + 1000 * eps * largest
        if bool(((total - grad.to(total.dtype)).abs() > tol).any()):
            return True
    return False


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rounding_bound_decides_as_the_reference(dtype):
    """The second tier of the sum check: sums just inside and just outside the bound, a
    gradient far larger elsewhere in the pass (the ``1000 eps max |grad|`` term), the other
    parameter in another dtype."""
    gen = torch.Generator().manual_seed(2)
    eps = torch.finfo(dtype).eps
    outcomes = []
    for trial in range(60):
        p = torch.nn.Parameter(torch.zeros(7, dtype=dtype))
        other = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64 if trial % 2 else dtype))
        grad = torch.randn(7, generator=gen, dtype=dtype)
        other_grad = torch.randn(3, generator=gen, dtype=other.dtype) * 10.0 ** (trial % 5)
        magnitude = grad.abs() + torch.rand(7, generator=gen, dtype=dtype)
        bound = 8 * eps * (magnitude + grad.abs()) + 1000 * eps * float(
            torch.cat([grad.abs().double(), other_grad.abs().double()]).max()
        )
        total = grad.clone()
        total[trial % 7] += bound[trial % 7] * (0.9 + 0.2 * float(torch.rand(1, generator=gen)))
        checks = Checks()
        checks.param_grads = {id(p): (p, grad), id(other): (other, other_grad)}
        checks.suspects = [(p, total, grad, magnitude)]
        expected = _rounding_bound_fails([grad, other_grad], [(total, grad, magnitude)])
        if expected:
            with pytest.raises(UnsupportedModuleError, match="outside the module"):
                checks.check_suspects()
        else:
            checks.check_suspects()
        outcomes.append(expected)
    assert any(outcomes) and not all(outcomes)


@pytest.mark.parametrize("extension", ["BatchL2Grad", "Variance"])
def test_a_nan_per_sample_gradient_of_a_finite_gradient_raises(extension, monkeypatch):
    """End to end: a rule whose per-sample gradients hold a NaN while ``p.grad`` is finite,
    reduced to norms or moments (where the NaN would hide in a sum), raises in the pass and
    writes nothing (it passed every tier of the check before). Materialised ``grad_batch`` is
    spot-checked on a few entries (reading all of it would cost about a plain pass on 2C2D);
    a NaN there is left where the user sees it."""
    original = LinearRule.batch_grad

    def with_nan(self, call, name, out=None):
        grads = original(self, call, name, out)
        if name == "weight":
            grads[0, 0, 0] = float("nan")
        return grads

    monkeypatch.setattr(LinearRule, "batch_grad", with_nan)
    monkeypatch.setattr(LinearRule, "batch_l2", lambda *args: None)
    monkeypatch.setattr(LinearRule, "sum_grad_squared", lambda *args: None)
    torch.manual_seed(0)
    model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(4, 3)))
    lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())
    loss = lossfunc(model(torch.randn(5, 4)), torch.arange(5) % 3)
    with pytest.raises(UnsupportedModuleError, match="0.weight"):
        with curvopt.collect(getattr(ext, extension)()):
            loss.backward()
    assert torch.isfinite(model[0].weight.grad).all()
    assert not hasattr(model[0].weight, getattr(ext, extension).attr)


@pytest.mark.parametrize("stack_entries", [None, 8 * 24])
def test_spot_check_finds_the_parameters_the_reference_finds(stack_entries, monkeypatch):
    """``Checks.check_materialised`` on parameters of many shapes (a large one read in spread
    runs), per-sample gradients in three dtypes against gradients in their own or another
    dtype, some computed under autocast (a roundoff floor), each sum just inside or just
    outside the cheap bound at one entry it reads: the parameters it notes as suspects are
    those whose read entries the textbook formula (``reference``) finds wrong, with the
    entries it read, each summed as that parameter's own ``sum(0)`` bit for bit; with stacks
    as large as they come or of at most 24 entries (``stack_entries``)."""
    if stack_entries is not None:
        monkeypatch.setattr(checks_module, "_STACK_ELEMENTS", stack_entries)
    gen = torch.Generator().manual_seed(4)
    shapes = [(3,), (4, 5), (2, 3, 2), (), (20, 300), (7,), (5, 4)]
    dtypes = [(torch.float64, torch.float64), (torch.float32, torch.float32)]
    dtypes += [(torch.float32, torch.float64), (torch.float16, torch.float32)]
    checks, batch_grads, expected = Checks(), {}, set()
    for k in range(40):
        shape, (dtype, grad_dtype) = shapes[k % len(shapes)], dtypes[k % len(dtypes)]
        p = torch.nn.Parameter(torch.zeros(shape, dtype=grad_dtype))
        batch = torch.randn(8, *shape, generator=gen).to(dtype) * 10.0 ** (k % 5 - 2)
        sums = batch.sum(0)
        eps = max(torch.finfo(dtype).eps, torch.finfo(grad_dtype).eps)
        floor = torch.finfo(torch.float16).eps if k % 7 == 3 else 0.0
        grad = sums.to(grad_dtype, copy=True)
        read = probe_columns(grad.reshape(1, -1), 16, 256)[0].reshape(-1)
        grad.reshape(-1)[-1 if read.numel() == grad.numel() else 0] += (
            64 * max(eps, floor) * float(read.abs().max()) * (0.5 + (k % 3) / 2)
        )
        checks.param_grads[id(p)] = (p, grad)
        batch_grads[id(p)] = (p, batch)
        if floor:
            checks.compute_eps[id(p)] = floor
        read_sums = probe_columns(sums.reshape(1, -1), 16, 256)[0].reshape(-1)
        read = probe_columns(grad.reshape(1, -1), 16, 256)[0].reshape(-1)
        if reference(read_sums, read.to(read_sums.dtype), 64.0, max(floor, eps)):
            expected.add(id(p))
    assert 5 < len(expected) < 35
    checks.check_materialised(batch_grads)
    assert {id(p) for p, *_ in checks.suspects} == expected
    for p, total, grad, magnitude in checks.suspects:  # the entries read, as read
        batch = probe_columns(batch_grads[id(p)][1].reshape(8, -1), 16, 256).reshape(8, -1)
        assert torch.equal(total.reshape(-1), batch.sum(0))
        assert torch.equal(magnitude.reshape(-1), batch.abs().sum(0))
        read = probe_columns(checks.param_grads[id(p)][1].reshape(1, -1), 16, 256)[0]
        assert torch.equal(grad.reshape(-1), read.reshape(-1))
