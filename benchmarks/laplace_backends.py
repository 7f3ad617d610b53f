"""laplace-torch's ``Laplace(...).fit`` with each curvature backend: models x structures.

Models: an MLP and a CNN (what every backend supports), a transformer classifier (LayerNorm,
``scaled_dot_product_attention``), the same with its head tied to the token embedding, and Hugging
Face's ``GPT2ForSequenceClassification`` (1 layer, width 16) on dict batches with a padding mask.
Backends: curvopt (``curvopt.laplace``), BackPACK, curvlinops and ASDL, GGN (``--ef``: empirical
Fisher); structures ``full``, ``kron``, ``diag``; all weights, float64, one thread. Each cell is
the best fit time of ``--repeats`` fits (seconds) and the log marginal likelihood's relative
difference to curvopt's, or the exception the backend raises.

    python -m benchmarks.laplace_backends            # GGN; about a minute
    python -m benchmarks.laplace_backends --ef       # empirical Fisher
"""

from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch
from laplace import Laplace
from laplace.curvature import (
    AsdlEF,
    AsdlGGN,
    BackPackEF,
    BackPackGGN,
    CurvlinopsEF,
    CurvlinopsGGN,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from curvopt.laplace import CurvoptEF, CurvoptGGN
from fixtures.laplace_models import DictBatches, GPT2Classifier, Transformer, collate

VOCAB, LENGTH, WIDTH, CLASSES, N = 16, 8, 16, 4, 64

BACKENDS = {
    "curvopt": (CurvoptGGN, CurvoptEF),
    "backpack": (BackPackGGN, BackPackEF),
    "curvlinops": (CurvlinopsGGN, CurvlinopsEF),
    "asdl": (AsdlGGN, AsdlEF),
}


def problem(name: str, batch: int):
    """``(model, loader)`` on ``N`` random samples."""
    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, CLASSES))
        data = TensorDataset(torch.randn(N, 20), torch.randint(0, CLASSES, (N,)))
    elif name == "cnn":
        model = nn.Sequential(
            nn.Conv2d(1, 4, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64, CLASSES)
        )
        data = TensorDataset(torch.randn(N, 1, 8, 8), torch.randint(0, CLASSES, (N,)))
    else:
        idx = torch.randint(1, VOCAB, (N, LENGTH))
        labels = torch.randint(0, VOCAB if name == "tied" else CLASSES, (N,))
        if name == "gpt2":
            mask = (torch.arange(LENGTH) < torch.randint(2, LENGTH + 1, (N, 1))).long()
            model = GPT2Classifier(VOCAB, LENGTH, WIDTH, CLASSES).eval()
            loader = DataLoader(DictBatches(idx * mask, mask, labels), batch, collate_fn=collate)
            return model.double(), loader
        model = Transformer(VOCAB, LENGTH, WIDTH, CLASSES, tied=name == "tied")
        data = TensorDataset(idx, labels)
    model = model.double()
    data = TensorDataset(*(t.double() if t.is_floating_point() else t for t in data.tensors))
    return model, DataLoader(data, batch_size=batch)


def fit(model, loader, structure, backend, repeats):
    """``(best fit time in s, log marginal likelihood)``."""
    best, la = float("inf"), None
    for _ in range(repeats):
        la = Laplace(
            copy.deepcopy(model), "classification", subset_of_weights="all",
            hessian_structure=structure, backend=backend,
        )  # fmt: skip
        start = time.perf_counter()
        la.fit(loader)
        best = min(best, time.perf_counter() - start)
    return best, float(la.log_marginal_likelihood())


def cell(result, reference) -> str:
    if isinstance(result, Exception):
        return f"`{type(result).__name__}`"
    seconds, lml = result
    if reference is None or isinstance(reference, Exception):
        return f"{seconds:.3f} s (LML {lml:.4g})"
    return f"{seconds:.3f} s (ΔLML {abs(lml - reference[1]) / abs(reference[1]):.0e})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ef", action="store_true", help="empirical Fisher backends")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="mlp,cnn,transformer,tied,gpt2")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    kind = 1 if args.ef else 0
    print(f"| model | structure | {' | '.join(BACKENDS)} |")
    print("|---|---|" + "---|" * len(BACKENDS))
    for name in args.models.split(","):
        model, loader = problem(name, args.batch)
        for structure in ("full", "kron", "diag"):
            results = {}
            for backend, classes in BACKENDS.items():
                try:
                    results[backend] = fit(model, loader, structure, classes[kind], args.repeats)
                except Exception as error:  # a backend that cannot run the model: its error
                    results[backend] = error
            reference = results["curvopt"]
            cells = [cell(r, None if b == "curvopt" else reference) for b, r in results.items()]
            print(f"| {name} | {structure} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
