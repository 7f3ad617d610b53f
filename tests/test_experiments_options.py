"""Optimizer options and presets: reachable from RunConfig and the CLI, validated, named."""

import pytest

from experiments.__main__ import parse_args
from experiments.config import RunConfig
from experiments.optimizers import (
    PRESETS,
    allowed_options,
    make_optimizer,
    parse_options,
    resolve_options,
)
from experiments.problems import get_problem


def _built(cfg):
    problem = get_problem(cfg.problem)
    model, loss = problem.model(0), problem.loss()
    opt, _ = make_optimizer(cfg, problem, model, loss)
    return opt


def test_every_constructor_option_of_kfac_is_reachable():
    assert set(allowed_options("kfac")) >= {
        "kronecker_damping",
        "inverse_interval",
        "mc_samples",
        "momentum",
        "curvature_ema",
        "curvature_interval",
        "kl_clip",
        "fallback",
    }
    assert "lr" not in allowed_options("kfac") and "curvature" not in allowed_options("kfac")
    assert set(allowed_options("adam")) >= {"betas", "eps"}


def test_presets_reach_the_optimizer_and_explicit_options_win():
    practical = RunConfig(
        "mnist_logreg", "kfac", 0.01, damping=0.1, preset="practical", options=(("momentum", 0.5),)
    )
    group = _built(practical).param_groups[0]
    expected = {**PRESETS["practical"]["KFAC"], "momentum": 0.5}
    assert {k: group[k] for k in expected} == expected
    assert group["inverse_interval"] == 10 and group["curvature_interval"] == 10
    paper = _built(RunConfig("mnist_logreg", "kfac", 0.1, damping=0.1, preset="paper"))
    assert paper.param_groups[0]["momentum"] == 0.0
    assert paper.param_groups[0]["curvature_interval"] == 1
    sgd = _built(RunConfig("mnist_logreg", "momentum", 0.1, options=(("nesterov", True),)))
    assert sgd.param_groups[0]["nesterov"] is True and sgd.param_groups[0]["momentum"] == 0.9


def test_bad_options_and_presets_raise_naming_the_fix():
    with pytest.raises(ValueError, match="kfac has no option 'momentm'; it takes .*momentum"):
        RunConfig("mnist_logreg", "kfac", 0.1, damping=0.1, options=(("momentm", 0.9),))
    with pytest.raises(ValueError, match="preset 'practical' is for the curvature optimizers"):
        RunConfig("mnist_logreg", "adam", 0.1, preset="practical")
    with pytest.raises(ValueError, match="unknown preset 'fast'"):
        RunConfig("mnist_logreg", "kfac", 0.1, damping=0.1, preset="fast")
    with pytest.raises(ValueError, match="not KEY=VALUE"):
        parse_options(["momentum"])


def test_option_values_are_parsed_and_sorted():
    assert parse_options(
        [
            "kl_clip=none",
            "momentum=0.9",
            "curvature_interval=10",
            "kronecker_damping=exact",
            "nesterov=true",
        ]
    ) == (
        ("curvature_interval", 10),
        ("kl_clip", None),
        ("kronecker_damping", "exact"),
        ("momentum", 0.9),
        ("nesterov", True),
    )


def test_names_tell_presets_and_options_apart_and_plain_runs_keep_their_names():
    plain = RunConfig("mnist_logreg", "kfac", 0.1, damping=0.1)
    paper = RunConfig("mnist_logreg", "kfac", 0.1, damping=0.1, preset="paper")
    practical = RunConfig("mnist_logreg", "kfac", 0.1, damping=0.1, preset="practical")
    tuned = RunConfig("mnist_logreg", "kfac", 0.1, damping=0.1, options=(("momentum", 0.9),))
    assert len({plain.name, paper.name, practical.name, tuned.name}) == 4
    assert practical.name.startswith("mnist_logreg_kfac_practical_lr0.1_damp0.1_seed0_")
    assert plain.name.startswith("mnist_logreg_kfac_lr0.1_damp0.1_seed0_")
    assert resolve_options("kfac", None, ()) == {}


def test_cli_passes_preset_and_options():
    args = parse_args(
        [
            "run",
            "mnist_logreg",
            "kfac",
            "--lr",
            "0.1",
            "--damping",
            "0.1",
            "--preset",
            "practical",
            "--opt",
            "kl_clip=0.01",
            "--opt",
            "curvature_interval=5",
        ]
    )
    assert args.preset == "practical"
    assert parse_options(args.options) == (("curvature_interval", 5), ("kl_clip", 0.01))
