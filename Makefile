# Set-up and entry points. Every target creates the virtual environment on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install reference run ttr test bench data lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# CPU build of torch first (an unpinned torch would pull a multi-GB CUDA build)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev,experiments]"
	touch $(STAMP)

install: $(STAMP)

# BackPACK 1.7.1, Opacus 1.6.0 and curvlinops 3.0.1 for the comparisons (experiments overhead,
# benchmarks/), without replacing the CPU torch: their pure-python dependencies from the
# "reference" extra, the libraries themselves without dependencies (torchvision, which BackPACK
# declares and curvlinops pulls in through it, would bring a CUDA torch; no import needs it).
# The Opacus wheel also installs top-level "benchmarks" and "examples" folders that are not part
# of the library: removed.
reference: $(STAMP)  ## BackPACK, Opacus, curvlinops for the comparison columns (keeps the CPU torch)
	$(PY) -m pip install --quiet -e ".[dev,experiments,reference]"
	$(PY) -m pip install --quiet --no-deps backpack-for-pytorch==1.7.1 opacus==1.6.0 \
	    curvlinops-for-pytorch==3.0.1
	SP=$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
	    rm -rf "$$SP/benchmarks" "$$SP/examples"
	$(PY) -c 'import torch, backpack, opacus, curvlinops; from importlib.metadata import version as v; \
	    print("torch", torch.__version__, "backpack", v("backpack-for-pytorch"), "opacus", v("opacus"), \
	    "curvlinops", v("curvlinops-for-pytorch"))'

run: $(STAMP)  ## the main job: budgeted reproduction of the BackPACK paper on real data
	$(PY) -m experiments reproduce

ttr: $(STAMP)  ## time-to-result benchmark (hours on one core), cost per step, table and figure
	OMP_NUM_THREADS=1 nice $(PY) -m experiments ttr --json experiments/results/ttr
	OMP_NUM_THREADS=1 $(PY) -m experiments ttr_cost --from experiments/results/ttr
	$(PY) -m paper_figs ttr experiments/results/ttr experiments/results/ttr

test: $(STAMP)  ## the unit tests
	OMP_NUM_THREADS=2 $(PY) -m pytest tests

bench: $(STAMP)  ## overhead benchmarks (pytest-benchmark) and the ratio table
	$(PY) -m pytest benchmarks --benchmark-only
	$(PY) -m experiments overhead

data: $(STAMP)  ## fetch the real data sets that can be fetched here
	$(PY) -m experiments fetch_data

lint: $(STAMP)
	$(PY) -m ruff check curvopt tests experiments benchmarks fixtures paper_figs

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks
