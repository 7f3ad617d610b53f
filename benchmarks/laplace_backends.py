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
from collections import UserDict

import torch
import torch.nn.functional as F
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
from torch.utils.data import DataLoader, Dataset, TensorDataset

from curvopt.laplace import CurvoptEF, CurvoptGGN

VOCAB, LENGTH, WIDTH, CLASSES, N = 16, 8, 16, 4, 64

BACKENDS = {
    "curvopt": (CurvoptGGN, CurvoptEF),
    "backpack": (BackPackGGN, BackPackEF),
    "curvlinops": (CurvlinopsGGN, CurvlinopsEF),
    "asdl": (AsdlGGN, AsdlEF),
}


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, h):
        q, k, v = self.qkv(h).reshape(*h.shape[:2], 3, 2, WIDTH // 2).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(a.transpose(1, 2).reshape(h.shape))


class Transformer(nn.Module):
    """One pre-norm block, mean pooled; ``tied``: the head is the token embedding."""

    def __init__(self, tied=False):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(LENGTH, WIDTH)
        self.norm1, self.norm2, self.attn = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH), Attention()
        self.mlp = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, WIDTH))
        self.head = nn.Linear(WIDTH, VOCAB if tied else CLASSES, bias=not tied)
        if tied:
            self.head.weight = self.tok.weight

    def forward(self, idx):
        h = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        h = h + self.attn(self.norm1(h))
        return self.head((h + self.mlp(self.norm2(h))).mean(1))


class GPT2Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        import transformers

        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=LENGTH, n_embd=WIDTH, n_layer=1, n_head=2,
            n_inner=WIDTH, num_labels=CLASSES, pad_token_id=0, bos_token_id=1, eos_token_id=1,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        self.hf = transformers.GPT2ForSequenceClassification(config)

    def forward(self, data):
        return self.hf(input_ids=data["input_ids"], attention_mask=data["attention_mask"]).logits


class Dicts(Dataset):
    def __init__(self, ids, mask, labels):
        self.ids, self.mask, self.labels = ids, mask, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def collate(items):
    return UserDict({k: torch.stack([item[k] for item in items]) for k in items[0]})


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
            model = GPT2Classifier().eval()
            loader = DataLoader(Dicts(idx * mask, mask, labels), batch, collate_fn=collate)
            return model.double(), loader
        model, data = Transformer(tied=name == "tied"), TensorDataset(idx, labels)
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
