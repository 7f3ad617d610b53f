"""The time-to-result benchmark's workloads of issue 53 (the fortunes GPT, the MNIST autoencoder)
and its new peers (torch's Muon with AdamW, heavyball's MuonAdamW and KLSOAP): the corpus loader
on a small generated text, the models, the metrics, ``ttr --quick`` on both workloads, and each
peer built and stepped on a tiny model."""

import hashlib
from dataclasses import replace
import importlib.util
import json
import math

import pytest
import torch
from torch import nn

from experiments import peers, workloads
from experiments.__main__ import main
from experiments.data import DataMissingError
from experiments.fetch_data import fetch_fortunes
from experiments.optimizers import allowed_options
from experiments.problems import get_problem
from experiments.ttr.grids import GRIDS
from experiments.ttr.protocol import TTR_PROBLEMS, TtrProblem, proposed_targets, RunResult

NEW_PEERS = ("muon", "muon_adamw", "klsoap")
WORKLOADS = ("fortunes_gpt", "mnist_autoencoder")


@pytest.fixture
def eager(monkeypatch):
    """heavyball's peers without compilation (inductor takes minutes)."""
    monkeypatch.setattr(peers, "COMPILE_MODES", ())


def _tiny_corpus(folder):
    """Two fortune files in the package's format (``%`` lines), with a tab, an overstrike
    (``_\\bX``), a non-ASCII character and a bell; returns their md5 sums in corpus order."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        "alpha": "".join(
            f"Fortune {i} of alpha:\tthe _\bquick fox, caf\u00e9\a.\n  -- Someone\n%\n"
            for i in range(12)
        ),
        "beta": "".join(f"Beta {i} says hello.\n%\n" for i in range(8)),
    }
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return {n: hashlib.md5(t.encode("utf-8")).hexdigest() for n, t in files.items()}


def test_the_corpus_is_normalised_split_by_fortune_and_checked(tmp_path):
    sums = _tiny_corpus(tmp_path)
    train, valid = workloads.read_corpus(tmp_path, sums)
    fortunes = (train + valid).split("\n\n")[:-1]
    assert len(fortunes) == 20
    # every tenth fortune in corpus order (k % 10 == 9) is held out: alpha 9, beta 7 (k = 19)
    assert (
        valid == "Fortune 9 of alpha: the quick fox, caf.\n  -- Someone\n\nBeta 7 says hello.\n\n"
    )
    assert "Fortune 8 of alpha" in train and "Fortune 9 of" not in train and "Beta 7" not in train
    assert set(train + valid) <= {"\n"} | {chr(c) for c in range(32, 127)}
    ids = workloads.encode(train)
    assert ids.min() >= 0 and ids.max() < workloads.VOCAB and workloads.decode(ids) == train
    assert workloads.encode("\n ~").tolist() == [0, 1, 95]
    # a changed file fails loudly
    (tmp_path / "beta").write_text("Beta changed\n%\n")
    with pytest.raises(ValueError, match="md5"):
        workloads.read_corpus(tmp_path, sums)


def test_windows_tile_the_text_once_and_targets_are_the_next_characters():
    ids = torch.arange(10 * 64 + 5)
    split = workloads.windows(ids)
    assert split.x.shape == split.y.shape == (10, 64)
    assert torch.equal(split.x.flatten(), ids[:640]) and torch.equal(split.y, split.x + 1)


def test_a_missing_corpus_names_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setattr(workloads, "DEBIAN_FORTUNES", tmp_path / "nowhere")
    with pytest.raises(DataMissingError, match="apt-get install fortunes"):
        workloads.load_fortunes(tmp_path)
    assert main(["ttr", "--problems", "fortunes_gpt", "--data-root", str(tmp_path)]) == 2


def test_the_loader_reads_root_fortunes_first(tmp_path, monkeypatch):
    sums = _tiny_corpus(tmp_path / "fortunes")
    monkeypatch.setattr(workloads, "FORTUNES_MD5", sums)
    monkeypatch.setattr(workloads, "DEBIAN_FORTUNES", tmp_path / "nowhere")
    data = workloads.load_fortunes(tmp_path)
    splits = workloads.text_splits(data, eval_size=1)
    assert len(splits.test) == 1 and splits.test.x.dtype == torch.int64
    assert len(splits.train) == (len(data.train) - 1) // 64


def test_fetch_data_copies_the_corpus_from_the_installed_package(tmp_path, monkeypatch):
    from experiments import fetch_data

    sums = _tiny_corpus(tmp_path / "system")
    monkeypatch.setattr(fetch_data, "FORTUNES_MD5", sums)
    monkeypatch.setattr(fetch_data, "DEBIAN_FORTUNES", tmp_path / "system")
    assert "copied 2 files" in fetch_fortunes(tmp_path / "root", apt=False)
    assert (tmp_path / "root" / "fortunes" / "beta").read_bytes() == (
        tmp_path / "system" / "beta"
    ).read_bytes()
    assert "present" in fetch_fortunes(tmp_path / "root", apt=False)
    monkeypatch.setattr(fetch_data, "DEBIAN_FORTUNES", tmp_path / "none")
    assert "MISSING" in fetch_fortunes(tmp_path / "other", apt=False)


def test_the_installed_corpus_is_the_documented_one():
    try:
        folder, _ = workloads.fortunes_folder(workloads.default_root())
    except DataMissingError:
        pytest.skip("Debian's fortunes is not installed (apt-get install fortunes)")
    train, valid = workloads.read_corpus(folder)
    assert (len(train), len(valid)) == (2_290_680, 262_518)
    digests = tuple(hashlib.md5(t.encode("ascii")).hexdigest() for t in (train, valid))
    assert digests == workloads.TEXT_MD5


def test_the_models_shapes_and_the_metrics():
    gpt = get_problem("fortunes_gpt")
    model = gpt.model(0)
    assert sum(p.numel() for p in model.parameters()) == 429_664
    ids = torch.randint(0, 96, (3, 64))
    logits = model(ids)
    assert logits.shape == (3, 96, 64)
    # causal: the logits of position t do not depend on later characters
    changed = ids.clone()
    changed[:, 40:] = (changed[:, 40:] + 1) % 96
    torch.testing.assert_close(model(changed)[:, :, :40], logits[:, :, :40])
    split = workloads.Split(ids, torch.randint(0, 96, (3, 64)))
    bits = workloads.bits_per_character(model, gpt.loss(), split, 2, gpt.preprocess())
    nats = gpt.loss()(logits, split.y).item()
    assert bits == pytest.approx(nats / math.log(2), rel=1e-5)

    ae = get_problem("mnist_autoencoder")
    model = ae.model(0)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    assert [m.in_features for m in linears] == [784, 1000, 500, 250, 30, 250, 500, 1000]
    assert [m.out_features for m in linears][3] == 30 and linears[-1].out_features == 784
    assert sum(isinstance(m, nn.Sigmoid) for m in model) == 6  # not after the code nor output
    # Martens's sparse initialisation: 15 nonzero incoming weights per unit, biases 0
    for m in linears:
        assert ((m.weight != 0).sum(1) == 15).all() and not m.bias.any()
    x = torch.randint(0, 256, (5, 1, 28, 28), dtype=torch.uint8)
    split = workloads.Split(x, x.flatten(1).float() / 255)
    err = workloads.squared_error_per_image(model, ae.loss(), split, 2, ae.preprocess())
    out = torch.sigmoid(model(x.float() / 255))
    assert err == pytest.approx(((out - split.y) ** 2).sum().item() / 5, rel=1e-5)
    assert isinstance(ae.loss(), nn.BCEWithLogitsLoss)


def test_lower_is_better_targets_and_their_calibration():
    for name in WORKLOADS:
        assert TTR_PROBLEMS[name].lower_is_better and get_problem(name).lower_is_better
    with pytest.raises(ValueError, match="descending"):
        TtrProblem(targets=(1.5, 1.6), max_steps=10, lower_is_better=True)
    run = RunResult({}, 0, {}, {}, "capped")
    run.curve = [[0, 0.0, 4.5], [25, 1.0, 1.934], [50, 2.0, 2.2]]
    assert proposed_targets(run, lower_is_better=True) == (2.06, 1.96)


def test_every_workload_and_new_peer_has_a_grid_of_4():
    for problem in ("fmnist_2c2d", "fmnist_vit", *WORKLOADS):
        for name in NEW_PEERS:
            sizes = [s.batch_size for s in GRIDS[problem][name]]
            assert all(sizes.count(b) == 4 for b in sizes)
    for problem in WORKLOADS:
        batch = get_problem(problem).batch_size
        assert {s.batch_size for g in GRIDS[problem].values() for s in g} == {batch}
    assert "adamw_lr_ratio" in allowed_options("muon")


@pytest.mark.parametrize("name", NEW_PEERS)
def test_each_new_peer_builds_and_steps_a_tiny_model(eager, name):
    if name != "muon":
        pytest.importorskip("heavyball")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    groups = get_problem("mnist_logreg").param_groups(model)
    opt = peers.build_peer(name, groups, 0.01, model=model)
    before = [p.detach().clone() for p in model.parameters()]
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert losses[-1] < losses[0]


def test_torch_muon_gets_the_hidden_linear_weights_and_adamw_the_rest():
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.Flatten(), nn.Linear(8, 5), nn.LayerNorm(5), nn.Linear(5, 3)
    )
    groups = get_problem("mnist_logreg").param_groups(model)
    opt = peers.build_peer("muon", groups, 0.02, model=model)
    muon = [p for g in opt.muon.param_groups for p in g["params"]]
    adamw = [p for g in opt.adamw.param_groups for p in g["params"]]
    assert len(muon) == 1 and muon[0] is model[2].weight
    assert len(adamw) == sum(1 for _ in model.parameters()) - 1
    assert all(g["lr"] == pytest.approx(0.002) for g in opt.adamw.param_groups)
    assert all(g["weight_decay"] == 0.0 for g in opt.param_groups)
    # the protocol's schedule scales every group's lr: both parts move
    for g in opt.param_groups:
        g["lr"] *= 0.5
    assert opt.muon.param_groups[0]["lr"] == 0.01
    assert opt.adamw.param_groups[0]["lr"] == pytest.approx(0.001)
    with pytest.raises(ValueError, match="needs the model"):
        peers.build_peer("muon", groups, 0.02)


@pytest.mark.parametrize("problem", WORKLOADS)
def test_quick_ttr_on_a_new_workload(problem, tmp_path):
    """``ttr --quick`` on synthetic data: Adam (its calibration where the targets are not fixed
    yet), torch's Muon and heavyball's MuonAdamW (eager: a smoke run compiles nothing), 4 steps
    of the first setting, one seed."""
    if not TTR_PROBLEMS[problem].targets:
        optimizers = ["adam"]
    else:
        optimizers = ["adam", "muon"]
        if importlib.util.find_spec("heavyball") is not None:
            optimizers.append("muon_adamw")
    args = ["ttr", "--quick", "--synthetic", "--problems", problem, "--json", str(tmp_path)]
    args += ["--max-steps", "4", "--eval-every", "2", "--eval-size", "16", "--settings", "0"]
    assert main(args + ["--optimizers", *optimizers]) == 0
    for optimizer in optimizers:
        files = [tmp_path / f"{problem}_{optimizer}{end}.json" for end in ("", "_calibration")]
        assert sum(f.is_file() for f in files) == 1
        entry = json.loads(next(f for f in files if f.is_file()).read_text())
        assert len(entry["runs"]) == 1 and entry["runs"][0]["steps"] == 4
        curve = entry["runs"][0]["curve"]
        assert [s for s, _, _ in curve] == [0, 2, 4] and all(v > 0 for _, _, v in curve)
        assert entry["spec"]["lower_is_better"] is True
        if optimizer == "muon_adamw":
            info = entry["runs"][0]["compile"]
            assert info["compiled"] is False and info["failures"] == {}
    assert peers.COMPILE_MODES  # restored after the smoke run


def test_klsoap_runs_eager_on_the_cpu_without_trying_to_compile(monkeypatch):
    pytest.importorskip("heavyball")

    def no_probe(*args):
        raise AssertionError("KLSOAP was compiled on the CPU")

    monkeypatch.setattr(peers, "_probe", no_probe)
    w = nn.Parameter(torch.randn(6, 4))
    opt = peers.build_peer("klsoap", [{"params": [w]}], lr=1e-3)
    info = peers.compile_info(opt)
    assert info["compiled"] is False and set(info["failures"]) == set(peers.COMPILE_MODES)
    before = w.detach().clone()
    for _ in range(2):  # SOAP's first step only sets up its bases
        w.grad = torch.randn(6, 4)
        opt.step()
    assert not torch.equal(w, before)


def test_eigen_adams_grid_is_adams_doubled_at_each_problems_batch_size():
    """``eigen_adam``: 4 settings around Adam's winner (2e-3, 4e-3 constant, 4e-3, 8e-3 with
    warm-up + cosine), the basis every 10 steps, no damping, at the problem's batch size."""
    for problem in (*WORKLOADS, "fmnist_2c2d"):
        grid = GRIDS[problem]["eigen_adam"]
        assert [(s.lr, s.schedule) for s in grid] == [
            (2e-3, "constant"),
            (4e-3, "constant"),
            (4e-3, "warmup_cosine"),
            (8e-3, "warmup_cosine"),
        ]
        assert {s.batch_size for s in grid} == {get_problem(problem).batch_size}
        assert all(s.damping is None and s.preset is None for s in grid)
        assert all(dict(s.options) == {"basis_interval": 10} for s in grid)
    assert "basis_interval" in allowed_options("eigen_adam")


def test_the_autoencoders_kfac_grids_are_the_others_per_unit_of_the_reduction_scale():
    """The autoencoder's KFAC grids hold the GPT's values (set for per-sample averages), given
    per unit of the loss's reduction scale (``reduction_scaled``): ``λ s`` and ``κ s`` with
    ``s = 1/784`` for its per-pixel mean. A step of the README's setting is the step of the
    damping and ``kl_clip`` divided by 784 by hand, as the committed runs were given them."""
    from experiments.optimizers import make_optimizer

    problem = get_problem("mnist_autoencoder")
    for name in ("kfac", "sf_kfac", "kfac_ns"):
        scaled, plain = GRIDS["mnist_autoencoder"][name], GRIDS["fortunes_gpt"][name]
        assert len(scaled) == len(plain) == 4
        for s, p in zip(scaled, plain):
            assert (s.lr, s.damping, s.preset, s.schedule) == (
                p.lr,
                p.damping,
                p.preset,
                p.schedule,
            )
            assert dict(s.options) == {**dict(p.options), "reduction_scaled": True}
    readme = next(s for s in GRIDS["mnist_autoencoder"]["kfac"] if s.damping == 1e-3)
    by_hand = replace(readme, damping=1e-3 / 784, options=(("kl_clip", 1e-3 / 784),))
    x = torch.rand(8, 784, generator=torch.Generator().manual_seed(0))
    steps, dampings = [], []
    for setting in (readme, by_hand):
        model, lossfunc = problem.model(0), problem.loss()
        opt, _ = make_optimizer(setting.config("mnist_autoencoder", 0), problem, model, lossfunc)
        before = [p.detach().clone() for p in model.parameters()]
        torch.manual_seed(1)  # the Monte-Carlo draws
        lossfunc(model(x), x).backward()
        opt.step()
        dampings.append(type(opt.param_groups[0]["damping"]).__name__)
        steps.append(
            torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())])
        )
    assert dampings == ["ReductionScaledDamping", "float"]
    assert steps[0].abs().max() > 0
    torch.testing.assert_close(steps[0], steps[1], rtol=1e-4, atol=1e-9)


def test_kfac_with_damping_and_kl_clip_over_the_terms_steps_as_on_the_per_sample_loss():
    """The rule behind the autoencoder's grids: KFAC (trace-norm damping, trust region,
    momentum) on a loss averaged over ``P`` terms per sample with ``λ / P`` and ``κ / P`` takes
    the steps it takes on the summed loss with ``λ N`` and ``κ N``, i.e. on the per-sample loss
    with ``λ`` and ``κ`` (float64, exact factors)."""
    import copy

    import curvopt
    import curvopt.optim

    n, p, lam, kappa = 8, 6, 0.05, 1e-4
    torch.manual_seed(0)
    x, y = torch.randn(n, 5, dtype=torch.float64), torch.rand(n, p, dtype=torch.float64)
    init = nn.Sequential(nn.Linear(5, 7), nn.Sigmoid(), nn.Linear(7, p)).double()

    def train(reduction: str, damping: float, clip: float) -> list[torch.Tensor]:
        model = curvopt.extend(copy.deepcopy(init))
        lossfunc = curvopt.extend(nn.BCEWithLogitsLoss(reduction=reduction))
        opt = curvopt.optim.KFAC(
            model.parameters(), 0.5, damping, curvature="kflr", kl_clip=clip, momentum=0.9
        )
        for _ in range(3):
            opt.zero_grad()
            lossfunc(model(x), y).backward()
            opt.step()
        return [q.detach().clone() for q in model.parameters()]

    per_term = train("mean", lam / p, kappa / p)
    summed = train("sum", lam * n, kappa * n)
    for a, b in zip(per_term, summed):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    assert not all(torch.equal(a, b) for a, b in zip(per_term, train("mean", lam, kappa)))


@pytest.mark.parametrize("problem", WORKLOADS)
def test_eigen_adam_takes_a_step_of_each_setting_on_a_workload(problem, tmp_path):
    """``ttr --quick`` of ``eigen_adam``'s whole grid on synthetic data, 1 step each."""
    args = ["ttr", "--quick", "--synthetic", "--problems", problem, "--json", str(tmp_path)]
    args += ["--max-steps", "1", "--eval-every", "1", "--eval-size", "8"]
    assert main(args + ["--optimizers", "eigen_adam"]) == 0
    entry = json.loads((tmp_path / f"{problem}_eigen_adam.json").read_text())
    assert len(entry["tuning"]) == 4
    for run in entry["tuning"]:
        assert run["steps"] == 1 and run["status"] == "capped"
        assert all(math.isfinite(v) and v > 0 for _, _, v in run["curve"])
