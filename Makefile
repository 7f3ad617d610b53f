# Set-up and entry points. Every target creates the virtual environment on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
EXTRAS := $(VENV)/.extras

.PHONY: install reference run ttr ttr-quick test browser bench data lint docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --progress-bar off --upgrade pip
	# CPU build of torch first (an unpinned torch would pull a multi-GB CUDA build)
	$(PY) -m pip install --progress-bar off torch==2.13.0
	$(PY) -m pip install --progress-bar off -e ".[dev,experiments]"
	touch $(STAMP)

install: $(STAMP)

# The test and comparison extras, without replacing the CPU torch: BackPACK 1.7.1, Opacus 1.6.0
# and curvlinops 3.0.1 (the overhead comparisons, references in the tests), laplace-torch 0.3
# with its ASDL (the laplace backend's tests), heavyball 3.2.1 (SOAP, PSGD-Kron in the
# time-to-result benchmark), the "frameworks" extra (Lightning, accelerate, schedule-free) and
# the "docs" extra (Sphinx and Furo: `make docs`, and the test that builds the site), timm
# 1.0.31 (its models in the tests; torchvision, which it declares, is stood in for by
# tests/timm_loader.py).
# Their pure-python dependencies come from the "reference" and "frameworks" extras, the
# libraries themselves without dependencies: BackPACK and laplace-torch declare torchvision,
# which would bring a CUDA build of torch; no import needs it. The Opacus wheel also installs
# top-level "benchmarks" and "examples" folders that are not part of the library: removed.
$(EXTRAS): $(STAMP)
	$(PY) -m pip install --progress-bar off -e ".[dev,experiments,reference,frameworks,docs]"
	$(PY) -m pip install --progress-bar off --no-deps backpack-for-pytorch==1.7.1 opacus==1.6.0 \
	    curvlinops-for-pytorch==3.0.1 laplace-torch==0.3 asdfghjkl==0.1a4 heavyball==3.2.1 \
	    timm==1.0.31
	SP=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	    rm -rf "$$SP/benchmarks" "$$SP/examples"
	$(PY) -c 'import torch, backpack, opacus, curvlinops, laplace, heavyball, pytorch_lightning, \
	    accelerate, schedulefree; from importlib.metadata import version as v; \
	    print("torch", torch.__version__, *(f"{m} {v(m)}" for m in ("backpack-for-pytorch", \
	    "opacus", "curvlinops-for-pytorch", "laplace-torch", "heavyball", "pytorch-lightning", \
	    "accelerate", "schedulefree")))'
	touch $(EXTRAS)

reference: $(EXTRAS)  ## the test and comparison extras (peers, frameworks), keeping the CPU torch

run: $(STAMP)  ## the main job: budgeted reproduction of the BackPACK paper on real data
	$(PY) -m experiments reproduce

# The time-to-result benchmark on its five problems (MNIST logreg, FMNIST 2C2D, the ViT, the
# fortunes GPT, the MNIST autoencoder; days on one core), resumable: a run already in a result
# file of the same spec is taken from it. TTR_ARGS adds arguments (--problems, --optimizers).
ttr: $(EXTRAS)  ## time-to-result benchmark (days on one core), cost per step, table and figure
	OMP_NUM_THREADS=1 nice $(PY) -m experiments ttr --json experiments/results/ttr --resume $(TTR_ARGS)
	OMP_NUM_THREADS=1 $(PY) -m experiments ttr_cost --from experiments/results/ttr
	$(PY) -m paper_figs ttr experiments/results/ttr experiments/results/ttr

# Debian's chromium, for the documentation site's headless-browser test, which skips without it
# and says so. Installed system-wide, so only when asked for: `make browser` (as root; CI's
# .ci/run does), apt's output shown. `make test` installs nothing outside .venv.
browser:  ## Debian's chromium for the headless-browser test (apt-get, as root)
	@if command -v chromium >/dev/null; then echo "chromium is installed: $$(command -v chromium)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing Debian's chromium system-wide: apt-get install chromium"; \
	    apt-get update && apt-get install -y --no-install-recommends chromium; \
	else echo "chromium is missing: as root, run apt-get install chromium (the test skips)"; \
	    exit 1; fi

ttr-quick: $(EXTRAS)  ## smoke run of the benchmark: a few steps per setting, 1 seed, into /tmp
	OMP_NUM_THREADS=1 nice $(PY) -m experiments ttr --quick $(TTR_ARGS)

# The tests run in TEST_WORKERS processes (pytest-xdist), one torch thread each, a test file
# per process at a time (its module fixtures built once).
TEST_WORKERS ?= 2
test: $(EXTRAS)  ## the unit tests (with the extras, so that no comparison is skipped)
	OMP_NUM_THREADS=1 $(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile

bench: $(STAMP)  ## overhead benchmarks (pytest-benchmark) and the ratio table
	$(PY) -m pytest benchmarks --benchmark-only
	$(PY) -m experiments overhead

data: $(STAMP)  ## fetch the real data sets that can be fetched here
	$(PY) -m experiments fetch_data

# The gallery runs laplace-torch and Lightning: the site needs the test extras, Sphinx among them.
docs: $(EXTRAS)  ## the documentation site (offline, warnings as errors) into docs/_build/html
	OMP_NUM_THREADS=1 $(PY) -m sphinx -b html -W --keep-going docs docs/_build/html

lint: $(STAMP)
	$(PY) -m ruff check curvopt tests experiments benchmarks fixtures paper_figs

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks docs/_build docs/auto_examples
