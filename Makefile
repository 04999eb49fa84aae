# openlab: two commands on a fresh machine — `make demo` and `make test`.
#
# Everything the project needs is installed from here: the virtualenv and its
# packages, and (for tests) the real services they use, started by infra/services.sh.

SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.openlab-installed
INFRA_STATE ?= $(or $(OPENLAB_INFRA_STATE),/var/tmp/openlab-infra)
PYTEST_ARGS ?=
# Three pytest-xdist workers on two cores: with two, a core sat idle 17% of the run while tests waited
# on a job, a server or a container (18 min 17 s; three: 17 min 13 s, the CPU busy throughout). The
# Slurm tests run as one unit on one worker, as do those of the Prefect server (tests/conftest.py).
# PYTEST_WORKERS=0 runs everything in one process.
PYTEST_WORKERS ?= 3
# `make test` ends with the 15 slowest tests, so every CI log says where the suite's time goes.
BENCH_ARGS ?=

export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: install demo test test-fast lint bench services-up services-down clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# The CPU build of torch first: a bare `torch` requirement would pull the CUDA build (GBs).
	$(PIP) install --quiet "torch==2.13.0"
	$(PIP) install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) -m orchestrator.demo

services-up:
	OPENLAB_INFRA_STATE=$(INFRA_STATE) bash infra/services.sh up

services-down:
	OPENLAB_INFRA_STATE=$(INFRA_STATE) bash infra/services.sh down

test: install services-up
	set -a; [ -f $(INFRA_STATE)/services.env ] && . $(INFRA_STATE)/services.env; set +a; \
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && \
	$(PY) -m pytest -q -rs -n $(PYTEST_WORKERS) --durations=40 $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -q -rs -m "not slow" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# Benchmarks compare against docker and sbatch, so the same services as the tests are started.
bench: install services-up
	set -a; [ -f $(INFRA_STATE)/services.env ] && . $(INFRA_STATE)/services.env; set +a; \
	$(PY) benchmarks/run_all.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
