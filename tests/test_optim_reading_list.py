"""The optimizer side of a KFAC step reads few files (issue 31), and leaving the identity
stages out of a group's chain changes no bit of any step.

Measured as ``benchmarks.call_trace --files`` measures it (``sys.settrace`` over one
``optim.KFAC(lr=0.1, damping=1e-2)`` step on a two-layer MLP, after two warm-up steps): the
files of ``curvopt/optim/`` and ``curvopt/inversion/`` (the damping-and-inversion layer the
optimizers share) with a line run. The stages that are the identity under the
defaults (weight decay, momentum, curvature EMA) are not run, nor the code of options the
step does not use (loss scaling without a ``GradScaler``, the exact and eigenbasis dampings,
the transforms of the stages left out); turning an option on brings its stage back. Where such
code shares a module with code the step runs (the exact damping in ``inversion/kronecker.py``, the
eigenbasis form of the trace-norm damping in ``inversion/trace_norm.py``), none of its lines run.
"""

import inspect
import pathlib

import pytest
import torch
from test_stage_recipe import _train

from benchmarks import call_trace
from curvopt.inversion import kronecker, trace_norm
from curvopt.optim import EKFAC, KFAC, DiagGGNNewton, stages

#: the files of ``curvopt/optim/`` and ``curvopt/inversion/`` a default KFAC step runs: base
#: (collecting included), newton, kfac, plan, gradient_factors; of ``inversion/``: damping, the
#: damped inverse (kronecker: the block; trace_norm: its damping; factor_inverse: one factor);
#: the chain's stages/base and its three stages (precondition, trust region, learning rate).
#: Was 21; 13 since issue 31 (then with collecting apart from base, and the trace-norm damping
#: split over kronecker and factor_inverse).
MAX_OPTIM_FILES = 13

#: files the default step must not enter: stages that are the identity, options not in use
NOT_ON_THE_DEFAULT_PATH = {
    "optim/stages/weight_decay.py",
    "optim/stages/momentum.py",
    "optim/stages/curvature_ema.py",
    "optim/transforms.py",
    "optim/loss_scale.py",
    "inversion/inverses.py",
    "optim/fallback.py",
    "optim/stages/schedule_free.py",
}

#: functions the default step must not run, in files it runs: the exact damping and the
#: eigenbasis form of the trace-norm damping
NOT_RUN_BY_THE_DEFAULT_STEP = (
    kronecker.kron_eigh,
    kronecker.exact_damped_solve,
    trace_norm.trace_norm_eigh,
    trace_norm._root_eigh,
    trace_norm.eigh_solvers,
)


def _lines(function) -> tuple[str, set[int]]:
    """The file of ``function`` (as ``files_of_a_step`` names it) and the lines of its body."""
    path = pathlib.Path(inspect.getsourcefile(function)).relative_to(call_trace.PACKAGE)
    source, first = inspect.getsourcelines(function)
    return path.as_posix(), set(range(first + 1, first + len(source)))


def test_a_default_kfac_step_reads_at_most_13_optim_files():
    found = call_trace.files_of_a_step()
    assert "optim/kfac.py" in found and "optim/stages/precondition.py" in found  # traced
    files = call_trace.optim_files(found)
    assert len(files) <= MAX_OPTIM_FILES, files
    assert not NOT_ON_THE_DEFAULT_PATH & set(files), sorted(NOT_ON_THE_DEFAULT_PATH & set(files))
    for function in NOT_RUN_BY_THE_DEFAULT_STEP:
        path, body = _lines(function)
        assert path in found, path  # the file is on the path: the check says something
        assert not body & found[path], (function.__name__, sorted(body & found[path]))


@pytest.mark.parametrize(
    "damping, functions",
    [
        ("exact", NOT_RUN_BY_THE_DEFAULT_STEP[:2]),
        ("trace_norm_eigh", NOT_RUN_BY_THE_DEFAULT_STEP[2:]),
    ],
)
def test_the_dampings_left_out_run_when_chosen(damping, functions):
    """The check above can fail: with ``kronecker_damping`` chosen, its functions run."""
    found = call_trace.files_of_a_step(kronecker_damping=damping)
    for function in functions:
        path, body = _lines(function)
        assert body & found.get(path, set()), function.__name__


def test_an_option_that_changes_the_step_brings_its_stage_back():
    found = call_trace.files_of_a_step(
        weight_decay=1e-3, momentum=0.9, curvature_ema=0.5, kl_clip=None
    )
    files = set(call_trace.optim_files(found))
    on = {"optim/stages/weight_decay.py", "optim/stages/momentum.py"}
    assert on | {"optim/stages/curvature_ema.py"} <= files
    assert "optim/stages/trust_region.py" not in files  # kl_clip=None: no trust region


class Always(stages.Stage):
    """``stage`` run in every group, whatever its options (no ``identity_at``)."""

    def __init__(self, stage):
        self.stage, self.order = stage, stage.order

    def __call__(self, step):
        self.stage(step)


#: the full chain: every stage of ``NEWTON`` in every group
FULL = stages.Chain(tuple(Always(s) for s in stages.NEWTON))

MAKERS = {
    "KFAC": lambda p, **kw: KFAC(p, 0.2, 0.1, **kw),
    "KFAC-exact": lambda p, **kw: KFAC(p, 0.2, 0.1, "kflr", kronecker_damping="exact", **kw),
    "DiagGGNNewton": lambda p, **kw: DiagGGNNewton(p, 0.2, 0.1, "exact", **kw),
    "EKFAC": lambda p, **kw: EKFAC(p, 0.2, 0.1, **kw),
}


@pytest.mark.parametrize("name", sorted(MAKERS))
@pytest.mark.parametrize("curvature_interval", [1, 2])
def test_the_stages_left_out_are_exactly_the_identity(name, curvature_interval):
    """With weight_decay=0, momentum=0 and curvature_ema=0 the pruned chain (three stages) and
    the full one (six, the identities run) give the same parameters and state, bit for bit."""
    options = {"curvature_interval": curvature_interval}
    if name == "EKFAC":  # its basis is refreshed at curvature steps
        options["basis_interval"] = curvature_interval
    make = MAKERS[name]
    pruned, pruned_opt = _train(lambda groups: make(groups, **options), halve=False, steps=4)
    full, full_opt = _train(lambda groups: make(groups, stages=FULL, **options), False, 4)
    assert all(torch.equal(a, b) for a, b in zip(pruned, full))
    for p, q in zip(pruned_opt.state.values(), full_opt.state.values()):
        assert p.keys() == q.keys()
        if "curvature" in p:
            c, d = p["curvature"], q["curvature"]
            c, d = ([c], [d]) if isinstance(c, torch.Tensor) else (c, d)
            assert all(torch.equal(x, y) for x, y in zip(c, d))


def test_a_group_chain_is_chosen_from_its_options():
    group = {"weight_decay": 0.0, "curvature_ema": 0, "kl_clip": None, "momentum": 0.0}
    group.update(schedule_free=None, orthogonalize=False)
    names = [type(s).__name__ for s in stages.NEWTON.for_group(group)]
    assert names == ["Precondition", "ScaleByLearningRate"]
    group = {"weight_decay": 1e-4, "curvature_ema": 0.9, "kl_clip": 1e-3, "momentum": 0.5}
    group.update(schedule_free=0.9, orthogonalize=True)
    assert stages.NEWTON.for_group(group) == tuple(stages.NEWTON)
