"""Why ``EKFAC`` does not train the tiny GPT from a badly scaled initialisation, measured.

    OMP_NUM_THREADS=1 python -m benchmarks.ekfac_badly_scaled [--seeds 0 1 2 3 4 5]
        [--settings readme|defaults] [--trust-metric ggn|correction]

The problem of ``tests/test_optim_defaults.py::test_readme_settings_train_a_badly_scaled_gpt``
(:func:`badly_scaled_gpt`, :func:`successor_task`): ``fixtures.zoo.GPT`` (vocabulary 32, width
64, 4 heads, 16 positions) with its tied embedding at ``nn.Embedding``'s default ``N(0, 1)``,
which ``zoo.GPT`` rescales: logits of order ``√64`` and a first loss of 39-47, the model sure of
wrong tokens.

Part 1 (seed 0, one batch of 16 sequences, at this initialisation and at ``zoo.GPT``'s own):

* per parameter, ``Σ S`` of the extension ``EKFAC(factors="kflr")`` (``S = diag(Qᵀ EF Q)``, the
  empirical Fisher ``EF`` at the observed targets) against ``Σ K``, ``K = diag(Q_Bᵀ B Q_B) ⊗
  diag(Q_Aᵀ A Q_A)`` the eigenvalue products of the ``KFLR`` factors (the GGN's ``KFAC``) in
  the same basis, and each one's ``gᵀ(C + λ)⁻¹ g`` at ``λ = 1e-3``, the trust region's model of
  the step (``C`` diagonal in the basis with ``S`` or ``K``);
* at the logits, the mean over positions of the traces of the cross-entropy's empirical Fisher
  ``|p − y|²`` and of its GGN ``Σ_c p_c (1 − p_c)``.

Part 2 (each seed): ``EKFAC`` with the README settings (``lr=0.05, damping=1e-3,
basis_interval=5``: the test's; ``--settings defaults``: ``lr=0.05`` alone; ``--trust-metric``:
its ``trust_metric``, by default the settings' own), 60 steps of batch
16 as the test trains; the loss on the 64 sequences at the start and the end, with ``S`` as the
optimizer computes it (the observed targets) and with ``S`` from targets drawn from the model's
softmax (the Fisher: the collecting backward pass on drawn targets, the step's gradient from a
second, uncollected pass on the observed ones).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import curvopt
from curvopt.extensions import EKFAC as EKFACExtension
from curvopt.extensions import KFLR
from curvopt.inversion.eigen_corrected import rotate
from curvopt.optim import EKFAC
from fixtures import zoo

VOCAB, LENGTH, WIDTH, HEADS = 32, 16, 64, 4
DAMPING = 1e-3


def badly_scaled_gpt(seed: int, badly_scaled: bool = True) -> nn.Module:
    """``zoo.GPT`` initialised at ``seed``, its tied embedding redrawn from ``N(0, 1)``
    (``badly_scaled``), not extended."""
    torch.manual_seed(seed)  # the initialisation (and the Monte-Carlo draws after it)
    model = zoo.GPT(vocab=VOCAB, d=WIDTH, heads=HEADS, t_max=LENGTH)
    if badly_scaled:
        nn.init.normal_(model.tok.weight)  # nn.Embedding's default, which zoo.GPT rescales
    return model


def successor_task(vocab: int, length: int, seed: int):
    """64 sequences of ``length + 1`` tokens following a random successor map (learnable: the
    next token is a function of the current one), as ``(inputs, targets)``."""
    generator = torch.Generator().manual_seed(1000 + seed)
    successor = torch.randperm(vocab, generator=generator)
    tokens = [torch.randint(0, vocab, (64,), generator=generator)]
    for _ in range(length):
        tokens.append(successor[tokens[-1]])
    tokens = torch.stack(tokens, 1)
    return tokens[:, :-1], tokens[:, 1:]


def _problem(seed: int, badly_scaled: bool = True):
    model = curvopt.extend(badly_scaled_gpt(seed, badly_scaled))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    X, y = successor_task(VOCAB, LENGTH, seed)
    return model, lambda a, b: lossfunc(model(a).reshape(-1, VOCAB), b.reshape(-1)), X, y


def scales(seed: int, badly_scaled: bool) -> None:
    """Part 1: ``Σ S`` against ``Σ K`` per parameter, the trust region's ``gᵀ(C + λ)⁻¹ g``
    with each, and the logits' traces of the empirical Fisher and the GGN."""
    model, loss_of, X, y = _problem(seed, badly_scaled)
    index = torch.randint(0, len(X), (16,), generator=torch.Generator().manual_seed(seed))
    X, y = X[index], y[index]
    with curvopt.collect(KFLR()):
        loss_of(X, y).backward()
    factors = {p: list(p.kflr) for p in model.parameters()}
    model.zero_grad()
    with curvopt.collect(EKFACExtension(factors="kflr")):
        loss = loss_of(X, y)
        loss.backward()
    print(f"first loss {loss.item():.1f} ({'N(0, 1)' if badly_scaled else 'zoo'} embedding)")
    print(f"{'parameter':24s} {'Σ S':>9s} {'Σ K':>9s} {'S/K':>7s} {'gᵀd (S)':>9s} {'gᵀd (K)':>9s}")
    totals = [0.0, 0.0]
    for name, p in model.named_parameters():
        correction, *bases = p.ekfac
        rotated = rotate(bases, p.grad.reshape(bases[0].shape[0], -1)) ** 2
        eigenvalues = [torch.diagonal(q.T @ f @ q) for q, f in zip(bases, factors[p])]
        products = eigenvalues[0][:, None] * (eigenvalues[1] if len(bases) == 2 else 1)
        model_steps = [float((rotated / (c + DAMPING)).sum()) for c in (correction, products)]
        totals = [t + m for t, m in zip(totals, model_steps)]
        ratio = float(correction.sum() / products.sum())
        print(
            f"{name:24s} {float(correction.sum()):9.3g} {float(products.sum()):9.3g} "
            f"{ratio:7.3g} {model_steps[0]:9.3g} {model_steps[1]:9.3g}"
        )
    print(f"{'total':24s} {'':29s} {totals[0]:9.3g} {totals[1]:9.3g}")
    with torch.no_grad():
        p = model(X).reshape(-1, VOCAB).softmax(-1)
    empirical = ((p - nn.functional.one_hot(y.reshape(-1), VOCAB)) ** 2).sum(-1).mean()
    ggn = (p * (1 - p)).sum(-1).mean()
    print(f"logits: EF trace {empirical:.3g}, GGN trace {ggn:.3g}, ratio {empirical / ggn:.3g}\n")


def train(
    seed: int, drawn_targets: bool, settings: str, trust_metric: str | None = None
) -> tuple[float, float]:
    """Part 2: the first and last loss on the 64 sequences after 60 steps of batch 16."""
    model, loss_of, X, y = _problem(seed)
    collection = "explicit" if drawn_targets else "auto"  # explicit: the second pass uncollected
    options = {"damping": DAMPING, "basis_interval": 5} if settings == "readme" else {}
    options["trust_metric"] = trust_metric
    opt = EKFAC(model.parameters(), 0.05, collection=collection, **options)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        first = loss_of(X, y).item()
    for _ in range(60):
        index = torch.randint(0, len(X), (16,), generator=generator)
        opt.zero_grad()
        targets = y[index]
        if drawn_targets:
            with torch.no_grad():
                probabilities = model(X[index]).softmax(-1)
            targets = torch.distributions.Categorical(probs=probabilities).sample()
        with opt.collect():
            loss_of(X[index], targets).backward()
        if drawn_targets:
            opt.zero_grad()
            loss_of(X[index], y[index]).backward()  # outside collect: the gradient only
        opt.step()
    with torch.no_grad():
        return first, loss_of(X, y).item()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(6)))
    parser.add_argument("--settings", choices=["readme", "defaults"], default="readme")
    parser.add_argument("--trust-metric", choices=["ggn", "correction"], default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for badly_scaled in (True, False):
        scales(0, badly_scaled)
    for drawn_targets in (False, True):
        runs = [train(seed, drawn_targets, args.settings, args.trust_metric) for seed in args.seeds]
        label = "drawn targets (Fisher)" if drawn_targets else "observed targets (EF, today)"
        print(f"S from {label}: " + " ".join(f"{f:.1f}->{last:.3g}" for f, last in runs))


if __name__ == "__main__":
    main()
