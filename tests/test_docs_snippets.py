"""Every python block of the documentation pages runs (issue: "every code block is run").

Each block of ``docs/*.md`` runs in a fresh namespace after :data:`PREAMBLE` (the small
extended model, loss and batch the pages write ``model``, ``lossfunc``, ``X``, ``y`` and
``loader`` for, and DP-SGD's ``C`` and ``sigma``), in a scratch folder. Two kinds are not run
here, each for its reason:

* the framework loops (Lightning, the Hugging Face Trainer, accelerate): their code lines are
  those of a README block that ``tests/test_frameworks_*.py`` runs inside its framework
  (checked here line by line, comments aside);
* a block that says in its first line that it is not run (``torchrun``'s ranks).
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md"))
NOT_RUN = "# not run by tests/test_docs_snippets.py"

PREAMBLE = """
import torch, curvopt
from torch import nn
import torch.nn.functional as F
from curvopt import extensions as ext
torch.manual_seed(0)
model = curvopt.extend(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)))
lossfunc = curvopt.extend(nn.CrossEntropyLoss())
X, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
loader = [(X[:8], y[:8]), (X[8:], y[8:])]
C, sigma = 1.0, 0.5  # DP-SGD's clipping norm and noise multiplier, as the prose names them
"""

#: first line of a framework loop -> the test that runs the README's copy in the framework
FRAMEWORKS = {
    "# Lightning": "tests/test_frameworks_lightning.py",
    "# the Hugging Face Trainer": "tests/test_frameworks_hf.py",
    "# accelerate": "tests/test_frameworks_accelerate.py",
}


def _blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


def _code(block: str) -> list[str]:
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


BLOCKS = [
    pytest.param(block, id=f"{page.name}:{index}")
    for page in PAGES
    for index, block in enumerate(_blocks(page))
]


@pytest.mark.parametrize("block", BLOCKS)
def test_block_runs(block, tmp_path, monkeypatch):
    framework = next((key for key in FRAMEWORKS if block.startswith(key)), None)
    if framework is not None:
        runner = (ROOT / FRAMEWORKS[framework]).read_text()
        assert f'readme_snippet("{framework}")' in runner, FRAMEWORKS[framework]
        readme = [b for b in _blocks(ROOT / "README.md") if b.startswith(framework)]
        assert [_code(b) for b in readme] == [_code(block)], "the README's copy differs"
        return
    if block.startswith(NOT_RUN):
        assert ":" in block.splitlines()[0], "say why it is not run"
        return
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(PREAMBLE, "preamble", "exec"), scope)  # noqa: S102
        exec(compile(block, "docs block", "exec"), scope)  # noqa: S102
