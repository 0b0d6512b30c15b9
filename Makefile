# karma: `make demo` shows the main job, `make test` runs the test suite.
# Both set themselves up on a fresh machine: a virtual environment in .venv,
# PyTorch (the CPU build 2.13.0 when no NVIDIA GPU is present), and karma itself.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.karma-installed
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: install test test-fast demo lint clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
ifeq ($(HAS_GPU),1)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "torch>=2.11"
else
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
endif
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

# two workers, each taking whole files (module fixtures built once): about half the time of
# one process on a 2-core machine
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests

# the inner loop: every file, without the matrices' other cells and the tests marked slow
# (tests/matrix.py); `make test` runs everything
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow" tests

demo: $(STAMP)
	$(BIN)/python -m karma.demo

lint: $(STAMP)
	$(BIN)/ruff check karma tests examples bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
