# fusedattn developer commands. Every target works on a fresh machine: `make test` and
# `make bench` install what is missing first (into the current Python environment).
PYTHON ?= python3
PIP := $(PYTHON) -m pip

# torch guesses CUDA_HOME from `which nvcc`, wrong where nvcc is a wrapper script; setup.py
# corrects that, and a toolkit at /usr/local/cuda is named here for torch's own tools too.
ifneq ($(wildcard /usr/local/cuda/bin/nvcc),)
export CUDA_HOME ?= /usr/local/cuda
endif

# transformers: for the Hugging Face integration tests (the optional [hf] extra); build: the
# sdist round trip test. pip install --no-build-isolation uses the environment's setuptools,
# so pyproject's build requirements are installed here too (a new venv has setuptools 65).
RUNTIME_DEPS := torch triton numpy pybind11 ninja pytest matplotlib transformers build
# pytest-xdist: `make test` runs one worker per core (PYTEST_WORKERS=0 for one process)
TEST_DEPS := pytest-xdist
PYTEST_WORKERS ?= auto
PYTEST_ARGS := -n $(PYTEST_WORKERS) --dist worksteal --durations=25
BUILD_DEPS := "setuptools>=77" wheel
LINT_DEPS := ruff clang-format
CSRC := $(shell find csrc -name '*.cu' -o -name '*.cuh' -o -name '*.cpp' -o -name '*.h')
# One stamp per Python environment, so a new venv reinstalls. Not under build/: a build/
# folder at the root shadows the `build` package (`python -m build` would fail).
ENV_ID := $(shell $(PYTHON) -c "import hashlib, sys; print(hashlib.sha1(sys.prefix.encode()).hexdigest()[:10])")
INSTALL_STAMP := .make/installed-$(ENV_ID)
OUT ?= .make/gpu-check

.PHONY: install deps test test-fast test-gpu bench lint lint-deps format gpu-check clean

deps:
	@missing=$$(for m in $(RUNTIME_DEPS); do $(PYTHON) -c "import $$m" 2>/dev/null || echo $$m; done); \
	$(PYTHON) -c "import xdist" 2>/dev/null || missing="$$missing $(TEST_DEPS)"; \
	if [ -n "$$missing" ]; then echo "installing:" $$missing; $(PIP) install $$missing; fi

install: deps
	$(PIP) install -q $(BUILD_DEPS)
	$(PIP) install --no-build-isolation -e .
	@$(PYTHON) -m fusedattn.info --extension
	@mkdir -p .make && touch $(INSTALL_STAMP)

$(INSTALL_STAMP): setup.py pyproject.toml Makefile $(CSRC)
	$(MAKE) install

test: $(INSTALL_STAMP)
	$(PYTHON) -m pytest $(PYTEST_ARGS) -m "not gpu" tests

test-fast: $(INSTALL_STAMP)
	$(PYTHON) -m pytest -q $(PYTEST_ARGS) -m "not gpu and not slow" tests

test-gpu: $(INSTALL_STAMP)
	$(PYTHON) -m pytest -m gpu tests

bench: $(INSTALL_STAMP)
	$(PYTHON) benchmarks/run_all.py $(BENCH_ARGS)

lint-deps:
	@missing=$$(for m in $(LINT_DEPS); do command -v $$m >/dev/null || echo $$m; done); \
	if [ -n "$$missing" ]; then echo "installing:" $$missing; $(PIP) install $$missing; fi

lint: lint-deps
	ruff check .
	ruff format --check .
	clang-format --dry-run -Werror $(CSRC)

format: lint-deps
	ruff check --fix .
	ruff format .
	clang-format -i $(CSRC)

# On the GPU machine (no network there): build, GPU tests and quick benchmarks in one call;
# logs and CSVs go to $(OUT).
gpu-check:
	bash scripts/gpu_check.sh $(OUT)

clean:
	rm -rf build dist .make python/*.egg-info python/fusedattn/_C*.so
