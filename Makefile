# Two entry points (see README): `make demo` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup demo test gpu-check bench clean

# torch is pinned to the CPU build first: a bare `torch` requirement would pull a multi-GB
# CUDA build. Any torch >= 2.4 already in the environment is accepted as it is.
$(BIN)/activate:
	$(PY) -m venv $(VENV)

# Jobs run in a bubblewrap sandbox (docs/security.md); without bwrap they run unsandboxed, with
# a warning in the agent's log.
setup: $(BIN)/activate
	@command -v bwrap >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		{ apt-get install -y -qq bubblewrap >/dev/null 2>&1 || \
		  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; }; } >/dev/null 2>&1; } || \
		echo "bubblewrap (bwrap) is not installed: jobs will run without a sandbox (see docs/security.md)"
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q -c constraints.txt torch
	$(BIN)/pip install -q -e '.[test,ray,trainers]'

demo: setup
	$(BIN)/singularityctl demo

# Two test processes, each taking whole files (--dist loadfile: a file's tests share its fixtures).
test: setup
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=20 tests

# The GPU paths (NVML, CUDA tensors and cuDNN in checkpoints, NCCL data-parallel resize): run
# on a machine with an NVIDIA GPU; elsewhere every one of these tests skips, saying why.
gpu-check: setup
	$(BIN)/python -m pytest -q -rs tests/e2e/test_gpu.py tests/jupyter/test_cluster_load.py

bench: setup
	$(BIN)/python bench/latency.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
