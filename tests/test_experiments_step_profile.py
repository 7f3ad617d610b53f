"""The per-step profile tells curvature steps from plain ones; the one timed step."""

import pytest
import torch

from experiments.step_profile import _config, main, profile
from experiments.timing import finite_loss, timed_step


def test_practical_preset_has_one_curvature_step_in_ten():
    out = profile(_config("mnist_logreg", "kfac:practical:0.01:0.1"), steps=12)
    assert out["curvature"]["n"] == 1 and out["plain"]["n"] == 10  # steps 1..11, step 10 reads
    assert all(v > 0 for r in out.values() for k, v in r.items() if k.endswith("_ms"))


def test_paper_preset_reads_curvature_every_step_and_adam_never():
    assert set(profile(_config("mnist_logreg", "kfac:paper:0.1:0.1"), steps=3)) == {"curvature"}
    assert set(profile(_config("mnist_logreg", "adam"), steps=3)) == {"plain"}


def test_cli_prints_one_line_per_kind(capsys):
    assert main(["mnist_logreg", "adam", "diagggn_mc:paper", "--steps", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" steps")[0] for line in lines] == [
        "adam plain",
        "diagggn_mc:paper curvature",
    ]


def _linear_step(check=None, raises=None):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if raises is not None:

        def step():
            raise raises("cannot invert")

        opt.step = step
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    ticks = iter(range(100))
    return model, timed_step(
        model,
        torch.nn.CrossEntropyLoss(),
        opt,
        False,
        x,
        y,
        lambda: float(next(ticks)),
        check or finite_loss,
    )


def test_timed_step_times_each_phase_on_the_given_clock():
    model, step = _linear_step()
    assert not step.diverged and step.times == {
        "forward_s": 1.0,
        "check_s": 1.0,
        "backward_s": 1.0,
        "step_s": 1.0,
    }
    assert step.total_s == 4.0 and model.weight.grad is not None


def test_timed_step_stops_before_backward_when_the_check_fails_and_at_a_failed_step():
    model, step = _linear_step(check=lambda loss, logits, y: False)
    assert step.diverged and set(step.times) == {"forward_s", "check_s"}
    assert model.weight.grad is None  # no backward pass
    _, step = _linear_step(raises=torch.linalg.LinAlgError)
    assert step.diverged and set(step.times) == {"forward_s", "check_s", "backward_s"}
    with pytest.raises(RuntimeError):
        _linear_step(raises=RuntimeError)  # not a divergence: raised on
