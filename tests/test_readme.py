"""The README's code runs as written and does what its prose claims."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import curvopt
from experiments import cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
EXPERIMENTS = (ROOT / "docs" / "experiments.md").read_text()


def _blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _block(marker: str) -> str:
    (block,) = [b for b in _blocks("python") if marker in b]
    return block


def _experiment_commands(text: str) -> list[list[str]]:
    commands = []
    for block in _blocks("bash", text):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            prefix = r"(?:OMP_NUM_THREADS=\d+ )?(?:nice )?\S*python -m experiments "
            match = re.match(prefix + "(.*)", line)
            if match and "..." not in line:
                commands.append(shlex.split(match.group(1)))
    return commands


ALL_COMMANDS = _experiment_commands(README) + _experiment_commands(EXPERIMENTS)


def test_docs_list_every_command():
    names = {c[0] for c in ALL_COMMANDS}
    assert {"--help", "reproduce", "fetch_data", "run", "grid", "ttr", "overhead"} <= names
    assert {"step_profile", "compare"} <= names


@pytest.mark.parametrize("argv", ALL_COMMANDS, ids=" ".join)
def test_experiment_commands_parse(argv):
    if argv == ["--help"]:
        with pytest.raises(SystemExit) as stop:
            cli.parse_args(argv)
        assert stop.value.code == 0
        return
    args = cli.parse_args(argv)
    assert callable(args.execute)


def test_readme_lists_the_cli_problems_optimizers_and_presets():
    """The README's and the experiments page's lists are the CLI's choices."""
    from experiments.optimizers import OPTIMIZERS, PRESETS
    from experiments.problems import PROBLEMS

    for name in PROBLEMS:
        assert f"`{name}`" in README, name
    for text in (EXPERIMENTS,):
        for name in [*PROBLEMS, *OPTIMIZERS, *PRESETS]:
            assert f"`{name}`" in text, name


def test_make_commands_are_the_makefile_targets():
    makefile = (ROOT / "Makefile").read_text()
    for target in re.findall(r"^make (\w+)", "\n".join(_blocks("bash")), re.M):
        assert re.search(rf"^{target}:", makefile, re.M), target


def test_first_use_comes_early():
    """Per-sample gradients within the first 60 lines, the optimizer swap within 100."""
    lines = README.splitlines()
    first = lambda pattern: next(i for i, line in enumerate(lines) if re.search(pattern, line))
    assert first(r"ext\.BatchGrad\(\)") < 60
    assert first(r"curvopt\.optim\.KFAC\(") < 100
    assert len(lines) <= 260


def _run_per_sample_block(reduction: str) -> dict:
    code = _block("ext.BatchL2Grad()")
    if reduction == "sum":
        assert 'nn.CrossEntropyLoss()' in code
        code = code.replace("nn.CrossEntropyLoss()", 'nn.CrossEntropyLoss(reduction="sum")')
    scope: dict = {}
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        exec(compile(code, "README", "exec"), scope)  # noqa: S102
    finally:
        torch.set_default_dtype(default)
    return scope


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_per_sample_norms_recipe_gives_the_true_norms(reduction):
    """``norms`` and ``grads`` equal the per-sample gradients of ``torch.func.vmap(grad)`` of
    each sample's own loss, in float64, for both reductions."""
    scope = _run_per_sample_block(reduction)
    model, X, y = scope["model"], scope["X"], scope["y"]
    assert X.dtype == torch.float64
    params = {k: v.detach() for k, v in model.named_parameters()}

    def sample_loss(params, x, t):
        out = functional_call(model, params, (x[None],))
        return nn.functional.cross_entropy(out, t[None])

    per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, X, y)
    want = sum(g.flatten(1).pow(2).sum(1) for g in per_sample.values()).sqrt()
    torch.testing.assert_close(scope["norms"], want, rtol=1e-10, atol=1e-12)
    for got, g in zip(scope["grads"], per_sample.values()):
        torch.testing.assert_close(got, g, rtol=1e-10, atol=1e-12)
    # the prose: rows of grad_batch sum to p.grad
    for p in model.parameters():
        torch.testing.assert_close(p.grad_batch.sum(0), p.grad)


def test_curvature_block_runs_and_its_claims_hold():
    """Shapes as commented; ``linalg.Diagonal`` is the diagonal of ``linalg.GGN``; the
    collected diagonal is the first layer's part of it; KFLR is an approximation (error > 0)."""
    scope = _run_per_sample_block("mean")
    exec(compile(_block("linalg.GGN("), "README", "exec"), scope)  # noqa: S102
    W, G, D, K = scope["W"], scope["G"], scope["D"], scope["K"]
    assert scope["diag"].shape == W.shape == (16, 10)
    assert scope["B"].shape == (16, 16) and scope["A"].shape == (10, 10)
    P = G.shape[0]
    assert P == sum(p.numel() for p in scope["model"].parameters())
    dense = G @ np.eye(P)
    np.testing.assert_allclose(D @ np.ones(P), np.diag(dense), rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(
        np.diag(dense)[: W.numel()], scope["diag"].flatten().numpy(), rtol=1e-8, atol=1e-12
    )
    block = (K @ np.eye(P))[: W.numel(), : W.numel()]
    np.testing.assert_allclose(block, torch.kron(scope["B"], scope["A"]).numpy(), rtol=1e-8)
    assert 0 < scope["error"] < 1


def test_optimizer_swap_takes_the_steps_of_an_explicit_loop():
    """Pasted into a loop, the optimizer swap takes the same steps as a loop that collects
    explicitly with the default trust region."""
    snippet = _block("curvopt.optim.KFAC(model.parameters(), lr=0.05, damping=1e-3)")
    assert "for X, y in loader" in snippet
    torch.manual_seed(0)
    make = lambda: nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    model, lossfunc = make(), curvopt.extend(nn.CrossEntropyLoss())
    reference = curvopt.extend(make())
    reference.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(1)
    loader = [(torch.randn(8, 4, generator=gen), torch.randint(0, 2, (8,), generator=gen))]
    loader *= 3
    scope = {"curvopt": curvopt, "model": model, "lossfunc": lossfunc, "loader": loader}
    torch.manual_seed(2)  # KFAC samples targets from the global generator: the same draws
    exec(snippet, scope)  # noqa: S102
    opt = curvopt.optim.KFAC(
        reference.parameters(), lr=0.05, damping=1e-3, kl_clip=1e-3, collection="explicit"
    )
    torch.manual_seed(2)
    for X, y in loader:
        opt.zero_grad()
        loss = lossfunc(reference(X), y)
        with opt.collect():
            loss.backward()
        opt.step()
    torch.manual_seed(0)
    start = make()
    for p, q, p0 in zip(scope["model"].parameters(), reference.parameters(), start.parameters()):
        torch.testing.assert_close(p, q)
        assert not torch.equal(p, p0)  # the loop took steps


def test_readme_python_blocks_are_all_run_somewhere():
    """Every python block of the README is run by this file or by the tests named here."""
    owners = {
        "ext.BatchL2Grad()": "test_readme.py",
        "linalg.GGN(": "test_readme.py",
        "curvopt.optim.KFAC(model.parameters(), lr=0.05, damping=1e-3)  ": "test_readme.py",
        "# Lightning": "test_frameworks_lightning.py",
        "# the Hugging Face Trainer": "test_frameworks_hf.py",
        "# accelerate": "test_frameworks_accelerate.py",
        "GPT2LMHeadModel": "test_hf_models.py",
    }
    for block in _blocks("python"):
        owner = [name for marker, name in owners.items() if marker in block]
        assert owner, block[:80]
        assert (ROOT / "tests" / owner[0]).exists()
