"""What every kernel backend's launcher reads: the kernel modules, the devices, the dtypes and
layouts the kernels take, and the CUDA extension.

The Triton kernel modules import triton, so they are imported on their first launch: `import
fusedattn` never imports triton.
"""

from __future__ import annotations

import functools
import importlib

import torch

from . import backends, interpreter

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256  # the attention and decode kernels' head dims, D and Dv


@functools.cache
def kernels(name: str):
    """fusedattn.triton_kernels.<name>, imported on first use (cached: import_module costs
    0.5 µs a call on the host path, bench_host.py). Under Triton's interpreter, its dot made
    row by row and its masks bool first (interpreter.py)."""
    if backends.triton_interpreter_enabled():
        interpreter.install()
    return importlib.import_module(f"fusedattn.triton_kernels.{name}")


def extension():
    """The CUDA extension: fusedattn._C, or its first-use build (compiled now if needed)."""
    return backends.extension()


def extension_op_refusals(op: str) -> list[str]:
    """Why fusedattn._C cannot run `op`: built before the op existed. (That it does not load at
    all is the device-level reason.)"""
    if backends.EXTENSION_ERROR or op in backends.EXTENSION_OPS:
        return []
    return [f"fusedattn._C was built without {op}: rebuild it"]


def dtype_refusals(*tensors: torch.Tensor | None, backend: str = "triton") -> list[str]:
    bad = sorted({str(t.dtype) for t in tensors if t is not None and t.dtype not in KERNEL_DTYPES})
    if bad:
        name = "Triton" if backend == "triton" else "CUDA"
        return [f"the {name} kernels take float16, bfloat16 and float32, got {', '.join(bad)}"]
    return []


# ---- devices ------------------------------------------------------------------------------------


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def program_budget(device: torch.device) -> int:
    """Streaming multiprocessors to size grids by (the interpreter on CPU: a few)."""
    return sm_count(device.index or 0) if device.type == "cuda" else 4


@functools.cache
def _cuda_arch(index: int) -> int:
    major, minor = torch.cuda.get_device_capability(index)
    return 10 * major + minor


def device_arch(device: torch.device) -> int:
    """10 * major + minor of a CUDA device's compute capability (cached: the host path pays a
    dict lookup); 0 off CUDA."""
    if device.type != "cuda":
        return 0
    return _cuda_arch(torch.cuda.current_device() if device.index is None else device.index)


def dot_flags(q: torch.Tensor) -> dict:
    """fp32 inputs to fp32 accuracy unless the user allowed TF32 (torch.backends); bf16 and fp8
    dots in fp32 in the CPU interpreter (see _dot in the kernels)."""
    tf32 = q.dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32
    return dict(
        PRECISION="tf32" if tf32 else "ieee",
        # fp8 too: the interpreter's fp8 dot is not to be trusted (fp8 values are fp32 values)
        DOT_IN_FP32=not q.is_cuda and (q.dtype == torch.bfloat16 or q.element_size() == 1),
    )


# ---- layouts ------------------------------------------------------------------------------------


def dense(t: torch.Tensor | None) -> torch.Tensor | None:
    """t contiguous (kernels read lengths, tables and per-head parameters with their last
    stride 1 and rows of their own length); a copy only where it is not."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def dense_params(t: torch.Tensor | None) -> torch.Tensor | None:
    """The Triton kernels read parameters with a unit stride: a strided or expanded (stride 0)
    weight is copied to its n elements first (a negligible copy next to x)."""
    return None if t is None else t.contiguous()


def fp32_params(t: torch.Tensor | None) -> torch.Tensor | None:
    """The CUDA kernels read parameters as contiguous fp32 (n elements: a negligible copy)."""
    return None if t is None else t.float().contiguous().view(-1)


def _scratch(size: int, alignment: int, stream):
    """Global scratch for a Triton kernel's launch, from torch's caching allocator on the
    current device (the tensor descriptors a kernel makes for itself live there)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator() -> None:
    """Kernels that make tensor descriptors in the kernel (the warp-specialized attention
    forward) need global scratch, which Triton asks triton.set_allocator's allocator for at
    launch: set torch's where none is set (a user's own stays)."""
    import triton
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)
