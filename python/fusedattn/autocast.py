"""torch.autocast for fusedattn's ops, following the policies torch gives the ops they replace.

Autocast casts the inputs of torch's own ops in its dispatcher; fusedattn's functions are plain
Python, so they apply the same casts themselves and every backend sees what the torch op would.
Policies (read off torch: CUDA lists layer_norm and softmax as fp32 ops and SDPA and linear
as lower-precision ops; the CPU lists lower SDPA and linear and leaves layer_norm and softmax
alone):
"""

from __future__ import annotations

import torch

FP32_OPS = {"cuda": frozenset({"layer_norm", "rms_norm", "softmax"})}
LOWER_PRECISION_OPS = {
    "cuda": frozenset({"attention", "linear"}),
    "cpu": frozenset({"attention", "linear"}),
}


def autocast_target(op: str, device_type: str) -> torch.dtype | None:
    """The dtype autocast gives `op`'s floating inputs on `device_type` now, or None."""
    if not torch.is_autocast_enabled(device_type):
        return None
    if op in FP32_OPS.get(device_type, ()):
        return torch.float32
    if op in LOWER_PRECISION_OPS.get(device_type, ()):
        return torch.get_autocast_dtype(device_type)
    return None


def apply_autocast(op: str, tensors: dict) -> dict:
    """Cast the floating-point tensors among `tensors` as torch.autocast would for `op`."""
    first = next((t for t in tensors.values() if isinstance(t, torch.Tensor)), None)
    if first is None:
        return tensors
    target = autocast_target(op, first.device.type)
    if target is None:
        return tensors
    return {name: t.to(target) if _castable(t) else t for name, t in tensors.items()}


def _castable(t) -> bool:
    """A floating tensor autocast would cast: not an fp8 one (stored × descale: its values
    mean something only with their descale)."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.element_size() > 1
