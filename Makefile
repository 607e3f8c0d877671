# Quick start: `make serve` (install + run the daemon), `make test` (install + run the tests).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
DEPS   := $(VENV)/.deps-installed
ARGS   ?=

.PHONY: serve test bench bench-serving clean

# The CPU build of torch first: a bare `torch` from an index is a multi-GB CUDA build.
$(DEPS): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

serve: $(DEPS)
	$(BIN)/applianced serve $(ARGS)

test: $(DEPS)
	$(BIN)/python -m pytest -q $(ARGS)

bench: bench-serving

bench-serving: $(DEPS)
	$(BIN)/python bench/bench_serving.py $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
