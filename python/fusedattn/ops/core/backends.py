"""Backend registry and dispatch, one mechanism for every op.

Each (op, backend) implementation registers a `run` function and a `refusals` function that
returns every reason it cannot take the given inputs ([] = it can). Dispatch never falls back
silently: a backend named explicitly (by argument or by FUSEDATTN_BACKEND) that refuses raises
`BackendUnavailableError` listing all its reasons; `auto` takes the first backend in a fixed
per-device preference order that accepts, and lists every backend's reasons if none does.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ... import invariance
from ...fp8 import is_fp8
from . import auto
from . import extension as extension_loader

BACKENDS = ("reference", "torch", "triton", "cuda")
ENV_VAR = "FUSEDATTN_BACKEND"
OPS = (
    "attention",
    "varlen_attention",
    "attention_with_kvcache",
    "mla_attention_with_kvcache",
    "layer_norm",
    "rms_norm",
    "softmax",
    "linear",
)

# `auto`'s default order, by device and op, for calls the routing table (ops/core/auto.py, built
# from the benchmark CSVs) has no measurement for. On CPU torch's own ops are the fastest
# correct choice, so a swapped model on CPU is never slower than the unswapped one; the Triton
# interpreter is for tests and is reached by naming backend="triton". On a GPU torch leads by
# default: a kernel backend goes ahead of it only in the buckets where a committed GPU
# benchmark shows it faster; otherwise the kernel backends serve what torch refuses
# (return_lse, softcap) and FUSEDATTN_BACKEND.
# Decoding is the exception: the torch backend gathers the cache to a dense copy and masks it
# (SDPA has no paged or per-sequence-length form), so it reads and writes the K/V at least
# twice where the split-key Triton kernel reads them once: Triton leads until a decode
# benchmark says otherwise (build_auto_table.py keys bench_decode.py's rows by ops/core/auto.py's
# decode buckets).
AUTO_ORDER = {
    "cuda": {op: ("torch", "triton", "cuda", "reference") for op in OPS}
    | {
        op: ("triton", "torch", "reference")
        for op in ("attention_with_kvcache", "mla_attention_with_kvcache")
    },
    "cpu": {op: ("torch", "reference") for op in OPS},
}


class BackendUnavailableError(ValueError):
    """The requested backend cannot run an op on the given inputs; the message says why."""


@dataclass(frozen=True)
class Implementation:
    op: str
    backend: str
    run: Callable
    refusals: Callable[..., list[str]]


_REGISTRY: dict[str, dict[str, Implementation]] = {op: {} for op in OPS}


def register(op: str, backend: str, run: Callable, refusals: Callable[..., list[str]]) -> None:
    if op not in _REGISTRY or backend not in BACKENDS:
        raise ValueError(f"unknown op {op!r} or backend {backend!r}")
    _REGISTRY[op][backend] = Implementation(op, backend, run, refusals)


def no_refusals(**_inputs) -> list[str]:
    return []


# ---- process- and device-level reasons, shared by every op of a backend -------------------


# Probed once at import (neither touches CUDA nor imports triton), so dispatch stays plain
# attribute reads that torch.compile traces without graph breaks. EXTENSION is the loaded
# module (ahead-of-time fusedattn._C or a cached first-use build) or None; EXTENSION_ERROR
# says why not; BUILD_ON_FIRST_USE: backend="cuda" may compile it (see ops/core/extension.py).
EXTENSION, EXTENSION_ORIGIN, EXTENSION_ERROR = extension_loader.probe()
EXTENSION_OPS = frozenset(EXTENSION.build_info()["ops"]) if EXTENSION else frozenset()
BUILD_ON_FIRST_USE = EXTENSION is None and extension_loader.cannot_build() is None


def extension():
    """The CUDA extension, compiled now if this is the first use of backend="cuda" (dispatch
    has already checked that it is built or buildable)."""
    global EXTENSION, EXTENSION_ORIGIN, EXTENSION_ERROR, EXTENSION_OPS, BUILD_ON_FIRST_USE
    if EXTENSION is None:
        EXTENSION = extension_loader.build()
        EXTENSION_ORIGIN, EXTENSION_ERROR, BUILD_ON_FIRST_USE = "first-use build", None, False
        EXTENSION_OPS = frozenset(EXTENSION.build_info()["ops"])
    return EXTENSION


TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def device_refusals(backend: str, device: torch.device, *, auto: bool = False) -> list[str]:
    """Why `backend` cannot run anything on `device` in this process ([] = it can). `auto`
    never waits for a first-use compile of the CUDA extension; a named backend="cuda" may."""
    reasons = []
    if backend == "triton":
        if not TRITON_INSTALLED:
            reasons.append("triton is not installed")
        if device.type == "cpu" and not triton_interpreter_enabled():
            reasons.append(
                "tensors are on the CPU and TRITON_INTERPRET=1 is not set (set it before "
                "importing fusedattn to run the Triton kernels in the interpreter)"
            )
        elif device.type not in ("cpu", "cuda"):
            reasons.append(f"tensors are on {device.type}; Triton kernels need CUDA")
    elif backend == "cuda":
        if EXTENSION is None and (auto or not BUILD_ON_FIRST_USE):
            reasons.append(EXTENSION_ERROR)
        if device.type != "cuda":
            reasons.append(f"tensors are on {device.type}; the cuda backend needs CUDA tensors")
    return reasons


# ---- selection ---------------------------------------------------------------------------


def resolve_backend_name(backend: str) -> str:
    """The backend an op call asks for: the argument, or FUSEDATTN_BACKEND in place of auto."""
    if backend not in (*BACKENDS, "auto"):
        raise ValueError(f"backend must be one of {(*BACKENDS, 'auto')}, got {backend!r}")
    if backend == "auto":
        env = os.environ.get(ENV_VAR, "").strip()
        if env and env != "auto":
            if env not in BACKENDS:
                raise ValueError(f"{ENV_VAR} must be one of {(*BACKENDS, 'auto')}, got {env!r}")
            return env
    return backend


def static_refusals(op: str, backend: str, device: torch.device, *, auto=False) -> list[str]:
    """Reasons `backend` cannot run `op` on `device` whatever the inputs; [] when it may."""
    reasons = device_refusals(backend, device, auto=auto)
    if backend not in _REGISTRY[op]:
        reasons.append(f"fusedattn has no {backend} implementation of {op} yet")
    return reasons


def refusals(op: str, backend: str, device: torch.device, inputs: dict, *, auto=False) -> list[str]:
    """Every reason `backend` cannot run `op` on these inputs; [] when it can."""
    reasons = static_refusals(op, backend, device, auto=auto)
    if backend in ("torch", "cuda"):  # fusedattn.batch_invariant: the Triton kernels only
        reasons += invariance.refusal(f"the {backend} backend's {op}")
    impl = _REGISTRY[op].get(backend)
    if impl is not None:
        reasons += impl.refusals(**inputs)
    return reasons


def _format(reasons: list[str]) -> str:
    return "".join(f"\n  - {r}" for r in reasons)


def _fp8_call(inputs: dict) -> bool:
    return is_fp8(inputs.get("q")) or is_fp8(inputs.get("k"))


def auto_order(op: str, device: torch.device, inputs: dict) -> tuple[str, ...]:
    """The backends auto tries, in order: those measured fastest for calls like this one on
    this card (ops/core/auto.py's table), then the default order for the device."""
    order_of = op
    if op == "varlen_attention" and inputs.get("block_table") is not None:
        order_of = "attention_with_kvcache"  # a paged prefill runs the decode kernel
    elif _fp8_call(inputs):
        # torch has no fp8 attention: its backend dequantizes q, k, v to float32 (4x the
        # bytes) and runs SDPA in fp32; the Triton kernels read fp8 and multiply on fp8
        # tensor cores, so they lead until a benchmark row says otherwise
        order_of = "attention_with_kvcache"
    default = AUTO_ORDER.get(device.type, {}).get(order_of, ("reference",))
    if invariance.enabled():  # the Triton kernels, where they run; else the reference
        return ("triton", "reference")
    measured = auto.measured_order(op, device, inputs)
    return measured + tuple(b for b in default if b not in measured)


def select(op: str, backend: str, device: torch.device, inputs: dict) -> Implementation:
    """The implementation that runs `op`, or BackendUnavailableError saying why none can."""
    name = resolve_backend_name(backend)
    if name != "auto":
        reasons = refusals(op, name, device, inputs)
        if reasons:
            via = f" (from {ENV_VAR})" if backend == "auto" else ""
            raise BackendUnavailableError(
                f"backend={name!r}{via} cannot run {op} on these inputs:{_format(reasons)}"
            )
        return _REGISTRY[op][name]
    tried = []
    for candidate in auto_order(op, device, inputs):
        reasons = refusals(op, candidate, device, inputs, auto=True)
        if not reasons:
            return _REGISTRY[op][candidate]
        tried.append(f"{candidate}: " + "; ".join(reasons))
    raise BackendUnavailableError(f"no backend can run {op} on these inputs:{_format(tried)}")


def available_backends(device: str | torch.device | None = None) -> list[str]:
    """Backends that can run at least one op on `device` (default: cuda if present, else cpu)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"device must be a torch.device or a device string, got {device!r}: {e}"
        ) from e
    return [b for b in BACKENDS if any(not static_refusals(op, b, device) for op in OPS)]


def backend_report(device: str | torch.device) -> dict[str, dict[str, list[str]]]:
    """{op: {backend: reasons}} for input-independent reasons; [] = usable on `device`."""
    device = torch.device(device)
    return {op: {b: static_refusals(op, b, device) for b in BACKENDS} for op in OPS}
