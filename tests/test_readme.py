"""The README's commands and its Optimizers snippet work as written."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch
from torch import nn

import curvopt
from experiments import cli

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def _experiment_commands() -> list[list[str]]:
    commands = []
    for block in _blocks("bash"):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            prefix = r"(?:OMP_NUM_THREADS=\d+ )?(?:nice )?\S*python -m experiments "
            match = re.match(prefix + "(.*)", line)
            if match and "..." not in line:
                commands.append(shlex.split(match.group(1)))
    return commands


def test_readme_lists_every_command():
    names = {c[0] for c in _experiment_commands()}
    assert {"--help", "reproduce", "fetch_data", "run", "grid", "ttr", "overhead"} <= names
    assert {"step_profile", "compare"} <= names


@pytest.mark.parametrize("argv", _experiment_commands(), ids=" ".join)
def test_readme_experiment_commands_parse(argv):
    if argv == ["--help"]:
        with pytest.raises(SystemExit) as stop:
            cli.parse_args(argv)
        assert stop.value.code == 0
        return
    args = cli.parse_args(argv)
    assert callable(args.execute)


def test_readme_optimizer_snippet_zeroes_gradients():
    """Pasted into a loop, the Optimizers snippet takes the same steps as a loop that zeroes
    the gradients by hand (without ``opt.zero_grad()`` they would accumulate)."""
    snippet = next(b for b in _blocks("python") if "curvopt.optim.KFAC(" in b and "for X" in b)
    torch.manual_seed(0)
    make = lambda: curvopt.extend(nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)))
    model, lossfunc = make(), curvopt.extend(nn.CrossEntropyLoss())
    reference = make()
    reference.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(1)
    loader = [(torch.randn(8, 4, generator=gen), torch.randint(0, 2, (8,), generator=gen))]
    loader *= 3
    torch.manual_seed(2)  # KFAC samples targets from the global generator: the same draws
    exec(snippet, {"curvopt": curvopt, "model": model, "lossfunc": lossfunc, "loader": loader})
    opt = curvopt.optim.KFAC(reference.parameters(), lr=0.05, damping=1e-3, kl_clip=1e-3)
    torch.manual_seed(2)
    for X, y in loader:
        for p in reference.parameters():
            p.grad = None
        loss = lossfunc(reference(X), y)
        with opt.collect():
            loss.backward()
        opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
