"""The cost of a plain ``KFAC`` step against its floor, and the amortised step against AdamW's.

    OMP_NUM_THREADS=1 python -m benchmarks.plain_step_cost [--rounds 7] [--batch 32]
        [--problems fmnist_2c2d fmnist_vit fortunes_gpt mnist_autoencoder]

On the four time-to-result workloads' models (``experiments.problems.get_problem``: FMNIST 2C2D,
the ViT, the character GPT, the autoencoder; their own losses, random inputs of a small batch),
in one interleaved run (``experiments.timing.interleaved``: blocks of 10 steps on the same 10
batches, round-robin, the first round not counted; the median over rounds of a block's CPU time
per step, one thread). A step is ``zero_grad``, forward, loss, backward and the update:

* ``floor``: the un-extended model, the preconditioner's own products done by hand with the
  inverses a ``KFAC`` step holds (``B⁻¹ G A⁻¹`` per layer: dense products, or the Woodbury
  forms of low-rank factors; ``g / (c + λ)`` for the parameters without factors), then the
  plain SGD update ``θ ← θ − lr d`` (``torch._foreach_add_``);
* ``floor+check``: the floor with the finite check a step keeps (the norms of the gradients,
  the parameters and the steps, one host read);
* ``plain``: ``KFAC`` on the extended model with the paper's update on its cached inverses
  (``kl_clip=None``: the floor's update) on plain steps only (``curvature_interval`` 10⁹: the
  curvature of the uncounted first step kept for good);
* ``plain+clip``: the same with the default trust region (``kl_clip=1e-3``);
* ``amortised``: ``KFAC(params, lr)`` at its defaults (a refresh every 10 steps: one per block,
  its last);
* ``adamw``: ``torch.optim.AdamW`` on the un-extended model.

Printed per workload: ms per step and the ratios ``plain / floor`` (the goal: at most 1.05),
``plain / adamw`` and ``amortised / adamw`` (the goal: at most 1.15).

``--step-only``: ``opt.step()`` alone on fixed gradients, the Python and kernels of a plain step
without the forward and backward (also on the ResNet and the encoder of
``benchmarks.default_step_cost``: ``--problems resnet encoder``): ``KFAC`` and ``EKFAC`` at their
defaults on plain steps (the curvature of a first step kept), and ``torch.optim.AdamW``, on the
same gradients, interleaved in blocks of 10 steps (ms per step, medians of the rounds, CPU time).

``--compile``: the batched application of one bucket (stack the gradients, ``B⁻¹ @ G @ A⁻¹``,
unstack), eager against ``torch.compile``, on the buckets of the workloads' shapes (CPU time
per call, 200 calls after 5 warm-up calls; the first call's compilation apart).
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import curvopt
from curvopt.inversion.factor_inverse import LowRankInverse
from benchmarks import default_step_cost
from curvopt.optim import EKFAC, KFAC
from experiments.problems import get_problem
from experiments.timing import interleaved

COMMAND = "OMP_NUM_THREADS=1 python -m benchmarks.plain_step_cost"
PROBLEMS = ("fmnist_2c2d", "fmnist_vit", "fortunes_gpt", "mnist_autoencoder")
BLOCK = 10
LR = 1e-5
#: the KFAC entries' options (the curvature of the first, uncounted step kept for good: plain)
PLAIN = {"curvature_interval": 10**9}
KFAC_ENTRIES = {
    "plain": {**PLAIN, "kl_clip": None},
    "plain+clip": PLAIN,
    "amortised": {},
}


def _batches(problem, batch: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` random batches of the workload's input shape and a target its loss takes."""
    generator = torch.Generator().manual_seed(0)
    shape = problem.input_shape
    out = []
    for _ in range(count):
        if problem.name == "fortunes_gpt":
            ids = torch.randint(1, 96, (batch, shape[0] + 1), generator=generator)
            out.append((ids[:, :-1], ids[:, 1:]))
        elif problem.name == "mnist_autoencoder":
            X = torch.rand(batch, *shape, generator=generator)
            out.append((X, X.flatten(1)))
        else:
            X = torch.randn(batch, *shape, generator=generator)
            out.append((X, torch.randint(0, 10, (batch,), generator=generator)))
    return out


def _apply(solvers, matrix: torch.Tensor) -> torch.Tensor:
    """``B⁻¹ G A⁻¹`` (``B⁻¹ G`` for a bias) from dense inverses or Woodbury forms, by hand."""
    left, *right = solvers
    out = left.solve_left(matrix) if isinstance(left, LowRankInverse) else left @ matrix
    if right:
        out = right[0].solve_right(out) if isinstance(right[0], LowRankInverse) else out @ right[0]
    return out


class Floor:
    """fwd + bwd of the plain model, the preconditioner's products by hand, an SGD update; the
    inverses are those ``source`` (a KFAC optimizer after its first step) holds."""

    def __init__(self, model, source: KFAC, source_params, check: bool = False):
        self.params, self.check = list(model.parameters()), check
        self.solve = []
        group, group_state = source.param_groups[0], source._group_state[0]
        strategy, _ = source._damping(group, group_state)  # the default: λ = α s
        damping = strategy.of(group_state["reduction_scale"])
        for param in source_params:
            state = source.state[param]
            if "inverse" in state:
                solvers = state["inverse"]["value"]
                left = solvers[0]
                rows = left.shape[0] if torch.is_tensor(left) else left.basis.shape[-1]
                self.solve.append(("kron", solvers, rows))
            else:
                self.solve.append(("diag", state["fallback_diagonal"] + damping, None))

    @torch.no_grad()
    def step(self) -> None:
        directions = []
        for param, (kind, value, rows) in zip(self.params, self.solve):
            grad = param.grad
            if kind == "diag":
                directions.append(grad / value)
            else:
                directions.append(_apply(value, grad.reshape(rows, -1)).reshape(grad.shape))
        if self.check:
            grads = [p.grad for p in self.params]
            norms = [torch._foreach_norm(t) for t in (grads, self.params, directions)]
            assert bool(torch.stack([n for part in norms for n in part]).isfinite().all())
        torch._foreach_add_(self.params, directions, alpha=-LR)


def entries(name: str, batch: int) -> dict:
    """entry name -> a function running one block of :data:`BLOCK` steps."""
    problem = get_problem(name)
    batches = _batches(problem, batch, BLOCK)
    base = problem.model(0)
    runs = {}
    for entry, options in KFAC_ENTRIES.items():
        model, loss = curvopt.extend(copy.deepcopy(base)), curvopt.extend(problem.loss())
        opt = KFAC(model.parameters(), lr=LR, **options)
        runs[entry] = _block(model, loss, opt.zero_grad, opt.step, batches)
    # the refreshing steps out of the rounds: the plain ones refresh at their first step only
    # (the plain entry's first block: the floor's inverses are those it holds); after one step
    # of its own, the amortised entry refreshes at the last step of each of its blocks. Each
    # collection's first window (which covers every model) is over before the rounds; then each
    # model's hooks rest by its own optimizer (``frontend.resting``)
    runs["plain"]()
    runs["plain+clip"]()
    runs["amortised"].one_step()
    for entry, check in (("floor", False), ("floor+check", True)):
        floor_model = copy.deepcopy(base)
        sources = list(runs["plain"].model.parameters())
        floor = Floor(floor_model, runs["plain"].opt, sources, check)
        runs[entry] = _block(
            floor_model, problem.loss(), floor_model.zero_grad, floor.step, batches
        )
    adam_model = copy.deepcopy(base)
    adamw = torch.optim.AdamW(adam_model.parameters(), lr=LR)
    runs["adamw"] = _block(adam_model, problem.loss(), adamw.zero_grad, adamw.step, batches)
    order = ("floor", "floor+check", "plain", "plain+clip", "amortised", "adamw")
    return {k: runs[k] for k in order}


class _block:
    """One block: ``BLOCK`` steps of ``zero_grad``, forward, loss, backward, ``step``."""

    def __init__(self, model, loss, zero_grad, step, batches):
        self.model, self.loss, self.zero_grad, self.step = model, loss, zero_grad, step
        self.opt = getattr(step, "__self__", None)
        self.batches = batches

    def __call__(self, *_):
        for X, y in self.batches:
            self.one_step(X, y)
        return None

    def one_step(self, X=None, y=None):
        """One step (on the first batch by default)."""
        if X is None:
            X, y = self.batches[0]
        self.zero_grad()
        self.loss(self.model(X), y).backward()
        self.step()


def measure(name: str, batch: int, rounds: int) -> dict[str, float]:
    """ms per step of each entry (median of ``rounds`` counted rounds, CPU time)."""
    runs = entries(name, batch)
    names = list(runs)
    measured = interleaved(
        names, lambda n, r: runs[n](), BLOCK, rounds, 1, time.perf_counter, name, lambda _: None
    )
    return {n: 1e3 * measured.median(n, 1) for n in names}


#: ``--step-only``: the optimizers whose plain ``opt.step()`` is timed
STEP_ONLY = {"KFAC": KFAC, "EKFAC": EKFAC}


def step_only(name: str, batch: int, rounds: int) -> dict[str, float]:
    """ms of ``opt.step()`` alone per optimizer of :data:`STEP_ONLY` (plain steps at the
    defaults, on the gradients of one batch) and AdamW's on the same gradients (median of
    ``rounds`` counted rounds, CPU time)."""
    base, make_loss, (X, y) = _step_only_problem(name, batch)
    runs = {}
    for entry, optimizer in STEP_ONLY.items():
        model, loss = curvopt.extend(copy.deepcopy(base)), curvopt.extend(make_loss())
        opt = optimizer(model.parameters(), lr=LR, **PLAIN)
        for _ in range(2):  # a refresh, then the gradients every counted step reuses
            opt.zero_grad()
            loss(model(X), y).backward()
            opt.step()
        runs[entry] = _steps(opt.step)
    adam_model = copy.deepcopy(base)
    make_loss()(adam_model(X), y).backward()
    runs["adamw"] = _steps(torch.optim.AdamW(adam_model.parameters(), lr=LR).step)
    names = list(runs)
    measured = interleaved(
        names,
        lambda n, r: runs[n](),
        BLOCK,
        rounds,
        1,
        time.perf_counter,
        name,
        lambda _: None,
    )
    return {n: 1e3 * measured.median(n, 1) for n in names}


def _step_only_problem(name: str, batch: int):
    """``(model, loss maker, one batch)`` of a workload, or of a network of
    ``benchmarks.default_step_cost`` (``resnet``, ``encoder``: its batch of 32)."""
    if name in default_step_cost.MODELS:
        make_model, make_batch = default_step_cost.MODELS[name]
        generator = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        return make_model(), torch.nn.CrossEntropyLoss, make_batch(generator)
    problem = get_problem(name)
    return problem.model(0), problem.loss, _batches(problem, batch, 1)[0]


def _steps(step):
    def run():
        for _ in range(BLOCK):
            step()

    return run


#: ``(name, blocks, out, in)``: buckets of the workloads (the ViT's and the GPT's blocks) and
#: an MLP of eight equal widths
BUCKETS = (
    ("ViT qkv", 2, 192, 64),
    ("ViT fc1", 2, 128, 64),
    ("GPT qkv", 2, 384, 128),
    ("GPT fc1", 2, 512, 128),
    ("MLP 8 x 64", 8, 64, 64),
)


def _bucket_apply(left, right, grads):
    matrices = torch.stack([g.reshape(left.shape[-1], -1) for g in grads])
    return (left @ matrices @ right).unbind()


def compile_cost() -> None:
    """Print the batched application's CPU time per call, eager and under ``torch.compile``."""
    compiled = torch.compile(_bucket_apply)
    for name, blocks, rows, cols in BUCKETS:
        left, right = torch.randn(blocks, rows, rows), torch.randn(blocks, cols, cols)
        grads = [torch.randn(rows, cols) for _ in range(blocks)]
        start = time.perf_counter()
        compiled(left, right, grads)
        first = time.perf_counter() - start
        eager = _per_call(_bucket_apply, left, right, grads)
        fast = _per_call(compiled, left, right, grads)
        print(
            f"{name}: eager {eager:.3f} ms, compiled {fast:.3f} ms ({fast / eager:.2f}x), "
            f"first call {first:.1f} s",
            flush=True,
        )


def _per_call(function, *args, calls: int = 200) -> float:
    for _ in range(5):
        function(*args)
    start = time.process_time()
    for _ in range(calls):
        function(*args)
    return 1e3 * (time.process_time() - start) / calls


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--problems",
        nargs="+",
        default=list(PROBLEMS),
        choices=[*PROBLEMS, *default_step_cost.MODELS],
        help="the workloads; with --step-only also default_step_cost's networks",
    )
    parser.add_argument("--compile", action="store_true", help="eager vs torch.compile")
    parser.add_argument("--step-only", action="store_true", help="opt.step() on fixed gradients")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.step_only:
        print(f"{COMMAND} --step-only: ms per opt.step() on fixed gradients (CPU time, one thread)")
        for name in args.problems:
            ms = step_only(name, args.batch, args.rounds)
            row = ", ".join(f"{k} {v:.2f}" for k, v in ms.items())
            print(f"{name}: {row}", flush=True)
        return
    if args.compile:
        print(f"{COMMAND} --compile: CPU ms per call of one bucket's batched application")
        compile_cost()
        return
    print(f"{COMMAND} --batch {args.batch}: ms per step (CPU time, one thread)")
    for name in args.problems:
        ms = measure(name, args.batch, args.rounds)
        row = ", ".join(f"{k} {v:.1f}" for k, v in ms.items())
        print(
            f"{name}: {row}; plain/floor {ms['plain'] / ms['floor']:.3f}, "
            f"plain/floor+check {ms['plain'] / ms['floor+check']:.3f}, "
            f"plain+clip/floor {ms['plain+clip'] / ms['floor']:.3f}, "
            f"plain/adamw {ms['plain'] / ms['adamw']:.2f}, "
            f"amortised/adamw {ms['amortised'] / ms['adamw']:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
