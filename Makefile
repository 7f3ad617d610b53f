# Set-up and entry points. Every target creates the virtual environment on first use.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install run ttr test bench data lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# CPU build of torch first (an unpinned torch would pull a multi-GB CUDA build)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[dev,experiments]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)  ## the main job: budgeted reproduction of the BackPACK paper on real data
	$(PY) -m experiments reproduce

ttr: $(STAMP)  ## time-to-result benchmark (~25 min on one core), results and figures
	OMP_NUM_THREADS=1 nice $(PY) -m experiments ttr --out experiments/results
	$(PY) -m paper_figs ttr experiments/results experiments/results

test: $(STAMP)  ## the unit tests
	OMP_NUM_THREADS=2 $(PY) -m pytest tests

bench: $(STAMP)  ## overhead benchmarks (pytest-benchmark) and the ratio table
	$(PY) -m pytest benchmarks --benchmark-only
	$(PY) -m experiments overhead

data: $(STAMP)  ## fetch the real data sets that can be fetched here
	$(PY) -m experiments fetch_data

lint: $(STAMP)
	$(PY) -m ruff check curvopt tests experiments

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks
