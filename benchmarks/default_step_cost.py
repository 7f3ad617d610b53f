"""The step time of the curvature optimizers at their defaults against AdamW's.

    OMP_NUM_THREADS=1 python -m benchmarks.default_step_cost [--rounds 7] [--models gpt]

``KFAC``, ``EKFAC`` and ``DiagGGNNewton`` built as a user builds them, ``cls(params, lr=...)``
(the defaults: curvature every 10 steps, ``EKFAC``'s basis every 30, the damping
``λ = 1e-2 s``, the trust region), and
``torch.optim.AdamW`` on an un-extended copy of the model, on three networks: a small ResNet
with BatchNorm in training mode (``fixtures.zoo.resnet``: two blocks of width 16, 16x16
images, batch 32), a BERT-style encoder (``fixtures.zoo.BERT``: width 64, 4 heads, 32
positions, vocabulary 96, batch 32) and the character GPT of ``experiments.workloads``
(``CharGPT``: 0.43 M parameters, 64 characters, batch 32). A step is ``zero_grad``, forward,
loss, backward, ``step``. The entries run interleaved (``experiments.timing.interleaved``):
blocks of 30 steps (one period of ``EKFAC``'s default basis refresh, three of the default
``curvature_interval``: nine plain steps, then a refresh, three times; ``EKFAC``'s third a
basis refresh) on the same 30 batches, round-robin, the first round not counted; an entry's
cost is the median over rounds of its block's CPU time per step (one thread). Each entry takes one
step before the rounds, so that its refresh is the last step of each of its blocks, and its
first window, in which its collection covers every model, is over: from then on each model's
hooks rest by its own optimizer (``frontend.resting``), as in a run of one. Printed: ms per
step and the ratio to AdamW's (the goal: at most 1.5). ``KFAC plain`` refreshes only at its
first step, before the rounds: every counted step is a plain one (its model carries no hook),
its cost the floor of the defaults'.

``--split`` prints instead where each entry's steps go: the CPU time of the forward (with
``zero_grad`` and the loss), the backward and ``opt.step()`` (``experiments.timing.timed_step``)
of a block's last step (a refresh; ``EKFAC``'s a basis refresh) and of the others (plain
steps: their median, which the block's two other refreshes do not move), medians over the
counted rounds.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import curvopt
from curvopt.optim import EKFAC, KFAC, DiagGGNNewton
from experiments.timing import interleaved, timed_step
from experiments.workloads import CONTEXT, VOCAB, CharGPT
from fixtures import zoo

#: steps of a block: one period of EKFAC's default basis interval (three curvature intervals)
BLOCK = 30
BATCH = 32
LR = {"AdamW": 1e-3, "KFAC": 0.05, "EKFAC": 0.05, "DiagGGNNewton": 0.05, "KFAC plain": 0.05}
CURVOPT = {"KFAC": KFAC, "EKFAC": EKFAC, "DiagGGNNewton": DiagGGNNewton, "KFAC plain": KFAC}
#: ``KFAC plain``: the curvature of the first step (before the rounds) kept for good, so
#: that every counted step is a plain one: the floor of a step that leaves the engine alone
OPTIONS = {"KFAC plain": {"curvature_interval": 10**9}}
COMMAND = "OMP_NUM_THREADS=1 python -m benchmarks.default_step_cost"


class _Encoder(nn.Module):
    """``zoo.BERT``'s logits as ``[N, V, T]``, the form ``CrossEntropyLoss`` takes."""

    def __init__(self):
        super().__init__()
        self.bert = zoo.BERT(vocab=VOCAB, d=64, heads=4, t_max=32)

    def forward(self, idx):
        return self.bert(idx).transpose(1, 2)


def _resnet_batches(generator):
    X = torch.randn(BATCH, 3, 16, 16, generator=generator)
    return X, torch.randint(0, 10, (BATCH,), generator=generator)


def _token_batches(length: int):
    def make(generator):
        ids = torch.randint(1, VOCAB, (BATCH, length + 1), generator=generator)
        return ids[:, :-1], ids[:, 1:]

    return make


#: name -> (model maker, batch maker)
MODELS = {
    "resnet": (lambda: zoo.resnet(width=16, blocks=2, classes=10), _resnet_batches),
    "encoder": (_Encoder, _token_batches(32)),
    "gpt": (CharGPT, _token_batches(CONTEXT)),
}


def setups(model_name: str) -> tuple[dict, list]:
    """``(name -> (model, loss, optimizer), the BLOCK batches)`` of every entry."""
    make_model, make_batch = MODELS[model_name]
    generator = torch.Generator().manual_seed(0)
    batches = [make_batch(generator) for _ in range(BLOCK)]
    torch.manual_seed(0)
    base = make_model()
    made = {}
    for name in ("AdamW", *CURVOPT):
        model = copy.deepcopy(base)
        lossfunc = nn.CrossEntropyLoss()
        if name == "AdamW":
            opt = torch.optim.AdamW(model.parameters(), lr=LR[name])
        else:
            model, lossfunc = curvopt.extend(model), curvopt.extend(lossfunc)
            opt = CURVOPT[name](model.parameters(), lr=LR[name], **OPTIONS.get(name, {}))
        _block(model, lossfunc, opt, batches[:1])(name, 0)  # the refreshes end the blocks
        made[name] = model, lossfunc, opt
    return made, batches


def entries(model_name: str) -> dict:
    """name -> a function running one block of :data:`BLOCK` steps (None: it ran)."""
    made, batches = setups(model_name)
    return {name: _block(*parts, batches) for name, parts in made.items()}


def _block(model, lossfunc, opt, batches):
    def run(name: str, round_: int):
        for X, y in batches:
            opt.zero_grad()
            lossfunc(model(X), y).backward()
            opt.step()
        return None

    return run


def measure(model_name: str, rounds: int) -> dict[str, float]:
    """ms per step of each entry (median of ``rounds`` counted rounds, CPU time)."""
    runs = entries(model_name)
    names = list(runs)
    measured = interleaved(
        names,
        lambda name, r: runs[name](name, r),
        BLOCK,
        rounds,
        1,
        time.perf_counter,
        model_name,
        lambda line: None,
    )
    return {name: 1e3 * measured.median(name, 1) for name in names}


def split(model_name: str, rounds: int) -> dict[str, dict[str, dict[str, float]]]:
    """name -> ``"refresh"`` (a block's last step) / ``"plain"`` (the others) -> phase ->
    ms (CPU time; medians over the counted rounds, of the plain steps' median per round)."""
    made, batches = setups(model_name)
    times: dict = {name: {"refresh": [], "plain": []} for name in made}

    def run(name: str, round_: int):
        model, lossfunc, opt = made[name]
        steps = [
            timed_step(model, lossfunc, opt, False, X, y, time.process_time).times
            for X, y in batches
        ]
        if round_ > 0:  # (the first round is not counted)
            times[name]["refresh"].append(steps[-1])
            times[name]["plain"].append(
                {k: statistics.median(s[k] for s in steps[:-1]) for k in steps[-1]}
            )
        return None

    interleaved(list(made), run, BLOCK, rounds, 1, time.perf_counter, model_name, lambda line: None)
    return {
        name: {
            kind: {k: 1e3 * statistics.median(s[k] for s in samples) for k in PARTS}
            for kind, samples in kinds.items()
        }
        for name, kinds in times.items()
    }


#: the phases :func:`split` prints, ``experiments.timing.timed_step``'s names
PARTS = {"forward_s": "forward", "backward_s": "backward", "step_s": "step"}


def _print_split(model_name: str, rounds: int) -> None:
    for name, kinds in split(model_name, rounds).items():
        row = "; ".join(
            f"{kind} " + ", ".join(f"{PARTS[k]} {ms:.1f}" for k, ms in parts.items())
            + f" (total {sum(parts.values()):.1f})"
            for kind, parts in kinds.items()
        )
        print(f"{model_name} {name}: {row}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument(
        "--split", action="store_true", help="ms of forward, backward and step, refresh / plain"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.split:
        print(f"{COMMAND} --split: ms (CPU time, one thread)")
        for model_name in args.models:
            _print_split(model_name, args.rounds)
        return
    print(f"{COMMAND}: ms per step (CPU time, one thread), x AdamW's")
    for model_name in args.models:
        costs = measure(model_name, args.rounds)
        adamw = costs["AdamW"]
        row = ", ".join(
            f"{name} {ms:.1f} ({ms / adamw:.2f}x)" for name, ms in costs.items() if name != "AdamW"
        )
        print(f"{model_name}: AdamW {adamw:.1f} ms; {row}", flush=True)


if __name__ == "__main__":
    main()
