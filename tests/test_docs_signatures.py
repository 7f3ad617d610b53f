"""The constructor signatures that docs/optim.md shows are the optimizers' own: every argument
shown has the default it has in code (none where it has none, so ``damping`` does not look
required), in the order of ``inspect.signature``, and each line fits a code block (100
characters)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import curvopt

OPTIM = (Path(__file__).resolve().parents[1] / "docs" / "optim.md").read_text()
SIGNATURES = [
    block.strip()
    for block in re.findall(r"```text\n(.*?)```", OPTIM, re.S)
    if re.match(r"\w+\(params", block)
]


def _shown(signature: str) -> tuple[str, dict[str, object]]:
    """The class name and the arguments a signature block shows: name -> default (``inspect.
    Parameter.empty`` where none is shown); ``*`` and ``...`` left out."""
    name, args = signature.split("(", 1)
    args = " ".join(args.rsplit(")", 1)[0].split())
    call = ast.parse(f"f({args.replace('*,', '').replace(', ...', '')})").body[0].value
    shown = {a.id: inspect.Parameter.empty for a in call.args}
    shown.update({k.arg: ast.literal_eval(k.value) for k in call.keywords})
    return name, shown


def test_every_optimizer_with_a_heading_has_its_signature():
    names = {_shown(s)[0] for s in SIGNATURES}
    assert {"DiagGGNNewton", "KFAC", "EKFAC", "EigenAdam", "VarianceAdaptedSGD"} <= names


@pytest.mark.parametrize("signature", SIGNATURES, ids=lambda s: s.split("(")[0])
def test_signature_matches_the_code(signature):
    name, shown = _shown(signature)
    actual = inspect.signature(getattr(curvopt.optim, name)).parameters
    assert list(shown) == [p for p in actual if p in shown], "order"
    for arg, default in shown.items():
        assert actual[arg].default == default, (name, arg, actual[arg].default)
    assert all(len(line) <= 100 for line in signature.splitlines()), signature


def test_damping_is_shown_with_its_default():
    (kfac,) = [s for s in SIGNATURES if s.startswith("KFAC(")]
    assert "damping" in _shown(kfac)[1]
    assert _shown(kfac)[1]["damping"] is inspect.signature(curvopt.optim.KFAC).parameters[
        "damping"
    ].default
