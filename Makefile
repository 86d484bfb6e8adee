# Set up and run, in one command each (README.md "Try it"):
#   make demo   creates .venv, installs the project with its extras, runs `aggsrv simulate`
#   make test   the same set-up, Fashion-MNIST where it can, then the tests (.ci/run runs this)
#   make api    the API reference, HTML under build/api
# Each step runs once: a second `make test` finds .venv installed (again only when pyproject.toml
# changed) and the data set in place, and goes straight to the tests.
#
# Knobs: PYTHON (the interpreter that makes .venv), TORCH_INDEX (a pip index to take the CPU
# build of torch from, where pip's own configuration does not find one), PYTEST_ARGS.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
TORCH_INDEX ?=
EXTRAS := dev,sim,flower,dp,nvflare
# Two workers (pytest-xdist): most tests wait on servers and subprocesses, so two share 2 cores
# well. `make test PYTEST_ARGS="-q tests/server"` runs a part on one; benchmarks run on one
# (pytest-benchmark turns itself off under xdist).
PYTEST_ARGS ?= -n 2
# The Debian package dataset-fashion-mnist installs this file; the data tests skip without it.
FASHION_MNIST := /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz
STAMP := $(VENV)/.aggsrv-installed

.PHONY: demo test setup dataset services api

demo: setup
	$(BIN)/aggsrv simulate

test: setup dataset services
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The API reference (pdoc) as HTML under build/api; warnings fail it.
api: setup
	$(BIN)/python -m aggsrv.api_reference build/api

setup: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# A bare `torch` requirement resolves to a multi-GB CUDA build, so a machine without a GPU (no
# nvidia-smi) gets a CPU build of torch first; with a GPU the project's install pulls in torch
# and its matching Triton. One resolution for every extra, so the Flower pins and ours agree.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
	    $(BIN)/python -m pip install $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "$(TORCH)"; \
	fi
	$(BIN)/python -m pip install -e ".[$(EXTRAS)]"
	touch $@

# Fashion-MNIST for the data tests: installed with apt-get when we are root, else a note.
dataset:
	@if [ -f $(FASHION_MNIST) ]; then \
	    :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get install -y -q dataset-fashion-mnist \
	        || (apt-get update -q && apt-get install -y -q dataset-fashion-mnist); \
	else \
	    echo "note: dataset-fashion-mnist is not installed (apt-get install it as root);" \
	        "the Fashion-MNIST tests will skip"; \
	fi

# What the page and metrics tests drive: a headless browser and a real Prometheus (Debian's
# packages; as root only, else those tests skip, saying why).
SERVICES := chromium chromium-driver prometheus
services:
	@if command -v chromedriver >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then \
	    :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(SERVICES) \
	        || (apt-get update -q && DEBIAN_FRONTEND=noninteractive \
	            apt-get install -y -q $(SERVICES)) \
	        || echo "note: could not install $(SERVICES); the browser and Prometheus tests will skip"; \
	else \
	    echo "note: $(SERVICES) are not installed (apt-get install them as root);" \
	        "the browser and Prometheus tests will skip"; \
	fi
