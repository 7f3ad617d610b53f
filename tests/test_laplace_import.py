"""``curvopt.laplace`` is optional: ``import curvopt`` does not load laplace-torch, and without
laplace-torch ``import curvopt.laplace`` raises an ImportError that says what to install (one
fresh interpreter, with ``laplace`` blocked after ``import curvopt`` is checked)."""

import subprocess
import sys

_WITHOUT_LAPLACE = """
import sys
import curvopt
print("laplace" in sys.modules, "curvopt.laplace" in sys.modules)
sys.modules["laplace"] = None  # as if laplace-torch were not installed
try:
    import curvopt.laplace
except ImportError as error:
    print(error)
else:
    raise SystemExit("imported without laplace-torch")
"""


def test_optional_import():
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_LAPLACE], capture_output=True, text=True, check=True
    )
    first, message = done.stdout.split("\n", 1)
    assert first.split() == ["False", "False"]  # import curvopt loads neither
    assert "pip install --no-deps laplace-torch==0.3" in message
