"""The projected sum check (Freivalds): rules that compute ``sum_n g_n`` from per-row factors
(``LayerRule.projected_sum``) are verified through random probes ``uᵀ (sum_n g_n) v`` against
``uᵀ p.grad v``.

* the projected sums and their rounding magnitudes, in float64 against brute force (per-sample
  gradients by ``torch.func``, per-row factors by explicit unfolding), for every rule that has
  one, with positions (rows != samples), groups, strides, padding modes, padding tokens;
* end to end, wrong factors (one sample's input row scaled, two samples' output gradients
  swapped in that factor only, one position dropped) raise for ``BatchL2Grad``,
  ``SumGradSquared``, ``Variance`` and a curvature pass's sums, with the full ``grad_sum``
  forbidden so that only the projected check can catch them;
* the quantities stay those of per-sample references (``Variance``'s mean is the checked
  gradient), a correct float32 pass on a wide layer passes, the user's random stream is
  untouched, and the stated miss probability of one probe holds.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DT, Conv1D, check_against_loop
from torch import nn
from torch.func import functional_call, grad

import curvopt
import curvopt.engine.probes
from curvopt import extensions as ext
from curvopt.guards.checks import Checks
from curvopt.engine.probes import PROBES, Probes, draw_probes
from curvopt.errors import UnsupportedModuleError
from curvopt.layers import rule_for
from curvopt.layers.linear import LinearRule
from curvopt.core.calls import Call
from curvopt.core.passgrad import held
from curvopt.core.records import Record


@pytest.fixture(autouse=True)
def always_projected(monkeypatch):
    """The small layers here are checked through probes too (by cost, in full)."""
    monkeypatch.setattr(curvopt.engine.probes, "projection_pays", lambda p: True)


# ------------------------------------------------------------------ the rules, against brute force


def _linear_rows(module, x, g):
    """Per-row factors ``(b [R, rows of W], a [R, cols of W])``."""
    x, g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    return (x, g) if isinstance(module, Conv1D) else (g, x)


def _embedding_rows(module, x, g):
    g = g.reshape(-1, g.shape[-1]).clone()
    idx = x.reshape(-1)
    if module.padding_idx is not None:
        g[idx == module.padding_idx] = 0
    return F.one_hot(idx, module.num_embeddings).to(g.dtype), g


def _conv2d_rows(module, x, g):
    """Rows per (sample, location, group): ``b`` the group's output gradients padded into the
    weight's rows, ``a`` the group's patch; the groups' rows are disjoint blocks."""
    if module.padding_mode != "zeros":
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode)
        padding = 0
    else:
        padding = module.padding
    patches = F.unfold(x, module.kernel_size, module.dilation, padding, module.stride)
    n, groups, out = x.shape[0], module.groups, module.out_channels
    patches = patches.reshape(n, groups, -1, patches.shape[-1])  # [N, G, C/G k, L]
    gg = g.reshape(n, groups, out // groups, -1)  # [N, G, O/G, L]
    b, a = [], []
    for gr in range(groups):
        rows = torch.zeros(n, out, gg.shape[-1], dtype=g.dtype)
        rows[:, gr * (out // groups) : (gr + 1) * (out // groups)] = gg[:, gr]
        b.append(rows.transpose(1, 2).reshape(-1, out))
        a.append(patches[:, gr].transpose(1, 2).reshape(-1, patches.shape[2]))
    return torch.cat(b), torch.cat(a)


RULES = {
    "linear-positions": (lambda: nn.Linear(6, 4), (3, 6), _linear_rows),
    "conv1d-transposed-linear": (lambda: Conv1D(5, 6), (2, 6), _linear_rows),
    "embedding-padding": (lambda: nn.Embedding(9, 4, padding_idx=0), None, _embedding_rows),
    "conv2d": (lambda: nn.Conv2d(3, 4, 3, padding=1), (3, 5, 5), _conv2d_rows),
    "conv2d-groups-stride-reflect": (
        lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2, padding_mode="reflect"),
        (4, 6, 6),
        _conv2d_rows,
    ),
    "conv2d-dilation-circular": (
        lambda: nn.Conv2d(2, 3, 2, dilation=2, padding=1, padding_mode="circular"),
        (2, 5, 4),
        _conv2d_rows,
    ),
    "conv1d": (lambda: nn.Conv1d(3, 4, 3, stride=2, groups=1), (3, 9), None),
    "conv3d-groups": (lambda: nn.Conv3d(4, 2, 2, groups=2, padding=1), (4, 3, 3, 3), None),
}


def _call(case, n=3):
    make, shape, _ = RULES[case]
    module = make().to(DT)
    if shape is None:
        x = torch.randint(0, module.num_embeddings, (n, 5))
        x[0, :2] = 0  # padding tokens
    else:
        x = torch.randn(n, *shape, dtype=DT)
    g = torch.randn_like(module(x))
    return module, x, g


@pytest.mark.parametrize("case", sorted(RULES))
def test_projected_sum_is_the_projected_weight_gradient(case, seed):
    """``projected_sum`` == ``u_kᵀ (sum_n g_n) v_k`` with ``sum_n g_n`` by ``torch.func``
    (``grad`` of ``<module(x), g>``), and its magnitude == ``sum_r |b_r| |a_r|`` from explicit
    per-row factors (and at least ``sum_n |g_n|`` from per-sample gradients)."""
    module, x, g = _call(case)
    weight = module.weight
    params = {"weight": weight.detach()}

    def inner(params, x):
        return (functional_call(module, params, (x,)) * g).sum()

    expected_sum = grad(inner)(params, x)["weight"]

    def one(params, xi, gi):
        return (functional_call(module, params, (xi,)) * gi).sum()

    per_sample = torch.stack(
        [grad(one)(params, x[i : i + 1], g[i : i + 1])["weight"] for i in range(x.shape[0])]
    )
    assert torch.allclose(per_sample.sum(0), expected_sum)
    u, v = draw_probes(weight, torch.Generator().manual_seed(0))
    assert u.shape == (weight.shape[0], PROBES) and v.shape == (weight[0].numel(), PROBES)
    projected, magnitude = rule_for(module).projected_sum(Call(module, (x,), {}, g), "weight", u, v)
    reference = torch.stack(
        [u[:, k] @ expected_sum.reshape(u.shape[0], -1) @ v[:, k] for k in range(PROBES)]
    )
    torch.testing.assert_close(projected, reference, rtol=1e-10, atol=1e-12)
    rows = RULES[case][2]
    if rows is not None:
        b, a = rows(module, x, g)
        assert torch.allclose(b.T @ a, expected_sum.reshape(b.shape[1], -1))  # the factors
        exact = (b.norm(dim=1) * a.norm(dim=1)).sum()
        torch.testing.assert_close(magnitude, exact, rtol=1e-10, atol=0)
    lower = per_sample.flatten(1).norm(dim=1).sum()  # |g_n| <= sum_{r in n} |b_r| |a_r|
    assert float(magnitude) >= float(lower) * (1 - 1e-12) > 0
    if getattr(module, "bias", None) is not None:  # a bias's sum costs O(R O): checked in full
        assert rule_for(module).projected_sum(Call(module, (x,), {}, g), "bias", u, v) is None


def test_probes_are_gaussian_and_leave_the_users_stream_alone():
    """Standard normal probes from the pass's own generator (seeded by its autograd task):
    fresh per parameter and per pass, the same for all calls of one parameter in a pass."""
    p, q = torch.zeros(300, 200, dtype=DT), torch.zeros(300, 200, dtype=DT)
    state = torch.get_rng_state()
    probes, later = Probes(task=7), Probes(task=8)
    u1, v1 = probes.of(p)
    assert probes.of(p)[0] is u1  # one draw per parameter and pass
    u2, _ = probes.of(q)
    u3, _ = later.of(p)
    assert torch.equal(torch.get_rng_state(), state)
    assert not torch.equal(u1, u2) and not torch.equal(u1, u3)
    assert torch.equal(Probes(task=7).of(p)[0], u1)  # a pass's probes are its task's
    both = torch.cat([u1.flatten(), v1.flatten()])
    assert abs(float(both.mean())) < 0.1 and abs(float(both.std()) - 1) < 0.05


def test_one_probe_misses_with_at_most_the_stated_probability():
    """``P(|uᵀ E v| <= tol) <= (2/pi)(2 + ln r) / r`` for ``r = sigma_max(E) / tol``: rank one
    (the least spread) and a full-rank error, estimated from 40000 probe pairs each."""
    gen = torch.Generator().manual_seed(1)
    rank_one = torch.outer(torch.randn(30, generator=gen), torch.randn(20, generator=gen))
    full = torch.randn(30, 20, generator=gen)
    for error in (rank_one, full):
        sigma = float(torch.linalg.matrix_norm(error, 2))
        u = torch.randn(40000, 30, generator=gen)
        v = torch.randn(40000, 20, generator=gen)
        value = torch.einsum("ki,ij,kj->k", u, error, v).abs()
        for r in (10.0, 100.0):
            missed = float((value <= sigma / r).double().mean())
            bound = 2 / math.pi * (2 + math.log(r)) / r
            assert missed <= bound, (r, missed, bound)


# ------------------------------------------------------------------ wrong factors are caught


def _mutating(module, mutate):
    """``Record.call`` that hands the rules wrong factors for ``module``'s calls."""
    original = Record.call

    def call(self, grad_out=None):
        result = original(self, grad_out)
        if self.module is module and grad_out is not None:  # the first-order calls
            x, g = mutate(result.input.clone(), result.grad_out.clone())
            result = Call(result.module, (x, *result.args[1:]), result.kwargs, g, result.batch_dim)
        return result

    return call


def _scale_row(x, g):
    x[1] *= 1.5
    return x, g


def _swap_grad_rows(x, g):
    g[[0, 2]] = g[[2, 0]]
    return x, g


def _drop_position(x, g):
    if x.dim() == 3:
        x[1, 2] = 0  # the third position of sample 1
    else:
        x[1, :, 2] = 0  # the third row of sample 1's image
    return x, g


def _sequence_model():
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT), (4, 3, 6)


def _conv_model():
    """A convolution whose ghost norms are cheap (``L (a + b) < a b``: a fast ``batch_l2``)."""
    net = nn.Sequential(nn.Conv2d(8, 9, 3), nn.ReLU(), nn.Flatten(), nn.Linear(9 * 4, 3))
    return net.to(DT), (4, 8, 4, 4)


def _sequence_loss(out, y):
    return F.cross_entropy(out.reshape(-1, 3), y.reshape(-1))


@pytest.mark.parametrize("mutate", [_scale_row, _swap_grad_rows, _drop_position])
@pytest.mark.parametrize(
    "extension", [ext.BatchL2Grad, ext.SumGradSquared, ext.Variance, ext.DiagGGNExact]
)
@pytest.mark.parametrize("model", ["sequence", "conv"])
def test_wrong_factors_are_caught_by_the_projected_check(model, extension, mutate, monkeypatch):
    """Only the projected check runs for the first weight (its full ``grad_sum`` raises if
    called); each wrong factor raises naming the weight, and nothing is written; the right
    factors then pass."""
    torch.manual_seed(0)
    net, shape = _sequence_model() if model == "sequence" else _conv_model()
    if model == "conv" and extension is ext.SumGradSquared:
        pytest.skip("convolutions have no sum_grad_squared: formed in chunks, checked in full")
    net = curvopt.extend(net)
    x = torch.randn(*shape, dtype=DT)
    if model == "sequence":
        y, lossfunc = torch.randint(0, 3, (4, 3)), _sequence_loss
        if extension is ext.DiagGGNExact:  # curvature: an extended loss on the rows
            loss_module = curvopt.extend(nn.CrossEntropyLoss())
            lossfunc = lambda out, y: loss_module(out.reshape(-1, 3), y.reshape(-1))  # noqa
    else:
        y, lossfunc = torch.randint(0, 3, (4,)), curvopt.extend(nn.CrossEntropyLoss())
    rule = type(rule_for(net[0]))
    full = rule.grad_sum

    def no_full_sum(self, call, name):
        assert name != "weight" or call.module is not net[0], "the full sum was computed"
        return full(self, call, name)

    monkeypatch.setattr(rule, "grad_sum", no_full_sum)
    with monkeypatch.context() as wrong:  # first: a curvature pass checks the first of its graph
        wrong.setattr(Record, "call", _mutating(net[0], mutate))
        loss = lossfunc(net(x), y)
        with pytest.raises(UnsupportedModuleError, match="0.weight"):
            with curvopt.collect(extension()):
                loss.backward()
    assert not hasattr(net[0].weight, extension.attr)
    net.zero_grad()
    with curvopt.collect(extension()):  # right factors pass
        lossfunc(net(x), y).backward()
    assert hasattr(net[0].weight, extension.attr)


def test_a_small_wrong_term_in_float32_is_caught_and_a_right_pass_is_not(monkeypatch):
    """float32, a wide layer with positions (1024 rows, 256 x 512): a correct pass passes the
    projected check (its rounding bound is not too tight), one sample's input row scaled by
    ``1 + 5e-2`` (one of 64 samples) raises (not too loose)."""
    torch.manual_seed(0)
    net = curvopt.extend(nn.Sequential(nn.Linear(512, 256), nn.Tanh(), nn.Linear(256, 10)))
    x, y = torch.randn(64, 16, 512), torch.randint(0, 10, (64, 16))

    def loss():
        return F.cross_entropy(net(x).reshape(-1, 10), y.reshape(-1))

    for _ in range(3):  # three draws of the probes
        with curvopt.collect(ext.BatchL2Grad()):
            loss().backward()

    def scale(x, g):
        x[5] *= 1 + 5e-2
        return x, g

    monkeypatch.setattr(Record, "call", _mutating(net[0], scale))
    with pytest.raises(UnsupportedModuleError, match="0.weight"):
        with curvopt.collect(ext.BatchL2Grad()):
            loss().backward()


# ------------------------------------------------------------------ the quantities


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("model", ["sequence", "conv", "embedding"])
def test_reduced_quantities_match_the_per_sample_reference(model, reduction, seed):
    """``batch_l2``, ``sum_grad_squared``, ``variance`` (its mean from the checked gradient)
    against per-sample parameter copies, float64, both reductions."""
    if model == "sequence":
        net, shape = _sequence_model()
        x = torch.randn(*shape, dtype=DT)
        y = torch.randint(0, 3, (4, 3))

        def lossfunc(out, y):
            return F.cross_entropy(out.reshape(-1, 3), y.reshape(-1), reduction=reduction)

        check_against_loop(
            net, lossfunc, x, y, attr_sets=[("batch_l2", "sum_grad_squared", "variance")]
        )
        return
    if model == "conv":
        net, shape = _conv_model()
        x = torch.randn(*shape, dtype=DT)
    else:
        net = nn.Sequential(nn.Embedding(7, 4, padding_idx=0), nn.Flatten(), Conv1D(3, 12)).to(DT)
        x = torch.randint(0, 7, (5, 3))
    y = torch.randint(0, 3, (x.shape[0],))
    check_against_loop(
        net,
        nn.CrossEntropyLoss(reduction=reduction),
        x,
        y,
        attr_sets=[("batch_l2", "variance"), ("variance",)],
    )


@pytest.mark.parametrize("wrong", [False, True])
def test_a_parameter_with_projected_and_full_sums(wrong, seed):
    """One weight used by two calls (a curvature pass's sums), one rule projecting, the other
    giving its full sum: both are checked together through the probes, the full one projected
    (its magnitude from its per-sample norms); a gradient off by ``1e-6`` in one entry raises."""
    linear = nn.Linear(7, 5, bias=False).to(DT)
    rule = rule_for(linear)
    calls = [Call(linear, (torch.randn(4, 3, 7, dtype=DT),), {}, None) for _ in range(2)]
    for call in calls:
        call.grad_out = torch.randn(4, 3, 5, dtype=DT)
    p = linear.weight
    grad = sum(rule.grad_sum(call, "weight") for call in calls).clone()
    if wrong:
        grad[2, 3] += 1e-6 * float(grad.abs().max())
    checks = Checks()
    checks.seen.add(id(p))
    probes = Probes().of(p)
    projected = rule.projected_sum(calls[0], "weight", *probes)
    checks.add_projected(p, (rule, calls[0], "weight"), probes, *projected)
    checks.add_total(p, (rule, calls[1], "weight"), rule.grad_sum(calls[1], "weight"))
    checks.parameter_grad(p, grad, held(p, grad))
    checks.check_seen()
    if wrong:
        with pytest.raises(UnsupportedModuleError, match="outside the module"):
            checks.check_suspects()
    else:
        checks.check_suspects()


def test_the_cheaper_check_is_chosen(monkeypatch):
    """By cost: a wide weight (512 x 256) is checked through probes, a narrow one (3 x 256)
    by its full sum."""
    monkeypatch.undo()
    net = curvopt.extend(nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 3)))
    used = []
    full = LinearRule.grad_sum

    def spy(self, call, name):
        used.append((call.module, name))
        return full(self, call, name)

    monkeypatch.setattr(LinearRule, "grad_sum", spy)
    with curvopt.collect(ext.BatchL2Grad()):
        F.cross_entropy(net(torch.randn(8, 256)), torch.randint(0, 3, (8,))).backward()
    assert (net[0], "weight") not in used and (net[2], "weight") in used


@pytest.mark.parametrize("mutate", [_scale_row, _swap_grad_rows])
def test_ekfac_sums_are_checked_as_a_curvature_passs(mutate, monkeypatch):
    """``EKFAC``'s per-sample gradients feed only its ``S``: its sums are checked on a graph
    structure's first pass (a wrong factor raises there, naming the weight, and writes
    nothing), and not on the next passes of that structure, where ``S`` is what it was and the
    flow check (every pass) still raises on a term from outside the extended loss. With a
    first-order quantity beside it, the sums are checked on every pass."""
    torch.manual_seed(0)
    net, shape = _sequence_model()
    net = curvopt.extend(net)
    x, y = torch.randn(*shape, dtype=DT), torch.randint(0, 3, (4, 3))
    loss_module = curvopt.extend(nn.CrossEntropyLoss())

    def lossfunc(out, y):
        return loss_module(out.reshape(-1, 3), y.reshape(-1))

    sums = []  # the names of the sums handed to the checks
    observe = Checks.total
    monkeypatch.setattr(
        Checks, "total", lambda self, p, use, *a: sums.append(use[2]) or observe(self, p, use, *a)
    )

    def run(*extensions, penalty=0.0):
        sums.clear()
        net.zero_grad()
        for p in net.parameters():
            for attr in ("ekfac", "batch_l2"):
                if hasattr(p, attr):
                    delattr(p, attr)
        out = net(x)
        torch.manual_seed(1)  # (the Monte-Carlo columns of the bases' factors)
        with curvopt.collect(*extensions):
            (lossfunc(out, y) + penalty * out.square().sum()).backward()
        return [[t.clone() for t in p.ekfac] for p in net.parameters()]

    with monkeypatch.context() as wrong:
        wrong.setattr(Record, "call", _mutating(net[0], mutate))
        with pytest.raises(UnsupportedModuleError, match="0.weight"):
            run(ext.EKFAC())
    assert not hasattr(net[0].weight, "ekfac")
    first = run(ext.EKFAC())
    assert sorted(sums) == ["bias", "bias", "weight", "weight"]  # the structure's first
    again = run(ext.EKFAC())  # (pass that succeeded)
    assert sums == []  # not again
    for before, after in zip(first, again):
        for a, b in zip(before, after):
            assert torch.equal(a, b)
    with pytest.raises(UnsupportedModuleError, match="extended loss\\(es\\) alone"):
        run(ext.EKFAC(), penalty=0.1)
    assert not hasattr(net[0].weight, "ekfac")
    for _ in range(2):
        run(ext.EKFAC(), ext.BatchL2Grad())
        assert sorted(sums) == ["bias", "bias", "weight", "weight"]  # first order: every pass


@pytest.mark.parametrize("grad_entry", [0.0, 1e-6, float("inf"), float("nan")])
@pytest.mark.parametrize("sum_entry", [0.0, float("nan")])
def test_a_projected_sum_is_noted_as_the_reference_decides(grad_entry, sum_entry):
    """``Checks`` on one projected call: a sum noted as wrong exactly where the reference
    decides so, from the same projections: ``uᵀ grad v`` not all finite (nothing to verify
    against) passes; else the gap to the projected sum must be within ``64 eps M`` (a NaN gap
    is not)."""
    torch.manual_seed(0)
    linear = nn.Linear(7, 5, bias=False).to(DT)
    rule = rule_for(linear)
    call = Call(linear, (torch.randn(4, 3, 7, dtype=DT),), {}, None)
    call.grad_out = torch.randn(4, 3, 5, dtype=DT)
    p = linear.weight
    grad = rule.grad_sum(call, "weight").clone()
    grad[2, 3] += grad_entry * float(grad.abs().max())
    probes = Probes().of(p)
    projected, magnitude = rule.projected_sum(call, "weight", *probes)
    projected = projected.clone()
    projected[0] += sum_entry
    checks = Checks()
    checks.add_projected(p, (rule, call, "weight"), probes, projected, magnitude)
    checks.parameter_grad(p, grad, held(p, grad))
    seen = ((grad @ probes[1]) * probes[0]).sum(0)
    bound = magnitude * 64 * torch.finfo(DT).eps
    expected = bool(seen.isfinite().all()) and not bool(((projected - seen).abs() <= bound).all())
    assert bool(checks.projected_suspects) == expected
    assert expected == (math.isfinite(grad_entry) and (grad_entry > 0 or sum_entry != 0))
