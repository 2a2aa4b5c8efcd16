"""Build script for fusedattn.

Installs the package `fusedattn` from python/fusedattn/ and the Triton kernels from
triton_kernels/ as `fusedattn.triton_kernels`. When a CUDA build of torch and nvcc are present it
also compiles the extension `fusedattn._C` from csrc/; otherwise it installs the pure-Python /
Triton package and says why in one line.

Environment:
  FUSEDATTN_SKIP_CUDA_BUILD=1   never build fusedattn._C
  FUSEDATTN_FORCE_CUDA_BUILD=1  build it or fail (CI uses this so a compile error fails the run)
  TORCH_CUDA_ARCH_LIST          archs to compile for; default "8.0;9.0a" (A100 and Hopper)
  MAX_JOBS                      parallel compile jobs (read by torch's ninja build)
  CUDA_HOME                     CUDA toolkit; guessed from nvcc when unset
"""

import os
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
DEFAULT_ARCH_LIST = "8.0;9.0a"


def _flag(name: str, environ=os.environ) -> bool:
    return environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _is_toolkit(root: Path) -> bool:
    return (root / "include" / "cuda_runtime.h").exists() and (root / "bin" / "nvcc").exists()


def guess_cuda_home(environ=os.environ) -> str | None:
    """The toolkit root: $CUDA_HOME if it holds a toolkit, else the root of the real nvcc.

    torch derives CUDA_HOME from `which nvcc`, which picks /usr/local when nvcc is a wrapper
    script in /usr/local/bin; the link then fails on -lcudart. So look for a root that has
    include/cuda_runtime.h and bin/nvcc: $CUDA_HOME, the nvcc on PATH followed through links,
    then /usr/local/cuda.
    """
    if environ.get("CUDA_HOME"):
        return environ["CUDA_HOME"] if _is_toolkit(Path(environ["CUDA_HOME"])) else None
    candidates = []
    nvcc = shutil.which("nvcc", path=environ.get("PATH"))
    if nvcc:
        candidates.append(Path(os.path.realpath(nvcc)).parent.parent)
    candidates.append(Path("/usr/local/cuda"))
    return next((str(root) for root in candidates if _is_toolkit(root)), None)


def cuda_build_decision(environ=os.environ) -> tuple[bool, str]:
    """(build?, reason). Pure apart from probing torch and the file system; tested."""
    if _flag("FUSEDATTN_SKIP_CUDA_BUILD", environ):
        return False, "FUSEDATTN_SKIP_CUDA_BUILD is set"
    try:
        import torch
    except ImportError:
        return False, (
            "torch is not importable in the build environment "
            "(build with `pip install --no-build-isolation .` to compile fusedattn._C)"
        )
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} is a CPU build"
    cuda_home = guess_cuda_home(environ)
    if cuda_home is None:
        where = (
            f"CUDA_HOME={environ['CUDA_HOME']} has no bin/nvcc"
            if environ.get("CUDA_HOME")
            else "nvcc was not found"
        )
        return False, f"{where}; set CUDA_HOME to a CUDA toolkit to build fusedattn._C"
    return True, f"CUDA {torch.version.cuda} toolkit at {cuda_home}"


def cuda_extensions():
    build, reason = cuda_build_decision()
    force = _flag("FUSEDATTN_FORCE_CUDA_BUILD")
    if not build:
        if force:
            sys.exit(
                f"fusedattn: FUSEDATTN_FORCE_CUDA_BUILD=1 but cannot build fusedattn._C: {reason}"
            )
        print(f"fusedattn: installing without the CUDA extension fusedattn._C: {reason}")
        return [], {}

    os.environ.setdefault("CUDA_HOME", guess_cuda_home())
    # torch's arch helper queries the GPU when the list is unset and crashes without one.
    arch_list = os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
    from torch.utils.cpp_extension import BuildExtension, CUDAExtension

    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.cpp"))
    sources += sorted(str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*.cu"))
    print(f"fusedattn: building fusedattn._C for TORCH_CUDA_ARCH_LIST={arch_list}: {reason}")
    ext = CUDAExtension(
        name="fusedattn._C",
        sources=sources,
        include_dirs=[str(ROOT / "csrc")],
        # No -std flag: torch.utils.cpp_extension picks the standard its headers need (C++20
        # from torch 2.14 on, C++17 before). No --use_fast_math: fp32 inputs must be computed
        # to fp32 accuracy, so kernels choose fast intrinsics (exp2f, rsqrtf) explicitly.
        extra_compile_args={
            "cxx": ["-O3"],
            "nvcc": [
                "-O3",
                "--expt-relaxed-constexpr",
                "-lineinfo",
                # FUSEDATTN_TUNING=1: extra attention tile variants, picked at run time by
                # scripts/tune_attention.py (GPU tuning runs only; never in a release build).
                *(["-DFUSEDATTN_TUNING"] if os.environ.get("FUSEDATTN_TUNING") == "1" else []),
            ],
        },
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


if __name__ == "__main__":
    ext_modules, cmdclass = cuda_extensions()
    setup(
        packages=[
            "fusedattn",
            *(f"fusedattn.{p}" for p in find_packages("python/fusedattn")),
            "fusedattn.triton_kernels",
        ],
        package_dir={
            "fusedattn": "python/fusedattn",
            # Never a top-level `triton_kernels`: PyPI already has a package of that name.
            "fusedattn.triton_kernels": "triton_kernels",
        },
        ext_modules=ext_modules,
        cmdclass=cmdclass,
        zip_safe=False,
    )
