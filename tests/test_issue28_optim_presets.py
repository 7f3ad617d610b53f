"""The paper's numbers do not move with the library's defaults: the ``paper`` preset and the
paper's reproduction pass ``kl_clip=None`` (the default is 1e-3) and ``curvature_interval=1``
(the default without a damping is 10) explicitly."""

import torch

from experiments.config import RunConfig
from experiments.optimizers import DAMPED, OPTIMIZERS, PRESETS, resolve_options
from experiments.reproduce.plan import BUDGET_HPARAMS, BUDGETS, Plan
from experiments.ttr.protocol import GRIDS


def test_the_paper_preset_turns_the_trust_region_off():
    for name in sorted(DAMPED):
        assert resolve_options(name, "paper", ())["kl_clip"] is None
    assert set(PRESETS["paper"]) == {"DiagGGNNewton", "KFAC", "EKFAC"}


def test_the_reproduction_runs_the_paper_update():
    optimizers = ["momentum", "adam", "diagggn_mc", "kfac"]
    plan = Plan(["fmnist_2c2d"], {"fmnist_2c2d": optimizers}, {"fmnist_2c2d": 1}, False)
    plan.budgets, plan.hparams = BUDGETS, BUDGET_HPARAMS
    configs = plan.configs("fmnist_2c2d", synthetic=True)
    assert [c.optimizer for c in configs] == optimizers
    for cfg in configs:
        options = resolve_options(cfg.optimizer, cfg.preset, cfg.options)
        if cfg.optimizer in DAMPED:
            assert cfg.preset == "paper", cfg
            assert options == {"kl_clip": None, "curvature_interval": 1}, cfg
        else:
            assert cfg.preset is None and options == {}, cfg


def test_the_time_to_result_grids_name_the_paper_update_explicitly():
    """Every curvature setting of the ``ttr`` grids states its trust region (``kl_clip``
    explicitly, or the ``practical`` preset's), so none changes with the default."""
    for problem, grids in GRIDS.items():
        for optimizer, settings in grids.items():
            if optimizer not in DAMPED:
                continue
            for setting in settings:
                options = resolve_options(optimizer, setting.preset, setting.options)
                assert "kl_clip" in options, (problem, setting)


def test_an_unset_run_gets_the_library_default():
    cfg = RunConfig("mnist_logreg", "kfac", 0.1, damping=0.1)
    assert resolve_options(cfg.optimizer, cfg.preset, cfg.options) == {}
    cls = OPTIMIZERS["kfac"][0]
    import curvopt.optim

    opt = getattr(curvopt.optim, cls)([torch.nn.Parameter(torch.zeros(2, 2))], 0.1, 0.1)
    assert opt.defaults["kl_clip"] == 1e-3
