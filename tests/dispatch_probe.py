"""Count which (op, backend) implementations actually run, to assert that a path was taken;
record which (op, backend, dtype, options) combinations a test run exercises."""

from __future__ import annotations

import contextlib
import functools
from collections import Counter

import torch

from fusedattn.ops.core import backends


@contextlib.contextmanager
def count_dispatches():
    """Within the block, every registered implementation counts its calls in the Counter
    yielded, keyed by (op, backend)."""
    counts: Counter = Counter()
    saved = {op: dict(impls) for op, impls in backends._REGISTRY.items()}

    def counting(impl):
        def run(**inputs):
            counts[(impl.op, impl.backend)] += 1
            return impl.run(**inputs)

        return backends.Implementation(impl.op, impl.backend, run, impl.refusals)

    for impls in backends._REGISTRY.values():
        for name, impl in impls.items():
            impls[name] = counting(impl)
    try:
        yield counts
    finally:
        for op, impls in saved.items():
            backends._REGISTRY[op].clear()
            backends._REGISTRY[op].update(impls)


# Arguments that every call has (the tensors, the sizes) or that no kernel branches on: a
# combination is the op, the backend that ran it, the dtype and the options that were set.
_NOT_OPTIONS = {
    "q", "k", "v", "x", "k_cache", "v_cache", "seqlens_k", "cu_seqlens_q", "cu_seqlens_k",
    "max_seqlen_q", "max_seqlen_k", "normalized_shape", "dim", "eps", "enable_gqa",
}  # fmt: skip


def options_set(inputs: dict) -> tuple:
    """The options a call sets, by name: a window as causal / window (-bottom_right), a mask
    as mask:bool / mask:float, any other argument that is not None, False or 0 by name."""
    options = []
    for name, value in inputs.items():
        if name in _NOT_OPTIONS or value is None or value is False:
            continue
        if name == "window":
            if value.bounded:
                kind = "causal" if (value.left < 0 and value.right == 0) else "window"
                options.append(kind + ("-bottom_right" if value.bottom_right else ""))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if value != 0:
                options.append(name)
        elif hasattr(value, "dtype") and name in ("attn_mask", "mask"):
            options.append(f"{name}:{'bool' if value.dtype == torch.bool else 'float'}")
        else:
            options.append(name)
    return tuple(sorted(options))


@contextlib.contextmanager
def record_combinations(seen: set):
    """Within the block, every (op, backend that ran, dtype, options set) that dispatch
    selects is added to `seen` (pytest --record-dispatch DIR; scripts/dispatch_coverage.py
    compares two runs). A planned call skips select, but its first call of a key did not."""
    select = backends.select

    @functools.wraps(select)  # tests that check select was restored read its name
    def recording(op, backend, device, inputs):
        impl = select(op, backend, device, inputs)
        t = inputs.get("q", inputs.get("x"))
        seen.add((op, impl.backend, str(getattr(t, "dtype", "")), options_set(inputs)))
        return impl

    backends.select = recording
    try:
        yield seen
    finally:
        backends.select = select
