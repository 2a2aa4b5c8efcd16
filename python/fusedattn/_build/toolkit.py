"""Where the CUDA toolkit is, and the nvcc flags of fusedattn._C (stdlib only)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

DEFAULT_ARCH_LIST = "8.0;9.0a"

# No --use_fast_math: fp32 inputs must be computed to fp32 accuracy, so kernels choose fast
# intrinsics (exp2f, rsqrtf) explicitly. No -std flag: torch.utils.cpp_extension picks the
# standard its headers need (C++20 from torch 2.14 on, C++17 before).
CXX_FLAGS = ["-O3"]
NVCC_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]

# The attention kernels' instantiated head dims (csrc/common/static_switch.h), each in a
# forward and a backward translation unit of its own. FUSEDATTN_CUDA_HEAD_DIMS="64,128" builds a
# subset (as flash-attention 3's FLASH_ATTENTION_DISABLE_HDIM* do): the first-use build on 2
# cores takes 155 s with all five and about half that with one; a head dim above the largest
# built is refused in Python (backend='auto' then runs Triton), one below rounds up to the
# next built.
HEAD_DIMS = (32, 64, 96, 128, 256)
HEAD_DIMS_ENV = "FUSEDATTN_CUDA_HEAD_DIMS"


def head_dims(environ=os.environ) -> tuple[int, ...]:
    """The head dims to build: $FUSEDATTN_CUDA_HEAD_DIMS (commas or semicolons), else all."""
    raw = environ.get(HEAD_DIMS_ENV, "").replace(";", ",").strip()
    if not raw:
        return HEAD_DIMS
    try:
        dims = sorted({int(part) for part in raw.split(",") if part.strip()})
    except ValueError:
        dims = []
    if not dims or any(d not in HEAD_DIMS for d in dims):
        raise ValueError(
            f"{HEAD_DIMS_ENV}={environ[HEAD_DIMS_ENV]!r}: expected a comma-separated subset of "
            f"{', '.join(map(str, HEAD_DIMS))}"
        )
    return tuple(dims)


def head_dim_flags(dims: tuple[int, ...]) -> list[str]:
    """nvcc defines that leave the head dims not in `dims` out of HEADDIM_SWITCH (none for all,
    so the default build's flags do not change)."""
    return [f"-DFUSEDATTN_HDIM{d}=0" for d in HEAD_DIMS if d not in dims]


def is_toolkit(root: Path) -> bool:
    return (root / "include" / "cuda_runtime.h").exists() and (root / "bin" / "nvcc").exists()


def guess_cuda_home(environ=os.environ) -> str | None:
    """The toolkit root: $CUDA_HOME if it holds a toolkit, else the root of the real nvcc.

    torch derives CUDA_HOME from `which nvcc`, which picks /usr/local when nvcc is a wrapper
    script in /usr/local/bin; the link then fails on -lcudart. So look for a root that has
    include/cuda_runtime.h and bin/nvcc: $CUDA_HOME, the nvcc on PATH followed through links,
    then /usr/local/cuda.
    """
    if environ.get("CUDA_HOME"):
        return environ["CUDA_HOME"] if is_toolkit(Path(environ["CUDA_HOME"])) else None
    candidates = []
    nvcc = shutil.which("nvcc", path=environ.get("PATH"))
    if nvcc:
        candidates.append(Path(os.path.realpath(nvcc)).parent.parent)
    candidates.append(Path("/usr/local/cuda"))
    return next((str(root) for root in candidates if is_toolkit(root)), None)


def sources(csrc: Path, dims: tuple[int, ...] = HEAD_DIMS) -> list[Path]:
    """The extension's translation units: every .cpp, then every .cu, sorted; of the per-head-dim
    attention units (attention_{fwd,bwd}_hdim<D>.cu) those of `dims`."""
    left_out = {
        f"attention_{p}_hdim{d}.cu" for d in HEAD_DIMS if d not in dims for p in ("fwd", "bwd")
    }
    return sorted(csrc.rglob("*.cpp")) + sorted(
        p for p in csrc.rglob("*.cu") if p.name not in left_out
    )
