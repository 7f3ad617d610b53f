"""The comparison protocol: train briefly, and at each checkpoint measure every curvature
approximation against the exact GGN on blocks of each parameter (the protocol as
``python -m experiments compare --help`` tells it: :mod:`experiments.compare.cli`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

import curvopt
from curvopt import linalg
from curvopt.errors import CurvoptError

from fixtures import zoo

from ..data import load_dataset, make_splits
from ..problems import get_problem
from .metrics import (
    block_metrics,
    eigen_block,
    exact_blocks,
    kron_block,
    reference,
    select,
)

PROBLEMS = ("mnist_logreg", "fmnist_2c2d", "gpt")
DIAGONALS = {"diag_ggn_exact": "ggn_exact", "diag_ggn_mc": "ggn_mc", "diag_hessian": "hessian"}
KRONECKER = ("kfac", "kflr", "kfra")
EIGEN_CORRECTED = {"ekfac": "kfac"}  # name: the factors giving the basis
APPROXIMATIONS = (*DIAGONALS, *KRONECKER, *EIGEN_CORRECTED, "empirical_fisher")
#: default coordinates per block (0: whole parameters; minutes per checkpoint for MNIST logreg)
MAX_BLOCK = {"mnist_logreg": 2048, "fmnist_2c2d": 1024, "gpt": 0}
LR = {"mnist_logreg": 0.1, "fmnist_2c2d": 0.02, "gpt": 0.05}


class Rows(nn.Module):
    """``model(x)`` with all leading dims flattened into loss rows: ``[N, T, V] -> [N T, V]``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).flatten(0, -2)


@dataclass
class Setup:
    """What a comparison runs on. ``model`` is trained; its output dim 0 is the sample. With
    ``rows`` the loss sees outputs and targets flattened into rows (language models)."""

    model: nn.Module
    train: list[tuple[torch.Tensor, torch.Tensor]]
    curvature: tuple[torch.Tensor, torch.Tensor]
    batch_size: int
    synthetic: bool
    rows: bool = False

    def loss_on(self, lossfunc: nn.Module) -> Callable:
        """``(output, targets) -> loss`` as the problem computes it."""
        if self.rows:
            return lambda out, y: lossfunc(out.flatten(0, -2), y.reshape(-1))
        return lossfunc

    def batches(self, x, y, drop_last: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
        size = self.batch_size
        stop = len(y) - size + 1 if drop_last else len(y)
        return [(x[i : i + size], y[i : i + size]) for i in range(0, stop, size)]


def _image_setup(args) -> Setup:
    problem = get_problem(args.problem)
    data = load_dataset(problem.dataset, args.data_root, synthetic=args.synthetic)
    splits = make_splits(data, train_size=args.train_size)
    x, y = problem.preprocess(augment=False)(splits.train.x), splits.train.y
    setup = Setup(
        problem.model(args.seed), [], (x, y), args.batch_size or problem.batch_size, data.synthetic
    )
    setup.train = setup.batches(x, y)
    setup.curvature = (x[: args.curvature_size], y[: args.curvature_size])
    return setup


def _gpt_setup(args) -> Setup:
    problem = zoo.gpt(vocab=16, T=8, dtype=torch.float32)
    x, y = problem.make_batch(args.train_size, args.seed)
    setup = Setup(problem.model, [], (x, y), args.batch_size or 32, True, rows=True)
    setup.train = setup.batches(x, y)
    setup.curvature = (x[: args.curvature_size], y[: args.curvature_size])
    return setup


def _tied(model: nn.Module) -> list[nn.Parameter]:
    """Trainable parameters registered under several names (tied weights)."""
    seen, tied = set(), []
    for _, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen and p.requires_grad and all(p is not q for q in tied):
            tied.append(p)
        seen.add(id(p))
    return tied


@contextlib.contextmanager
def _frozen(params: list[nn.Parameter]):
    for p in params:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(True)


def _approximation(build: Callable, model: nn.Module):
    """``(operator or None, error message or None)``. Where the engine refuses a model with tied
    weights, the operator is built for the other parameters (tied ones frozen) and the message
    says why the tied ones have none."""
    try:
        return build(), None
    except CurvoptError as err:
        message = f"{type(err).__name__}: {err}"
        tied = _tied(model)
        if not tied:
            return None, message
    try:
        with _frozen(tied):
            return build(), message
    except CurvoptError as err:
        return None, f"{type(err).__name__}: {err}"


def _approximations(model, lossfunc, data, seed: int) -> dict:
    """``{name: (Diagonal | KFAC | None, error message | None)}`` on the curvature data."""
    builds = {
        name: functools.partial(linalg.Diagonal, curvature=curvature)
        for name, curvature in DIAGONALS.items()
    }
    builds.update({name: functools.partial(linalg.KFAC, curvature=name) for name in KRONECKER})
    builds.update(
        {name: functools.partial(linalg.EKFAC, curvature=c) for name, c in EIGEN_CORRECTED.items()}
    )
    return {
        name: _approximation(lambda build=build: build(model, lossfunc, data, seed=seed), model)
        for name, build in builds.items()
    }


def _block(op, param: torch.Tensor, sel) -> torch.Tensor | None:
    """The ``S``-block of ``op`` for parameter ``param`` (None if ``op`` does not cover it)."""
    index = next((i for i, p in enumerate(op.params) if p is param), None)
    if index is None:
        return None
    if isinstance(op, linalg.Diagonal):
        offset = sum(p.numel() for p in op.params[:index])
        return torch.diag(op.diagonal[offset : offset + param.numel()][sel.flat])
    if isinstance(op, linalg.EKFAC):
        return eigen_block(op.bases[index], op.corrections[index], sel)
    return kron_block(op.factors[index], sel)


def checkpoint(setup: Setup, plain: nn.Module, selections, args) -> dict:
    """All metrics at the current parameters of ``setup.model``; ``plain`` is an unextended
    copy of it, used as the skeleton of the per-sample Jacobians."""
    x, y = setup.curvature
    model = curvopt.extend(Rows(setup.model) if setup.rows else setup.model)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    flatten = (lambda t: t.reshape(-1)) if setup.rows else (lambda t: t)
    data = [(inputs, flatten(targets)) for inputs, targets in setup.batches(x, y, False)]
    started = time.perf_counter()
    plain.load_state_dict(setup.model.state_dict())
    loss_on = setup.loss_on(nn.CrossEntropyLoss())
    exact = exact_blocks(plain, loss_on, x, y, selections, mean=True)
    approx = _approximations(model, lossfunc, data, args.seed)
    params = [p for p in setup.model.parameters() if p.requires_grad]
    layers = []
    for sel, p in zip(selections, params):
        ggn, ef, gradient = exact[sel.name]
        k = max(1, min(args.top_k, sel.size // 2))
        ref = reference(ggn, gradient, args.damping, k)
        results = {"empirical_fisher": block_metrics(ref, ef)}
        for name, (op, error) in approx.items():
            block = None if op is None else _block(op, p, sel)
            results[name] = {"error": error} if block is None else block_metrics(ref, block)
        results = {name: results[name] for name in APPROXIMATIONS}
        layers.append(
            {
                "name": sel.name,
                "shape": list(sel.shape),
                "block": [len(sel.rows), len(sel.cols)],
                "full": sel.size == p.numel(),
                "top_k": k,
                "exact_top_eigenvalues": [float(v) for v in ref.values],
                "exact_decrease": ref.decrease,
                "approximations": results,
            }
        )
    with torch.no_grad():
        loss = float(loss_on(plain(x), y))
    return {"loss": loss, "seconds": time.perf_counter() - started, "layers": layers}


def run_compare(args) -> dict:
    setup = _gpt_setup(args) if args.problem == "gpt" else _image_setup(args)
    plain = copy.deepcopy(setup.model)
    max_block = MAX_BLOCK[args.problem] if args.max_block is None else args.max_block
    gen = torch.Generator().manual_seed(args.seed)
    selections = [
        select(n, tuple(p.shape), max_block, gen)
        for n, p in setup.model.named_parameters()
        if p.requires_grad
    ]
    lr = LR[args.problem] if args.lr is None else args.lr
    opt = torch.optim.SGD(setup.model.parameters(), lr=lr, momentum=0.9)
    loss_on = setup.loss_on(nn.CrossEntropyLoss())
    checkpoints = sorted(set(args.checkpoints))
    results = []
    torch.manual_seed(args.seed)
    for epoch in range(max(checkpoints) + 1):
        if epoch > 0:
            for inputs, targets in setup.train:
                opt.zero_grad()
                loss_on(setup.model(inputs), targets).backward()
                opt.step()
        if epoch in checkpoints:
            results.append({"epoch": epoch, **checkpoint(setup, plain, selections, args)})
            if args.progress:
                last = results[-1]
                print(f"epoch {epoch}: loss {last['loss']:.4f} ({last['seconds']:.1f}s)")
    return {
        "kind": "compare",
        "problem": args.problem,
        "synthetic": setup.synthetic,
        "config": {
            "seed": args.seed,
            "lr": lr,
            "momentum": 0.9,
            "batch_size": setup.batch_size,
            "train_size": sum(len(t) for _, t in setup.train),
            "curvature_size": len(setup.curvature[1]),
            "max_block": max_block,
            "damping": args.damping,
            "top_k": args.top_k,
        },
        "checkpoints": results,
    }


def result_path(results_dir: str | Path, problem: str, synthetic: bool) -> Path:
    return Path(results_dir) / "compare" / f"{problem}{'_synthetic' if synthetic else ''}.json"


def table(result: dict, metric: str = "rel_frobenius") -> str:
    """Markdown table of ``metric`` at the last checkpoint: approximations x layers."""
    last = result["checkpoints"][-1]
    names = [layer["name"] for layer in last["layers"]]
    lines = [
        f"| {metric} (epoch {last['epoch']}) | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for approx in APPROXIMATIONS:
        cells = []
        for layer in last["layers"]:
            value = layer["approximations"][approx].get(metric)
            cells.append("n/a" if value is None else f"{value:.3g}")
        lines.append(f"| {approx} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
