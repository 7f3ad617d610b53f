"""No two docs disagree on a convention: the EKFAC and Kronecker factor order, the attribute
each extension writes, and the fallback options, checked against each other and the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import curvopt
from curvopt import extensions as ext

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TEXT = {p.relative_to(ROOT).as_posix(): p.read_text() for p in PAGES}
EXTENSIONS = [name for name in ext.__all__ if name[0].isupper() and name not in
              {"Extension", "Quantity", "Kind", "Combine", "Producer"}]


def _near(text: str, start: int, words: tuple[str, ...], width: int = 300) -> bool:
    window = text[max(0, start - width): start + width]
    return any(w in window for w in words)


def test_ekfac_is_written_with_q_b_and_q_a():
    """``[S, Q_B, Q_A]`` (``[S, Q_B]`` for a bias); ``[S, Q_A, Q_B]`` only next to the layers
    whose first dimension is the input side; no other names for the bases."""
    allowed = {"[S, Q_B, Q_A]", "[S, Q_B]", "[S, Q_A, Q_B]", "[S, *bases]"}
    for name, text in TEXT.items():
        assert not re.search(r"Q_[01]\b", text), f"{name}: bases named Q_0/Q_1"
        for m in re.finditer(r"\[S, [^\]]*\]", text):
            found = re.sub(r"\s+", " ", m.group(0))
            assert found in allowed, f"{name}: {found}"
            if found == "[S, Q_A, Q_B]":
                assert _near(text, m.start(), ("Embedding", "Conv1D")), name


def test_kronecker_factor_order_is_b_then_a_except_input_first_layers():
    for name, text in TEXT.items():
        for m in re.finditer(r"`\[A, B\]`|\[A \(V×V\), B", text):
            assert _near(text, m.start(), ("Embedding", "Conv1D", "vocabulary")), name


def test_the_code_writes_the_documented_order():
    """Linear: ``kfac = [B, A]`` and ``ekfac = [S, Q_B, Q_A]``; Embedding: ``[A, B]`` and
    ``[S, Q_A, Q_B]`` with ``output_index == 1``; bias: ``[B]`` and ``[S, Q_B]``."""
    torch.manual_seed(0)
    model = curvopt.extend(nn.Sequential(nn.Embedding(7, 3), nn.Flatten(), nn.Linear(6, 4)))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    X, y = torch.randint(0, 7, (5, 2)), torch.randint(0, 4, (5,))
    with curvopt.collect(ext.EKFAC(), ext.KFAC()):
        lossfunc(model(X), y).backward()
    emb, weight, bias = model[0].weight, model[2].weight, model[2].bias
    shapes = lambda xs: [tuple(t.shape) for t in xs]
    assert shapes(weight.kfac) == [(4, 4), (6, 6)] and weight.kfac.output_index == 0
    assert shapes(weight.ekfac) == [(4, 6), (4, 4), (6, 6)]
    assert shapes(emb.kfac) == [(7, 7), (3, 3)] and emb.kfac.output_index == 1
    assert shapes(emb.ekfac) == [(7, 3), (7, 7), (3, 3)]
    assert shapes(emb.ekfac)[1 + emb.kfac.output_index] == (3, 3)  # the output-side basis
    assert shapes(bias.kfac) == [(4, 4)] and len(bias.ekfac) == 2


@pytest.mark.parametrize("name", EXTENSIONS)
def test_every_extension_is_documented_with_its_attribute(name):
    """The conventions table names every extension with the attribute it writes, and no page
    pairs the extension with another attribute."""
    attr = getattr(ext, name)().attr
    row = re.compile(rf"^\| `{name}\([^|]*\| `([a-z_0-9]+)`", re.M)
    found = {m.group(1) for text in TEXT.values() for m in row.finditer(text)}
    assert found, f"{name} is in no table"
    assert found == {attr}, f"{name} writes {attr}; the docs say {found}"


def test_attribute_mentions_are_real_attributes():
    """Every ``p.<attr>`` a page mentions for a quantity is one the extensions write."""
    attrs = {getattr(ext, n)().attr for n in EXTENSIONS}
    other = {"grad", "requires_grad", "numel", "shape", "dim", "data", "to"}
    other |= {"kfac_diagonal", "kflr_diagonal", "ekfac_diagonal"}  # the fallback diagonals
    for name, text in TEXT.items():
        for m in re.finditer(r"\bp\.([a-z_0-9]+)\b", text):
            word = m.group(1)
            following = text[m.end(): m.end() + 1]
            if word in attrs or word in other or word.endswith("_") or following in "(*":
                continue
            assert not re.fullmatch(r"(diag|batch|kf|ekfac|grad|sum|var)\w*", word), (name, word)


def _accepts_diagonal(cls) -> bool:
    try:
        cls(nn.Linear(2, 2).parameters(), lr=0.1, damping=0.1, fallback="diagonal")
    except ValueError:
        return False
    return True


def test_fallback_and_skip_unsupported_as_the_code_has_them():
    """A page shows ``Cls(..., fallback="diagonal")`` only for an optimizer that accepts it,
    calls it ``KFAC``'s alone only while the others refuse it, and offers ``skip_unsupported``
    only the values ``collect`` takes."""
    from curvopt import optim

    accepts = {n: _accepts_diagonal(getattr(optim, n)) for n in ("KFAC", "EKFAC", "DiagGGNNewton")}
    for name, text in TEXT.items():
        flat = re.sub(r"\s+", " ", text)
        for m in re.finditer(r"(\w+)\([^()`]*fallback=\"(\w+)\"", flat):
            cls, value = m.groups()
            assert value in {"sgd", "diagonal"}, (name, m.group(0))
            if value == "diagonal" and cls in accepts:
                assert accepts[cls], (name, m.group(0))
        if "(`KFAC` only)" in flat:
            assert not (accepts["EKFAC"] or accepts["DiagGGNNewton"]), (name, "KFAC only")
        for m in re.finditer(r"skip_unsupported=([^,)`\s]+)", flat):
            assert m.group(1) in {"True", "False", '"diagonal"'}, (name, m.group(0))
    curvopt.collect(ext.KFAC(), skip_unsupported="diagonal")
    curvopt.collect(ext.KFAC(), skip_unsupported=True)
