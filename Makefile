# Two entry points (see README): `make demo` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean

# torch is pinned to the CPU build first: a bare `torch` requirement would pull a multi-GB
# CUDA build. Any torch >= 2.4 already in the environment is accepted as it is.
$(BIN)/activate:
	$(PY) -m venv $(VENV)

setup: $(BIN)/activate
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q -c constraints.txt torch
	$(BIN)/pip install -q -e '.[test]'

demo: setup
	$(BIN)/singularityctl demo

test: setup
	$(BIN)/python -m pytest -q tests

bench: setup
	$(BIN)/python bench/latency.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
