"""A resumed run with Monte-Carlo curvature continues the uninterrupted trajectory.

The sampled targets of ``DiagGGNMC`` / ``KFAC`` draw from torch's global generator, so the
optimizer's ``state_dict`` alone does not make a resumed run the same run: the experiments'
checkpoints save and restore the global RNG state too. Without that restore the resumed
run differs (checked, so the test can fail).
"""

import pytest
import torch

from experiments import training
from experiments.config import RunConfig
from test_experiments_runner import TINY, _run, data_root  # noqa: F401 (fixture)

KEYS = ("train_loss", "valid_acc", "test_loss", "minibatch_loss")


def _interrupted(cfg, results, root, monkeypatch, restore_rng=True):
    """``cfg`` stopped in epoch 2 (after the checkpoint of epoch 1) and resumed, with the
    global RNG of the process moved on in between, as a new process's would be."""
    original_eval = training.TrainingRun.eval_entry

    def crash_in_epoch_2(self, epoch, stats):
        if epoch == 2:
            raise KeyboardInterrupt
        return original_eval(self, epoch, stats)

    with monkeypatch.context() as patch:
        patch.setattr(training.TrainingRun, "eval_entry", crash_in_epoch_2)
        with pytest.raises(KeyboardInterrupt):
            _run(cfg, results, root)
    torch.manual_seed(12345)
    with monkeypatch.context() as patch:
        if not restore_rng:
            patch.setattr(training.torch, "set_rng_state", lambda state: None)
        return _run(cfg, results, root)


def _curves(result):
    return [[entry[k] for k in KEYS if k in entry] for entry in result["history"]]


@pytest.mark.parametrize("optimizer, damping", [("diagggn_mc", 0.01), ("kfac", 0.01)])
def test_a_resumed_monte_carlo_run_equals_the_uninterrupted_one(
    tmp_path,
    data_root,  # noqa: F811 (the fixture)
    monkeypatch,
    optimizer,
    damping,
):
    cfg = RunConfig("mnist_logreg", optimizer, 0.1, damping=damping, **{**TINY, "epochs": 3})
    reference = _run(cfg, tmp_path / "straight", data_root)
    resumed = _interrupted(cfg, tmp_path / "resumed", data_root, monkeypatch)
    assert resumed["resumed_at_epochs"] == [1]
    assert _curves(resumed) == _curves(reference)
    unrestored = _interrupted(cfg, tmp_path / "unrestored", data_root, monkeypatch, False)
    assert _curves(unrestored)[2:] != _curves(reference)[2:], "the RNG state did not matter"
