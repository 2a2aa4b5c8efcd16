"""Record which Triton kernels a launcher starts, to assert which path ran."""

from __future__ import annotations


class LaunchProbe:
    """Stands in for a @triton.jit kernel: counts `kernel[grid](...)` launches, then runs it."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.grids = []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


def probe_kernels(monkeypatch, module, *names):
    """Replace module.<name> by a LaunchProbe for each name; returns {name: probe}."""
    probes = {}
    for name in names:
        probes[name] = LaunchProbe(getattr(module, name))
        monkeypatch.setattr(module, name, probes[name])
    return probes
