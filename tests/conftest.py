"""Test rails: GPU markers that skip cleanly, a seed per test, the Triton interpreter on CPU,
poisoned kernel outputs.

TRITON_INTERPRET=1 must be set before any kernel module is imported (triton.jit reads it when
a kernel is defined), so it is set here, at conftest import, when there is no GPU.
"""

import importlib.util
import json
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one pytest-xdist worker per core: a worker's torch ops on more threads
    # than that only contend with the other workers (on 2 cores, 2 threads each grew the
    # suite's CPU time by half, 754 -> 1124 s). The processes tests start (examples, gloo
    # ranks, docs snippets) inherit one thread too: an OpenMP team of 2 next to a busy worker
    # spin-waits: the examples took 68-76 s of a two-worker run on two threads, 22 s on one.
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
# tests/vllm_serving runs in the environment `make test-vllm` builds (vLLM pins its own torch).
if importlib.util.find_spec("vllm") is None:
    collect_ignore = ["vllm_serving"]
# Kernel outputs start as NaN, so an element a kernel forgets to write fails the comparison.
os.environ.setdefault("FUSEDATTN_POISON_OUTPUTS", "1")


def pytest_addoption(parser):
    parser.addoption(
        "--shard",
        default=None,
        help="I/N: run only every N-th collected test starting at I (parallel GPU runs: "
        "scripts/gpu_check.sh starts N pytest processes that compile Triton kernels at once)",
    )
    parser.addoption(
        "--record-dispatch",
        default=None,
        metavar="DIR",
        help="write every (op, backend, dtype, options) combination the run dispatches to "
        "DIR/<worker>.json (scripts/dispatch_coverage.py compares two runs)",
    )


_RECORDED: set = set()  # (op, backend, dtype, options) under --record-dispatch
_RECORDING = None


def pytest_configure(config):
    global _RECORDING
    if config.getoption("--record-dispatch"):
        from dispatch_probe import record_combinations

        _RECORDING = record_combinations(_RECORDED)
        _RECORDING.__enter__()


def pytest_unconfigure(config):
    if _RECORDING is None:
        return
    _RECORDING.__exit__(None, None, None)
    out = config.getoption("--record-dispatch")
    os.makedirs(out, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(out, f"{worker}.json"), "w") as f:
        json.dump(sorted(_RECORDED), f)


# Files whose tests run processes of their own for longest (the first-use CUDA build, 81 s of a
# CI worker; each example a fresh interpreter): collected first, so that work stealing never
# leaves one worker on one of them while the other has run out of tests. Not vLLM's examples:
# first, both workers started one at once (each with its engine core: three processes on two
# cores), 102 s for the vLLM suite against 89 s in file order (2026-12-02).
LONG_FIRST = ("test_packaging.py", "test_examples.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in LONG_FIRST)  # stable: the rest in order
    shard = config.getoption("--shard")
    if shard:
        index, count = (int(p) for p in shard.split("/"))
        kept = [item for i, item in enumerate(items) if i % count == index]
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
    if HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def seed_and_clean_env(monkeypatch):
    """Every test starts from seed 0 and without a process-wide backend override."""
    monkeypatch.delenv("FUSEDATTN_BACKEND", raising=False)
    torch.manual_seed(0)
    yield


@pytest.fixture
def device():
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def kernel_device(device):
    """Default device for kernel tests: CUDA on a GPU machine (the compiled kernels), else the
    CPU (the Triton interpreter). Used by the `kernels`-marked modules."""
    with torch.device(device):
        yield
