"""What ``extend``'s hooks cost outside ``collect``, resting, and after ``unextend``.

    OMP_NUM_THREADS=1 python -m benchmarks.unextended_cost [--rounds 15] [--repeats 200]
        [--batch 32] [--width 64] [--depth 3] [--model mlp|encoder|resnet|gpt]

Four copies of one plain model, ``CrossEntropyLoss``: as built, extended (model and loss, no
``collect`` block: the hooks only note each call and drop it when its gradient passes),
resting (extended, with a ``KFAC`` optimizer that refreshed at its one step and refreshes no
more: its collection rests and the model carries no hook, ``frontend.resting``), and extended
then unextended. The model is an MLP (``depth`` hidden ``Linear`` + ``ReLU`` layers of
``width`` units, float32, batch ``batch``), or one of ``benchmarks.default_step_cost``'s
networks (``--model``: the ResNet, the encoder, the GPT, at their batch of 32). Rounds of
``repeats`` passes (forward, loss, backward) of each are interleaved, one thread; each round
gives the mean µs of a pass of each kind (CPU time of the process, ``time.process_time``: on a
shared machine the time the process waits for a core does not count). Prints the median over
the rounds of each kind and its ratio to the plain pass; the resting and the unextended model
should cost what the plain one does (ratio 1 within the noise).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
from torch import nn

import curvopt
from benchmarks.default_step_cost import MODELS
from curvopt.optim import KFAC

COMMAND = "OMP_NUM_THREADS=1 python -m benchmarks.unextended_cost"


def mlp(width: int, depth: int, inputs: int = 32, classes: int = 10) -> nn.Sequential:
    layers, size = [], inputs
    for _ in range(depth):
        layers += [nn.Linear(size, width), nn.ReLU()]
        size = width
    return nn.Sequential(*layers, nn.Linear(size, classes))


def setup(batch: int, width: int, depth: int, model: str = "mlp"):
    """``{kind: one pass}`` for the plain, the extended, the resting and the unextended copy."""
    if model == "mlp":
        torch.manual_seed(0)
        plain = mlp(width, depth)
        x, y = torch.randn(batch, 32), torch.randint(0, 10, (batch,))
    else:
        make_model, make_batch = MODELS[model]
        x, y = make_batch(torch.Generator().manual_seed(0))
        torch.manual_seed(0)
        plain = make_model()
    extended = curvopt.extend(copy.deepcopy(plain))
    extended_loss = curvopt.extend(nn.CrossEntropyLoss())
    resting = curvopt.extend(copy.deepcopy(plain))
    resting_loss = curvopt.extend(nn.CrossEntropyLoss())
    opt = KFAC(resting.parameters(), lr=0.0, curvature_interval=10**9)
    resting_loss(resting(x), y).backward()
    opt.step()  # its one refresh: it rests from now on
    undone = curvopt.unextend(curvopt.extend(copy.deepcopy(plain)))
    undone_loss = curvopt.unextend(curvopt.extend(nn.CrossEntropyLoss()))

    def one(model, lossfunc):
        def run():
            model.zero_grad(set_to_none=True)
            lossfunc(model(x), y).backward()

        return run

    passes = {
        "plain": one(plain, nn.CrossEntropyLoss()),
        "extended": one(extended, extended_loss),
        "resting": one(resting, resting_loss),
        "unextended": one(undone, undone_loss),
    }
    passes["resting"].optimizer = opt  # alive as long as its passes: the model stays resting
    return passes


def measure(passes, rounds: int, repeats: int):
    """``{kind: [mean µs per pass of each round]}``, the kinds interleaved in every round."""
    for run in passes.values():  # warm-up
        for _ in range(10):
            run()
    times = {kind: [] for kind in passes}
    for _ in range(rounds):
        for kind, run in passes.items():
            start = time.process_time()
            for _ in range(repeats):
                run()
            times[kind].append((time.process_time() - start) / repeats * 1e6)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--model", choices=["mlp", *MODELS], default="mlp")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    passes = setup(args.batch, args.width, args.depth, args.model)
    times = measure(passes, args.rounds, args.repeats)
    plain = statistics.median(times["plain"])
    what = (
        f"an MLP ({args.depth} x {args.width}, batch {args.batch}, float32)"
        if args.model == "mlp"
        else f"the {args.model} of benchmarks.default_step_cost"
    )
    print(
        f"# forward + backward of {what}, one thread, {args.rounds} rounds x {args.repeats} "
        "passes, interleaved"
    )
    print(f"{'model':<12}{'median µs':>12}{'ratio to plain':>16}{'rounds min..max µs':>22}")
    for kind, values in times.items():
        median = statistics.median(values)
        spread = f"{min(values):.1f}..{max(values):.1f}"
        print(f"{kind:<12}{median:>12.1f}{median / plain:>16.3f}{spread:>22}")


if __name__ == "__main__":
    main()
