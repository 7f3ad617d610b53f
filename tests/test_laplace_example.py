"""``examples/laplace_transformer.py``: its calibration metrics against hand-computed values,
and a short run of the whole script (train, KronLaplace fit, prior search, predictive)."""

import math

import pytest
import torch
from test_examples import _load

pytest.importorskip("laplace")
pytest.importorskip("sklearn")

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def test_nll_and_ece_by_hand():
    example = _load("laplace_transformer")
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.45, 0.55]])
    y = torch.tensor([0, 1, 1, 0])
    nll, ece = example.nll_and_ece(probs, y, bins=2)
    want_nll = -(math.log(0.9) + math.log(0.2) + math.log(0.7) + math.log(0.45)) / 4
    # bin (0.5, 1]: all four, confidence mean 0.7375, accuracy 2/4
    assert nll == pytest.approx(want_nll)
    assert ece == pytest.approx(abs(0.7375 - 0.5))


def test_short_run():
    example = _load("laplace_transformer")
    result = example.main(["--train", "60", "--val", "40", "--test", "40", "--epochs", "3"])
    for name in ("map", "laplace"):
        assert all(math.isfinite(v) for v in result[name]), name
    assert 0.1 <= result["prior_precision"] <= 1e7
