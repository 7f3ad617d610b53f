"""CUDA check: every quantity on the GPU equals the CPU result (float64), plus GPU timings.

python benchmarks/gpu_check.py        # needs a CUDA device

The timings: 3C3D at N=64 per quantity against the plain pass; then the prepared pass: on
``deep_narrow`` (33 ``Linear(16, 16)``-sized modules, N=8: launch-bound, the cost per module)
and 3C3D, a structure's first pass (its plan made: this context's plans emptied before each,
``core.plans.plan_cache``) against a pass that finds its plan (the same structure again).
"""

import copy
import time

import torch
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.core.plans import plan_cache
from experiments.overhead.problems import PROBLEMS
from experiments.problems import cifar10_3c3d

FIRST = [ext.BatchGrad(), ext.BatchL2Grad(), ext.SumGradSquared(), ext.Variance()]
SECOND = [ext.DiagGGNExact(), ext.BatchDiagGGNExact(), ext.KFLR(), ext.DiagHessian()]


def cnn():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.Sigmoid(),
        nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, stride=2, padding="valid"),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 2 * 2, 10),
    )


def collect_all(model, X, y, exts, device):
    model = curvopt.extend(copy.deepcopy(model).to(device))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    with curvopt.collect(*exts):
        lossfunc(model(X.to(device)), y.to(device)).backward()
    return {
        (name, e.attr): getattr(p, e.attr) for name, p in model.named_parameters() for e in exts
    }


def compare():
    torch.manual_seed(0)
    model = cnn().double()
    X, y = torch.randn(6, 3, 12, 12, dtype=torch.double), torch.randint(0, 10, (6,))
    for exts in (FIRST, SECOND):
        cpu = collect_all(model, X, y, exts, "cpu")
        gpu = collect_all(model, X, y, exts, "cuda")
        worst = 0.0
        for key, value in cpu.items():
            values = value if isinstance(value, list) else [value]
            others = gpu[key] if isinstance(gpu[key], list) else [gpu[key]]
            for a, b in zip(values, others):
                assert b.is_cuda, key
                err = ((a - b.cpu()).abs().max() / a.abs().max().clamp(min=1e-30)).item()
                worst = max(worst, err)
        print(f"CUDA vs CPU, {[type(e).__name__ for e in exts]}: max relative error {worst:.2e}")
        assert worst < 1e-10


def timings(n=64, repeats=30):
    torch.manual_seed(0)
    model = cifar10_3c3d().cuda()
    plain = copy.deepcopy(model)
    ext_model = curvopt.extend(model)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    X, y = torch.randn(n, 3, 32, 32, device="cuda"), torch.randint(0, 10, (n,), device="cuda")

    def step(m, exts):
        m.zero_grad()
        loss = lossfunc(m(X), y)
        if exts is None:
            loss.backward()
        else:
            with curvopt.collect(*exts):
                loss.backward()

    cases = {"plain": (plain, None), "hooks only": (ext_model, None)}
    for e in FIRST + [ext.DiagGGNMC(), ext.KFAC(), ext.KFLR(), ext.DiagGGNExact()]:
        cases[type(e).__name__] = (ext_model, [e])
    results = {k: [] for k in cases}
    for _ in range(3):
        for m, e in cases.values():
            step(m, e)
    for _ in range(repeats):
        for name, (m, e) in cases.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            step(m, e)
            torch.cuda.synchronize()
            results[name].append(time.perf_counter() - t)
    base = sorted(results["plain"])[repeats // 2]
    print(f"\n3C3D, N={n}, float32, {torch.cuda.get_device_name()} (median of {repeats})")
    print("| case | ms | ratio to plain |\n|---|---|---|")
    for name, ts in results.items():
        med = sorted(ts)[repeats // 2]
        print(f"| {name} | {med * 1e3:.2f} | {med / base:.2f} |")


def _median_ms(step, repeats, before=None) -> float:
    """Median over ``repeats`` of ``step()``'s time in ms, synchronised (``before()`` untimed
    ahead of each)."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times)[repeats // 2]


def prepared(repeats=30):
    """A structure's first pass (its plan made) against a later one (its plan found), per
    quantity, on ``deep_narrow`` at N=8 and 3C3D at N=64; ms per pass, the plain pass beside."""
    print("\n| problem | case | plain ms | first pass ms | later pass ms | first / later |")
    print("|---|---|---|---|---|---|")
    for name, n in (("deep_narrow", 8), ("3c3d", 64)):
        _prepared_rows(name, n, repeats)


def _prepared_rows(name: str, n: int, repeats: int):
    """The rows of :func:`prepared` for problem ``name`` at batch ``n``."""
    model, X, y, lossfunc = PROBLEMS[name].resized(n).build()
    model, X, y = model.cuda(), X.cuda(), y.cuda()
    plain = copy.deepcopy(model)
    curvopt.extend(model)
    lossfunc = curvopt.extend(lossfunc)

    def plain_step():
        plain.zero_grad()
        lossfunc(plain(X), y).backward()

    for e in (ext.BatchGrad(), ext.KFAC(), ext.DiagGGNExact()):

        def step(e=e):
            model.zero_grad()
            with curvopt.collect(e):
                lossfunc(model(X), y).backward()

        for _ in range(3):
            step()
            plain_step()
        base = _median_ms(plain_step, repeats)
        first = _median_ms(step, repeats, before=plan_cache().clear)
        later = _median_ms(step, repeats)
        label = type(e).__name__
        ratio = first / later
        print(f"| {name} | {label} | {base:.2f} | {first:.2f} | {later:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    compare()
    timings()
    prepared()
