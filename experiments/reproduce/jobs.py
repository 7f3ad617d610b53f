"""The main job's data and training runs (budgeted runs, or the paper's grids)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from pathlib import Path

from .. import fetch_data
from ..config import RunConfig
from ..data import DataMissingError, ImageData, load_dataset, make_splits
from ..distributed import resolve_device
from ..optimizers import DAMPED, SetupError
from ..problems import get_problem
from ..runner import PAPER_DAMPINGS, PAPER_LRS, grid, run
from .plan import Plan, paper_preset


class Log:
    """Timestamped progress lines, and the seconds spent per named phase."""

    def __init__(self):
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}

    def __call__(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f}s] {msg}", flush=True)

    @contextlib.contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t0


def load_data(
    problems: list[str], root: Path | None, fetch: bool, synthetic: bool, log
) -> tuple[dict[str, ImageData], dict[str, str]]:
    """The data set of every problem that can be had: ``({dataset: data}, {problem: why not})``."""
    datasets: dict[str, ImageData] = {}
    missing: dict[str, str] = {}
    fetched = False
    for problem in problems:
        name = get_problem(problem).dataset
        if name in datasets:
            continue
        try:
            datasets[name] = load_dataset(name, root, synthetic)
            continue
        except DataMissingError as err:
            first_error = err
        if fetch and not fetched and name in ("mnist", "fmnist"):
            fetched = True
            log(f"{name} is missing; running `python -m experiments fetch_data` ...")
            try:
                argv = [] if root is None else ["--root", str(root)]
                fetch_data.main(argv)
            except Exception as err:  # noqa: BLE001  (fetching is best effort; say why)
                log(f"fetch_data failed: {type(err).__name__}: {err}")
            try:
                datasets[name] = load_dataset(name, root, synthetic)
                continue
            except DataMissingError as err:
                first_error = err
        missing[name] = str(first_error)
    skipped = {
        p: missing[get_problem(p).dataset] for p in problems if get_problem(p).dataset in missing
    }
    for problem, why in skipped.items():
        log(f"SKIPPING {problem}: its data set is not available. {why}")
    return datasets, skipped


# --- the runs ---------------------------------------------------------------------------------


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def _report(log, result: dict, seconds: float) -> None:
    f = result["final"]
    state = "reused" if result.get("skipped") else result["status"]
    log(
        f"  {result['config']['optimizer']:<10} seed {result['config']['seed']}: {state:<8} "
        f"epoch {f['epoch']}: test acc {_fmt(f.get('test_acc'))}, valid acc "
        f"{_fmt(f.get('valid_acc'))}, train loss {_fmt(f.get('train_loss'))} "
        f"({seconds:.1f}s; training {result['timing']['epoch_s']:.1f}s)"
    )


def run_budgeted(plan: Plan, datasets, skipped, args, log) -> list[dict]:
    results = []
    runs_dir = args.out / "runs"
    for problem in plan.problems:
        if problem in skipped:
            continue
        b = plan.budgets[problem]
        data = datasets[get_problem(problem).dataset]
        dev = resolve_device(args.device)
        splits = make_splits(data, train_size=b.train_size, eval_size=b.eval_size, device=dev)
        log(
            f"{problem}: {len(splits.train)} training samples, {b.epochs} epochs, eval on "
            f"{len(splits.test)} test samples, {plan.seeds[problem]} seed(s), optimizers "
            f"{', '.join(plan.optimizers[problem])}" + (" [SYNTHETIC]" if splits.synthetic else "")
        )
        with log.phase(f"train {problem}"):
            if plan.lr_grid:
                for opt in plan.optimizers[problem]:
                    lr, damping = plan.hparams[problem][opt]
                    base = plan.configs(problem, args.synthetic)[0]
                    base = replace(
                        base,
                        optimizer=opt,
                        lr=lr,
                        damping=damping if opt in DAMPED else None,
                        preset=paper_preset(opt),
                    )
                    t0 = time.perf_counter()
                    try:
                        summary = grid(
                            base,
                            lrs=PAPER_LRS,
                            dampings=PAPER_DAMPINGS,
                            seeds=plan.seeds[problem],
                            results_dir=runs_dir,
                            data_root=args.data_root,
                            device=args.device,
                            progress=args.progress,
                        )
                    except (SetupError, RuntimeError, FloatingPointError, ValueError) as err:
                        log(
                            f"  {opt}: grid FAILED ({type(err).__name__}): "
                            f"{str(err).splitlines()[0][:300]}"
                        )
                        continue
                    log(
                        f"  {opt}: grid best {summary['best']}, test acc "
                        f"{_fmt(summary['test_acc_mean'])} ({time.perf_counter() - t0:.1f}s)"
                    )
                    results.append(summary)
                continue
            for cfg in plan.configs(problem, args.synthetic):
                t0 = time.perf_counter()
                try:
                    result = run(
                        cfg,
                        results_dir=runs_dir,
                        data_root=args.data_root,
                        device=args.device,
                        progress=args.progress,
                        splits=splits,
                    )
                except SetupError as err:
                    log(f"  {cfg.optimizer} seed {cfg.seed}: cannot run: {err}")
                    continue
                except (RuntimeError, FloatingPointError, ValueError) as err:
                    # e.g. a Cholesky failure (torch.linalg.LinAlgError) at a too small damping:
                    # the runner writes no JSON for it; report it and go on with the next run
                    log(
                        f"  {cfg.optimizer} seed {cfg.seed}: FAILED ({type(err).__name__}): "
                        f"{str(err).splitlines()[0][:300]}"
                    )
                    continue
                _report(log, result, time.perf_counter() - t0)
                results.append(result)
    return results


def run_full(plan: Plan, skipped, args, log) -> list[dict]:
    summaries = []
    for problem in plan.problems:
        if problem in skipped:
            continue
        for opt in plan.optimizers[problem]:
            base = RunConfig(
                problem,
                opt,
                PAPER_LRS[0],
                damping=PAPER_DAMPINGS[0] if opt in DAMPED else None,
                epochs=plan.budgets[problem].epochs,
                train_size=plan.budgets[problem].train_size,
                eval_size=plan.budgets[problem].eval_size,
                synthetic=args.synthetic,
                preset=paper_preset(opt),
            )
            t0 = time.perf_counter()
            with log.phase(f"train {problem}"):
                try:
                    summary = grid(
                        base,
                        lrs=PAPER_LRS,
                        dampings=PAPER_DAMPINGS,
                        seeds=plan.seeds[problem],
                        results_dir=args.out / "runs",
                        data_root=args.data_root,
                        device=args.device,
                        progress=args.progress,
                    )
                except (SetupError, DataMissingError) as err:
                    log(f"{problem} / {opt}: cannot run: {err}")
                    continue
                except (RuntimeError, FloatingPointError, ValueError) as err:
                    # runner.grid stops at the first run that raises (e.g. a Cholesky failure
                    # at damping 1e-4); the runs finished so far stay on disk
                    log(
                        f"{problem} / {opt}: grid FAILED ({type(err).__name__}): "
                        f"{str(err).splitlines()[0][:300]}"
                    )
                    continue
            log(
                f"{problem} / {opt}: best {summary['best']}, test acc "
                f"{_fmt(summary['test_acc_mean'])} ± {_fmt(summary['test_acc_std'])} over "
                f"{len(summary['seeds'])} seeds ({time.perf_counter() - t0:.0f}s)"
            )
            summaries.append(summary)
    return summaries
