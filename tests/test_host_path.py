"""The host path of a planned decode step, counted (issue #73 item 6): the Python calls inside
fusedattn, the torch ops and the kernel launches one `attention_with_kvcache` step runs once its
plan exists, with the GPU's choices (the append kernel, no value check) and the launches
themselves stubbed. bench_host.py times the same path under the sm_90 stub; this count holds
between GPU runs. A count above its bound means something joined every decode step: find it
(profile it with bench_host.py) before raising the bound.

The bounds are the counts of 2026-11-29 (Llama-3-8B's heads at batch 1 over a 1k cache)."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusedattn
from fusedattn.ops.core import triton_launch
from fusedattn.ops.decode import api as decode_api
from fusedattn.ops.shared import decode_launch

# (python calls in fusedattn, torch ops, launches) of one planned step
BOUNDS = {"decode": (29, 2, 1), "decode+append": (30, 2, 2)}


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def gpu_path(monkeypatch):
    """The GPU's choices on the CPU, every launch recorded instead of run."""
    launches = []
    monkeypatch.setattr(decode_launch, "append_uses_kernel", lambda k_cache: True)
    monkeypatch.setattr(decode_api, "values_checked", lambda *a, **k: False)
    monkeypatch.setattr(triton_launch.Prepared, "__call__", lambda self, *t: launches.append(1))

    def prepare(kernel, grid, args, constexprs):
        n = triton_launch.tensor_prefix(args)
        return triton_launch.Prepared(kernel, grid, args[n:], constexprs, None, None)

    monkeypatch.setattr(triton_launch, "prepare", prepare)
    return launches


@pytest.mark.parametrize("case", BOUNDS)
def test_a_planned_decode_step_runs_a_bounded_host_path(gpu_path, case):
    B, Hq, Hkv, D, L = 1, 32, 8, 128, 1024
    q = torch.randn(B, 1, Hq, D, dtype=torch.float16)
    k_cache, v_cache = (torch.zeros(B, L + 64, Hkv, D, dtype=torch.float16) for _ in range(2))
    new = (None, None)
    if case == "decode+append":
        new = tuple(torch.randn(B, 1, Hkv, D, dtype=torch.float16) for _ in range(2))
    lengths = torch.full((B,), L, dtype=torch.int32)

    def step():
        return fusedattn.attention_with_kvcache(q, k_cache, v_cache, *new, cache_seqlens=lengths,
                                                backend="triton")  # fmt: skip

    step()  # the plan
    gpu_path.clear()
    package = os.path.dirname(fusedattn.__file__)
    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(package):
            calls.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}")

    with _Ops() as ops:
        sys.setprofile(profile)
        try:
            step()
        finally:
            sys.setprofile(None)
    most_calls, most_ops, launches = BOUNDS[case]
    assert len(calls) <= most_calls, f"{len(calls)} Python calls: {calls}"
    assert len(ops.names) <= most_ops, f"{len(ops.names)} torch ops: {ops.names}"
    assert len(gpu_path) == launches, "a launch went around its prepared launcher"
