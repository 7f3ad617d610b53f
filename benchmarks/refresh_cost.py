"""The cost of refreshing one Kronecker factor's eigenbasis or damped inverse, by method, at the
factor sizes of the time-to-result workloads (64 to 1000 wide; the autoencoder's 1000), in one
process, one thread, interleaved.

    OMP_NUM_THREADS=1 python -m benchmarks.refresh_cost [--sizes 64 128 256 512 1000] [--rounds 7]

Per size ``d``: a float32 factor ``F = XᵀX / 2d`` (``X [2d, d]`` Gaussian with column scales
spread over two decades, so the spectrum has gaps and a condition number of about 10⁴), and the
next refresh's factor ``F' = 0.95 F + 0.05 F_new`` (an average over steps drifting). Timed
(median ms of ``--rounds`` interleaved rounds, CPU time):

* ``eigh``: ``psd_eigh(F')`` (what a basis refresh does today);
* ``warm``: ``warm_eigenbasis(F', Q)`` from ``F``'s eigenbasis (one power step and a QR), with
  the off-diagonal mass ``‖QᵀF'Q − diag‖_F / ‖F'‖_F`` it leaves (``eigh``'s is rounding);
* ``cholesky``: ``cholesky_inverse(F' + c I)``, ``c`` = 1e-3 of the mean eigenvalue (what a
  Kronecker inverse does today);
* ``newton32`` / ``newton16``: ``newton_inverse_root(F' + c I)`` warm-started from
  ``(F + c I)⁻¹`` (used where its residual ``‖X₀ A − I‖_F`` is below 1/2, reported, else
  the cold start), products in float32 / bfloat16, to a residual of 1e-3 (at most 40 steps),
  with the steps taken and the relative error reached against the float64 inverse;
* ``ns32`` / ``ns16``: Newton–Schulz orthogonalisation of a ``d × d`` update in float32 /
  bfloat16 (what ``orthogonalize_dtype="auto"`` chooses between).

Writes ``benchmarks/results/refresh_cost.json`` and ``.md`` (``--out``), with the CPU's model.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform

import torch

from benchmarks.raw_token_sites import interleaved_medians
from curvopt.core.psd import psd_eigh
from curvopt.inversion.factor_inverse import cholesky_inverse
from curvopt.inversion.newton_root import newton_inverse_root
from curvopt.inversion.warm_eigh import warm_eigenbasis
from curvopt.optim.transforms import orthogonalized

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else ``platform.processor()``."""
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def factor(dim: int, generator: torch.Generator) -> torch.Tensor:
    """``XᵀX / 2d`` for ``X [2d, d]`` with column scales from 1 to 100 (float32)."""
    scales = torch.logspace(0, 2, dim, dtype=torch.float64)
    inputs = torch.randn(2 * dim, dim, generator=generator, dtype=torch.float64) * scales
    return (inputs.mT @ inputs / (2 * dim)).float()


def measure(dim: int, rounds: int, repeats: int) -> dict:
    """The medians (ms) and accuracies of one size (see the module)."""
    generator = torch.Generator().manual_seed(dim)
    old = factor(dim, generator)
    new = 0.95 * old + 0.05 * factor(dim, generator)
    shift = 1e-3 * float(new.diagonal().mean())
    identity = torch.eye(dim)
    old_basis = psd_eigh(old)[1]
    old_inverse = torch.linalg.inv((old + shift * identity).double()).float()
    damped = new + shift * identity
    exact = torch.linalg.inv(damped.double())
    update = torch.randn(dim, dim, generator=generator)

    def newton(dtype):
        return newton_inverse_root(
            damped, previous=old_inverse, dtype=dtype, tolerance=1e-3, max_iterations=40
        )

    cases = {
        "eigh": lambda: psd_eigh(new),
        "warm": lambda: warm_eigenbasis(new, old_basis),
        "cholesky": lambda: cholesky_inverse(damped),
        "newton32": lambda: newton(torch.float32),
        "newton16": lambda: newton(torch.bfloat16),
        "ns32": lambda: orthogonalized(update, dtype=torch.float32),
        "ns16": lambda: orthogonalized(update, dtype=torch.bfloat16),
    }
    row = {"dim": dim, "ms": interleaved_medians(cases, rounds, repeats)}
    basis = warm_eigenbasis(new, old_basis)[1].double()
    rotated = basis.mT @ new.double() @ basis
    off = rotated - torch.diag(rotated.diagonal())
    row["warm_off_diagonal"] = float(off.norm() / rotated.norm())
    start = old_inverse.double() @ damped.double() - torch.eye(dim, dtype=torch.float64)
    row["newton_start_residual"] = float(start.norm())
    for name, dtype in (("newton32", torch.float32), ("newton16", torch.bfloat16)):
        inverse, steps = newton(dtype)
        error = float((inverse.double() - exact).norm() / exact.norm())
        row[name] = {"steps": steps, "relative_error": error}
    return row


def table(rows: list[dict], cpu: str) -> str:
    """The markdown table of :func:`measure`'s rows."""
    lines = [
        f"Refresh cost per factor, ms (median, one thread, interleaved), CPU: {cpu}",
        "",
        "| d | eigh | warm | warm off-diag | cholesky | newton32 (steps, err) "
        "| newton16 (steps, err) | warm start residual | ns32 | ns16 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms, n32, n16 = r["ms"], r["newton32"], r["newton16"]
        lines.append(
            f"| {r['dim']} | {ms['eigh']:.2f} | {ms['warm']:.2f} | {r['warm_off_diagonal']:.1e} "
            f"| {ms['cholesky']:.2f} | {ms['newton32']:.2f} ({n32['steps']}, "
            f"{n32['relative_error']:.0e}) | {ms['newton16']:.2f} ({n16['steps']}, "
            f"{n16['relative_error']:.0e}) | {r['newton_start_residual']:.1e} "
            f"| {ms['ns32']:.2f} | {ms['ns16']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256, 512, 1000])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "refresh_cost")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cpu = cpu_model()
    rows = [measure(dim, args.rounds, args.repeats) for dim in args.sizes]
    markdown = table(rows, cpu)
    print(markdown)
    args.out.with_suffix(".json").write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=1))
    args.out.with_suffix(".md").write_text(markdown)


if __name__ == "__main__":
    main()
