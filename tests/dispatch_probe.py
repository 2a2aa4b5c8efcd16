"""Count which (op, backend) implementations actually run, to assert that a path was taken."""

from __future__ import annotations

import contextlib
from collections import Counter

from fusedattn.ops import backends


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
