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


def sources(csrc: Path) -> list[Path]:
    """The extension's translation units: every .cpp, then every .cu, sorted."""
    return sorted(csrc.rglob("*.cpp")) + sorted(csrc.rglob("*.cu"))
