"""``curvopt.laplace`` is optional: ``import curvopt`` does not load laplace-torch, and without
laplace-torch ``import curvopt.laplace`` raises an ImportError that says what to install."""

import subprocess
import sys

_WITHOUT_LAPLACE = """
import sys
sys.modules["laplace"] = None  # as if laplace-torch were not installed
import curvopt
assert "curvopt.laplace" not in sys.modules
try:
    import curvopt.laplace
except ImportError as error:
    print(error)
else:
    raise SystemExit("imported without laplace-torch")
"""


def test_optional_import_names_the_install():
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_LAPLACE], capture_output=True, text=True, check=True
    )
    assert "pip install --no-deps laplace-torch==0.3" in done.stdout


def test_curvopt_does_not_import_laplace():
    code = "import sys, curvopt; print('laplace' in sys.modules, 'curvopt.laplace' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]
