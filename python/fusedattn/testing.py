"""The correctness rule of fusedattn, for tests and benchmarks.

flash-attention's rule: a kernel's error against a high-precision reference (float64, inputs
upcast) may be at most k times the error of the same computation done by PyTorch in the
kernel's own dtype, plus a floor: one unit of rounding of the output dtype at the largest
reference magnitude (rounding the result to its dtype is unavoidable, and a baseline can be
lucky on a few elements) and a small absolute term for values near 0. k = 2 for ops, 3 for whole models. The tolerance scales with the problem
instead of a magic atol, and a failure names the worst element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Absolute floor per dtype: a few units of rounding at magnitude 1. It only matters when the
# baseline is (nearly) exact; low-precision baselines are far above it.
ABS_FLOOR = {
    torch.float16: 1e-3,
    torch.bfloat16: 8e-3,
    torch.float32: 1e-5,
    torch.float64: 1e-10,
}


@dataclass
class Comparison:
    ok: bool
    error: float  # max |out - ref|
    baseline_error: float  # max |baseline - ref|
    limit: float  # k * baseline_error + floor
    message: str


def _describe(name: str, out, ref, baseline, err, limit) -> str:
    flat = int(torch.nan_to_num(err, nan=float("inf")).flatten().argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape))
    failing = torch.nan_to_num(err, nan=float("inf")) > limit
    share = failing.float().mean().item() if err.numel() else 0.0
    return (
        f"{name}: max error {err.flatten()[flat].item():.3g} > limit {limit:.3g} at index {index}"
        f" (got {out.flatten()[flat].item():.6g}, reference {ref.flatten()[flat].item():.6g},"
        f" baseline {baseline.flatten()[flat].item():.6g}); {share:.2%} of"
        f" {err.numel()} elements fail; shape {tuple(err.shape)}"
    )


def compare_kx(
    out: torch.Tensor,
    ref: torch.Tensor,
    baseline: torch.Tensor,
    *,
    k: float = 2.0,
    atol: float | None = None,
    name: str = "output",
) -> Comparison:
    """Check `out` against `ref` (high precision) with the k× rule; `baseline` is PyTorch's
    result in out's dtype. NaN where ref is finite always fails; equal infinities pass."""
    if out.shape != ref.shape or baseline.shape != ref.shape:
        shapes = (tuple(out.shape), tuple(ref.shape), tuple(baseline.shape))
        raise ValueError(f"{name}: shapes differ (out, ref, baseline) = {shapes}")
    out64, ref64, base64 = (t.detach().to("cpu", torch.float64) for t in (out, ref, baseline))
    floor = ABS_FLOOR.get(out.dtype, 1e-5) if atol is None else atol
    if out.dtype.is_floating_point and ref64.numel():
        magnitude = torch.nan_to_num(ref64, nan=0.0, posinf=0.0, neginf=0.0).abs().max().item()
        floor += torch.finfo(out.dtype).eps * magnitude

    def error(t):
        e = (t - ref64).abs()
        same_inf = torch.isinf(t) & torch.isinf(ref64) & (t == ref64)
        return e.masked_fill(same_inf, 0.0)

    err, base_err = error(out64), error(base64)
    base_max = torch.nan_to_num(base_err, nan=0.0).max().item() if base_err.numel() else 0.0
    limit = k * base_max + floor
    worst = torch.nan_to_num(err, nan=float("inf")).max().item() if err.numel() else 0.0
    ok = worst <= limit
    message = "ok" if ok else _describe(name, out64, ref64, base64, err, limit)
    return Comparison(ok, worst, base_max, limit, message)


def assert_close_kx(
    out, ref, baseline, *, k: float = 2.0, atol: float | None = None, name="output"
):
    """Raise AssertionError, naming the worst element, unless `out` passes the k× rule."""
    result = compare_kx(out, ref, baseline, k=k, atol=atol, name=name)
    if not result.ok:
        raise AssertionError(result.message)
    return result


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer filled with NaN (or the dtype's max for integers), so that an element a
    kernel forgets to write fails the comparison instead of passing as stale memory."""
    if t.dtype.is_floating_point:
        return torch.full_like(t, float("nan"))
    return torch.full_like(t, torch.iinfo(t.dtype).max)
