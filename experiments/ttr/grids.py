"""The tuning grids of the time-to-result benchmark, fixed before tuning.

A :class:`Setting` is one point of a grid: optimizer, lr, damping, preset, options, lr schedule
and batch size. The batch size is a tuned choice like the lr: on MNIST logreg and the ViT a grid
is the product of an optimizer's 4 settings and :data:`BATCH_SIZES`. On FMNIST 2C2D (the
costliest problem) the 4 settings run at batch 128, and Adam, schedule-free AdamW, KFAC and
schedule-free KFAC also at batch 512 with 2 settings: their batch-128 winner and its lr doubled
(a 4× larger batch takes larger steps); the others are tuned at batch 128 only.

Choice of the 4 settings:

* the baselines (momentum SGD, Adam): two constant learning rates and two with linear warm-up
  and cosine decay (AlgoPerf's baselines). With the problems' weight decay of 0, Adam is AdamW;
* KFAC (trace-norm damping): the paper's update, the README's setting (kl_clip 1e-3) and the
  ``practical`` preset; DiagGGN-Newton (MC curvature) and EKFAC alike; on the ViT with
  ``fallback`` for the raw class and position tokens; on FMNIST 2C2D the fourth is ``practical``
  with the curvature of 16 of the batch's 128 samples (``curvature_samples=16``; it replaced
  ``practical`` with ``kl_clip=1e-2`` after that one tied with ``practical`` in steps);
* SOAP and PSGD-Kron (heavyball): as the baselines, around heavyball's default lr (3e-3 and
  1e-3): two constant, two warm-up + cosine;
* schedule-free AdamW: it is made to run without a schedule (its averaging replaces the
  decay), but with a warm-up; so 4 learning rates (a factor 2 apart), each with the ``warmup``
  schedule (linear warm-up over the same 5 % of the cap as the baselines', then constant);
* schedule-free KFAC (``sf_kfac``, on FMNIST 2C2D and the ViT): KFAC's ``schedule_free``
  preset, lr 0.3 and 1 by ``kl_clip`` 0.1 and 1, with the ``warmup`` schedule and
  ``curvature_samples=16``, on the ViT with ``fallback="diagonal"`` (whose diagonal is the
  sub-batch's too since 12-02; before, the ViT's grid ran on whole-batch curvature, because
  the diagonal was the whole batch's whatever ``curvature_samples``); on 2C2D also at batch 512
  with lr 1 and 2 (``kl_clip`` 1: the batch-128 winner when they were added, 2026-12-03, and its
  lr doubled; the batch-128 winner has since been lr 0.3, three settings tying at 200 steps);
  on 2C2D with the curvature and inverses every 20 steps (:data:`EVERY_20`, since 2026-12-05).
  Unlike the other grids it was set after explorations at seed 0
  (``results/ttr/logs/kfac_schedule_free.log``: 15 settings on 2C2D, 6 on the ViT;
  ``sf_kfac_intervals.log``: 7 variants of the 2C2D winner, 1 of the ViT's), so it had more
  tuning than the others.

The peers of issue 53, on FMNIST 2C2D, the ViT and the two workloads of
:mod:`experiments.workloads`, fixed before any of their runs, each as the baselines (two
constant learning rates, two with warm-up + cosine):

* ``muon`` (``torch.optim.Muon`` on the hidden ``nn.Linear`` weights, AdamW on the rest at 0.1×
  the lr; :mod:`experiments.peers`): around torch's documented example lr 0.02: 0.01, 0.02
  constant, 0.02 and 0.05 with warm-up + cosine (AdamW at 1e-3 to 5e-3, the range of Adam's
  grids);
* ``muon_adamw`` (heavyball, one lr for its Muon and AdamW parts): 5e-3, 1e-2 constant, 1e-2
  and 2e-2 with warm-up + cosine (heavyball's default 2.5e-3 is made for its AdamW part; the
  orthogonalised update of a ``d``-wide layer has entries of about ``1/sqrt(d)``);
* ``klsoap`` (heavyball): SOAP's grid, around heavyball's default 3e-3.

The two workloads (``fortunes_gpt`` at batch 32, ``mnist_autoencoder`` at batch 128; their
batch size is not tuned yet: :data:`WORKLOAD_BATCH`) get Adam, schedule-free AdamW, SOAP,
PSGD-Kron, the three peers above, KFAC and schedule-free KFAC, with the grids of FMNIST 2C2D's
batch 128 (schedule-free KFAC: the ViT's, curvature and inverses every 10 steps); momentum SGD
is left out. Adam's grid there was fixed before the calibration of their targets.

``kfac_ns`` (``KFAC(orthogonalize=True)``: KFAC's direction replaced by its polar factor by
Newton-Schulz, as Muon's, before the lr), on the two workloads: KFAC's ``practical`` setting
with 16 samples' curvature, and Muon's learning rates (:func:`_kfac_newton_schulz`), whose
step length is the lr's alike. Fixed after an exploration on the GPT at seed 0 with this
setting and lr 0.01, 0.02 and 0.05 constant (``results/ttr/logs/kfac_newton_schulz.py``), so
its grid saw those three runs first; on the autoencoder the damping and ``kl_clip`` are
divided by 784 as KFAC's (below). On FMNIST 2C2D (batch 128) and the ViT (with
``fallback="diagonal"`` for the raw tokens, as ``sf_kfac``'s) the same grid, added before any
run there. Its Newton-Schulz iterations compute in the faster of bfloat16 and float32 on the
host (``orthogonalize_dtype="auto"``, measured once per shape class, bfloat16 only where it is
at least 1.5x faster): on the Intel host that ran the committed grids that is bfloat16 on the
wide layers (3-4x faster from 256 x 256 on with its bfloat16 units) and float32 on the small
ones; on an AMD EPYC host, where bfloat16 products are several times slower, float32. The
committed runs predate it and ran every matrix in bfloat16 (their float32 runs:
``results/ttr/logs/kfac_ns_float32_*.json``).

``eigen_adam`` (``curvopt.optim.EigenAdam``: Adam's moments in the eigenbasis of KFAC's
factors, refreshed every 10 steps), on the two workloads and on FMNIST 2C2D (batch 128), fixed
before any of its runs: it takes Adam's learning rates and schedules, so its grid is Adam's
shaped alike around Adam's seed-0 winner, which is the same on all three problems (lr 4e-3 with
warm-up + cosine, the top of Adam's grid): 2e-3 and 4e-3 constant, 4e-3 and 8e-3 with warm-up +
cosine (Adam's grid × 2, so that Adam's winner is inside it and not at its edge). Its other
options are the class's defaults, SOAP's (``betas=(0.95, 0.95)``, ``eps=1e-8``,
``curvature_ema=0.95``), with ``basis_interval=10`` written out (:data:`BASIS_10`). Placing it
at Adam's winner uses Adam's results, not its own: a head start over the peers whose grids sit
at their package's default lr, stated here.

The autoencoder's KFAC, schedule-free KFAC and ``kfac_ns`` grids hold the other problems'
values, given per unit of the loss's reduction scale (``reduction_scaled=True``,
:data:`PER_SAMPLE`: ``damping=ReductionScaledDamping(λ)``, so ``λ s`` and ``kl_clip`` ``κ s`` in
the optimizer, ``s`` the factor by which the loss's reduction scales one sample's curvature). The
grids' values were set for losses averaged over samples, one term per sample (``s = 1``);
``BCEWithLogitsLoss`` also averages over the 784 pixels of an image (``s = 1/784``), so the
loss, its gradient ``g`` and its curvature ``C`` are 1/784 of the per-image loss's. KFAC's step
``(C + λ s I)⁻¹ g`` on the per-pixel loss is the step on the per-image loss with ``λ``
(trace-norm damping splits ``λ/784`` between the factors so that the damped product is 1/784 of
the per-image one too), and the trust region's ``lr² gᵀd`` is 1/784 of the per-image one, so
``κ/784`` clips the same steps. These are the settings of the committed runs, which gave the
damping and ``kl_clip`` divided by 784 by hand (a rule fixed before their runs, not tuned on
results): mathematically the same steps, so those results stand. With the grids' values unscaled
(the first runs), a damping of 0.1 weighed as 78 would on the per-image loss, and neither KFAC
setting nor schedule-free KFAC reached a target (``results/ttr/workloads.md``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from ..config import RunConfig
from .schedules import SCHEDULES

#: the batch sizes every optimizer's settings are tried at
BATCH_SIZES = (128, 512)


@dataclass(frozen=True)
class Setting:
    """One point of a tuning grid: optimizer, lr, damping, preset, extra options, lr schedule,
    batch size (``None``: the problem's, as in the result files written before the batch size
    was tuned)."""

    optimizer: str
    lr: float
    damping: float | None = None
    preset: str | None = None
    options: tuple[tuple[str, Any], ...] = ()
    schedule: str = "constant"
    batch_size: int | None = None

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose from {SCHEDULES}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        object.__setattr__(self, "options", tuple(sorted(dict(self.options).items())))

    def config(self, problem: str, seed: int, synthetic: bool = False) -> RunConfig:
        return RunConfig(
            problem,
            self.optimizer,
            self.lr,
            damping=self.damping,
            seed=seed,
            batch_size=self.batch_size,
            synthetic=synthetic,
            preset=self.preset,
            options=self.options,
        )

    def as_dict(self) -> dict:
        out = asdict(self)
        out["options"] = dict(self.options)
        return out

    @classmethod
    def from_dict(cls, d: dict) -> Setting:
        return cls(**{**d, "options": tuple(d.get("options", {}).items())})

    @property
    def label(self) -> str:
        parts = [f"lr {self.lr:g}"]
        if self.damping is not None:
            parts.append(f"damping {self.damping:g}")
        if self.preset:
            parts.append(self.preset)
        parts += [f"{k}={v}" for k, v in self.options]
        if self.schedule != "constant":
            parts.append(self.schedule)
        if self.batch_size is not None:
            parts.append(f"batch {self.batch_size}")
        return f"{self.optimizer} " + ", ".join(parts)


def _grid(optimizer: str, *points: tuple, batch_sizes=BATCH_SIZES) -> tuple[Setting, ...]:
    """``(lr, damping, preset, options dict, schedule)`` tuples (trailing fields optional), each
    at every batch size of ``batch_sizes``."""
    out = []
    for point in points:
        lr, damping, preset, options, schedule = (
            point + (None, None, {}, "constant")[len(point) - 1 :]
        )
        out.append(Setting(optimizer, lr, damping, preset, tuple(options.items()), schedule))
    return tuple(replace(s, batch_size=b) for b in batch_sizes for s in out)


def _first_order(
    optimizer: str,
    lrs: tuple[float, float, float, float],
    damping=None,
    preset=None,
    options=None,
    **batch_sizes,
):
    """Two constant learning rates, two with warm-up and cosine decay (each with ``damping``,
    ``preset`` and ``options``, for a curvature optimizer taking a first-order grid)."""
    fixed = (damping, preset, options or {})
    points = [(lr, *fixed) for lr in lrs[:2]] + [(lr, *fixed, WC) for lr in lrs[2:]]
    return _grid(optimizer, *points, **batch_sizes)


def _schedule_free(lrs: tuple[float, ...], **batch_sizes):
    return _grid("sf_adamw", *((lr, None, None, {}, "warmup") for lr in lrs), **batch_sizes)


def _schedule_free_kfac(options: dict, lrs=(0.3, 1.0), clips=(0.1, 1.0), **batch_sizes):
    """KFAC's ``schedule_free`` preset (damping 0.1, as ``practical``): each lr (default 0.3
    and 1) with each trust region ``kl_clip`` (default 0.1 and 1), with the ``warmup``
    schedule."""
    points = [
        (lr, 0.1, "schedule_free", {**options, "kl_clip": clip}, "warmup")
        for clip in clips
        for lr in lrs
    ]
    return _grid("sf_kfac", *points, **batch_sizes)


WC = "warmup_cosine"
#: the README's KFAC settings (``kl_clip=1e-3``, kfac-pytorch's default trust region)
README_KL = {"kl_clip": 1e-3}
#: the paper's update (no trust region; the constructors' default is ``kl_clip=1e-3``)
PAPER_KL = {"kl_clip": None}
#: the curvature from the first 16 of the batch's samples (``benchmarks/kfac_variants.py``: the
#: same steps as the whole batch's at seed 0); on 2C2D it replaced ``kl_clip=1e-2``, which
#: tied with ``practical`` in steps and costs as much
SUB16 = {"curvature_samples": 16}
#: the curvature and inverses every 20 steps (the presets': 10): on 2C2D since 2026-12-05, chosen
#: at seed 0 from 7 variants of its winner (175 steps against 200); on the ViT 10 stays (500 steps
#: against 525 at 20; ``results/ttr/logs/sf_kfac_intervals.log``)
EVERY_20 = {"curvature_interval": 20, "inverse_interval": 20}
#: a ViT's raw class and position tokens have no Kronecker factors
DIAG = {"fallback": "diagonal"}
#: FMNIST 2C2D's grids at batch 128; batch 512 has its own (see the module doc)
B128, B512 = {"batch_sizes": (128,)}, {"batch_sizes": (512,)}
#: the workloads' own batch sizes, the only ones tuned there so far
WORKLOAD_BATCH = {"fortunes_gpt": 32, "mnist_autoencoder": 128}
#: ``eigen_adam``'s basis refreshed every 10 steps (the class's default, written out so that the
#: cost's blocks see the period)
BASIS_10 = {"basis_interval": 10}
#: damping and ``kl_clip`` per unit of the loss's reduction scale ``s`` (the autoencoder's
#: per-pixel mean: ``s = 1/784``; see the module doc)
PER_SAMPLE = {"reduction_scaled": True}


def _eigen_adam(lrs=(2e-3, 4e-3, 4e-3, 8e-3), **batch_sizes) -> tuple[Setting, ...]:
    """``eigen_adam``: two constant learning rates and two with warm-up and cosine decay, each
    with :data:`BASIS_10` (see the module doc)."""
    a, b, c, d = lrs
    points = (a, None, None, BASIS_10), (b, None, None, BASIS_10)
    points += (c, None, None, BASIS_10, WC), (d, None, None, BASIS_10, WC)
    return _grid("eigen_adam", *points, **batch_sizes)


def _per_sample(settings: tuple[Setting, ...]) -> tuple[Setting, ...]:
    """``settings`` with their damping and ``kl_clip`` per unit of the loss's reduction scale
    (:data:`PER_SAMPLE`), for a loss that averages over several terms per sample (see the
    module doc)."""
    return tuple(
        replace(s, options=tuple({**dict(s.options), **PER_SAMPLE}.items())) for s in settings
    )


def _peers_53(**batch_sizes) -> dict[str, tuple[Setting, ...]]:
    """The grids of issue 53's peers (see the module doc)."""
    return {
        "muon": _first_order("muon", (0.01, 0.02, 0.02, 0.05), **batch_sizes),
        "muon_adamw": _first_order("muon_adamw", (5e-3, 1e-2, 1e-2, 2e-2), **batch_sizes),
        "klsoap": _first_order("klsoap", (1e-3, 3e-3, 3e-3, 6e-3), **batch_sizes),
    }


#: Newton-Schulz in the host's faster precision: bfloat16 (as torch.optim.Muon's) or float32
NS_AUTO = {"orthogonalize_dtype": "auto"}


def _kfac_newton_schulz(
    lrs=(0.01, 0.02, 0.02, 0.05), options=SUB16, **batch_sizes
) -> tuple[Setting, ...]:
    """``kfac_ns``: KFAC's ``practical`` setting with the 16 samples' curvature (its winner on
    the workloads' 2C2D-sized grids; ``options``) and ``orthogonalize=True``, Newton-Schulz in
    the host's faster precision (:data:`NS_AUTO`); the orthogonalised step's length is the lr's, as
    Muon's, so its grid is Muon's: 0.01 and 0.02 constant, 0.02 and 0.05 with warm-up +
    cosine."""
    return _first_order("kfac_ns", lrs, 0.1, "practical", {**options, **NS_AUTO}, **batch_sizes)


def _workload(problem: str) -> dict[str, tuple[Setting, ...]]:
    """A workload's grids at its own batch size (see the module doc); the autoencoder's KFAC
    grids per unit of its loss's reduction scale (:func:`_per_sample`)."""
    b = {"batch_sizes": (WORKLOAD_BATCH[problem],)}
    grids = {
        "adam": _first_order("adam", (1e-3, 2e-3, 2e-3, 4e-3), **b),
        "sf_adamw": _schedule_free((1e-3, 2e-3, 4e-3, 8e-3), **b),
        "soap": _first_order("soap", (1e-3, 3e-3, 3e-3, 6e-3), **b),
        "psgd_kron": _first_order("psgd_kron", (3e-4, 1e-3, 1e-3, 3e-3), **b),
        **_peers_53(**b),
        "kfac": _grid(
            "kfac",
            (0.1, 0.1, None, PAPER_KL),
            (0.05, 1e-3, None, README_KL),
            (0.01, 0.1, "practical"),
            (0.01, 0.1, "practical", SUB16),
            **b,
        ),
        "sf_kfac": _schedule_free_kfac(SUB16, **b),
        "eigen_adam": _eigen_adam(**b),
        "kfac_ns": _kfac_newton_schulz(**b),
    }
    if problem == "mnist_autoencoder":
        for name in ("kfac", "sf_kfac", "kfac_ns"):
            grids[name] = _per_sample(grids[name])
    return grids


#: The tuning grids: problem -> optimizer -> settings (see the module doc).
GRIDS: dict[str, dict[str, tuple[Setting, ...]]] = {
    "mnist_logreg": {
        "momentum": _first_order("momentum", (0.03, 0.1, 0.1, 0.3)),
        "adam": _first_order("adam", (1e-3, 3e-3, 3e-3, 1e-2)),
        "kfac": _grid(
            "kfac",
            (0.1, 0.01, None, PAPER_KL),
            (0.3, 0.01, None, README_KL),
            (0.05, 1e-3, None, README_KL),
            (0.03, 0.01, "practical"),
        ),
        "diagggn_mc": _grid(
            "diagggn_mc",
            (0.01, 0.01, None, PAPER_KL),
            (0.1, 0.01, None, PAPER_KL),
            (0.3, 0.01, None, README_KL),
            (0.01, 0.01, "practical"),
        ),
        "ekfac": _grid(
            "ekfac",
            (0.1, 0.01, None, PAPER_KL),
            (0.3, 0.01, None, README_KL),
            (0.05, 1e-3, None, README_KL),
            (0.03, 0.01, "practical"),
        ),
        "soap": _first_order("soap", (1e-3, 3e-3, 3e-3, 1e-2)),
        "psgd_kron": _first_order("psgd_kron", (1e-3, 3e-3, 3e-3, 1e-2)),
        "sf_adamw": _schedule_free((1e-3, 3e-3, 1e-2, 3e-2)),
    },
    "fmnist_2c2d": {
        "momentum": _first_order("momentum", (0.02, 0.05, 0.05, 0.1), **B128),
        "adam": _first_order("adam", (1e-3, 2e-3, 2e-3, 4e-3), **B128)
        + _grid("adam", (4e-3, None, None, {}, WC), (8e-3, None, None, {}, WC), **B512),
        "kfac": _grid(
            "kfac",
            (0.1, 0.1, None, PAPER_KL),
            (0.05, 1e-3, None, README_KL),
            (0.01, 0.1, "practical"),
            (0.01, 0.1, "practical", SUB16),
            **B128,
        )
        + _grid("kfac", (0.01, 0.1, "practical"), (0.02, 0.1, "practical"), **B512),
        "diagggn_mc": _grid(
            "diagggn_mc",
            (1e-3, 1e-3, None, PAPER_KL),
            (0.01, 0.01, None, PAPER_KL),
            (0.05, 1e-3, None, README_KL),
            (1e-3, 1e-3, "practical"),
            **B128,
        ),
        "ekfac": _grid(
            "ekfac",
            (0.1, 0.1, None, PAPER_KL),
            (0.05, 1e-3, None, README_KL),
            (0.01, 0.1, "practical"),
            (0.01, 0.1, "practical", {"kl_clip": 1e-2}),
            **B128,
        ),
        "soap": _first_order("soap", (1e-3, 3e-3, 3e-3, 6e-3), **B128),
        "psgd_kron": _first_order("psgd_kron", (3e-4, 1e-3, 1e-3, 3e-3), **B128),
        "sf_adamw": _schedule_free((1e-3, 2e-3, 4e-3, 8e-3), **B128)
        + _schedule_free((8e-3, 1.6e-2), **B512),
        "sf_kfac": _schedule_free_kfac({**SUB16, **EVERY_20}, **B128)
        + _schedule_free_kfac({**SUB16, **EVERY_20}, lrs=(1.0, 2.0), clips=(1.0,), **B512),
        **_peers_53(**B128),
        "eigen_adam": _eigen_adam(**B128),
        "kfac_ns": _kfac_newton_schulz(**B128),
    },
    "fmnist_vit": {
        "adam": _first_order("adam", (5e-4, 1e-3, 1e-3, 2e-3)),
        "momentum": _first_order("momentum", (0.01, 0.03, 0.03, 0.1)),
        "kfac": _grid(
            "kfac",
            (0.1, 0.1, None, {**PAPER_KL, **DIAG}),
            (0.05, 1e-3, None, {**README_KL, **DIAG}),
            (0.01, 0.1, "practical", DIAG),
            (0.01, 0.1, "practical", {"fallback": "sgd"}),
        ),
        "soap": _first_order("soap", (1e-3, 3e-3, 3e-3, 6e-3)),
        "psgd_kron": _first_order("psgd_kron", (3e-4, 1e-3, 1e-3, 3e-3)),
        "sf_adamw": _schedule_free((5e-4, 1e-3, 2e-3, 4e-3)),
        "sf_kfac": _schedule_free_kfac({**DIAG, **SUB16}),
        **_peers_53(),
        "kfac_ns": _kfac_newton_schulz(options={**DIAG, **SUB16}),
    },
    "fortunes_gpt": _workload("fortunes_gpt"),
    "mnist_autoencoder": _workload("mnist_autoencoder"),
}
