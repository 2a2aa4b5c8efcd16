"""Build script for fusedattn.

Installs the package `fusedattn` from python/fusedattn/ and the Triton kernels from
triton_kernels/ as `fusedattn.triton_kernels`. When a CUDA build of torch, nvcc and a GPU are
present it also compiles the extension `fusedattn._C` from csrc/ (a few minutes); otherwise it
installs the pure-Python / Triton package and says why in one line. Without a visible GPU the
compile is skipped unless asked for: on a 2-core machine with no GPU it took 6 of the 8.5
minutes of a first `make bench` for a kernel that could not run there.

Environment:
  FUSEDATTN_SKIP_CUDA_BUILD=1   never build fusedattn._C
  FUSEDATTN_FORCE_CUDA_BUILD=1  build it or fail, GPU or not (CI uses this so a compile error
                                fails the run; also for building images on a machine
                                without a GPU)
  TORCH_CUDA_ARCH_LIST          archs to compile for; default "8.0;9.0a" (A100 and Hopper)
  FUSEDATTN_CUDA_HEAD_DIMS      attention head dims to build, e.g. "64,128"; default all of
                                32,64,96,128,256 (a subset builds faster; larger head dims
                                then run on Triton)
  MAX_JOBS                      parallel compile jobs (read by torch's ninja build)
  CUDA_HOME                     CUDA toolkit; guessed from nvcc when unset

The CUDA sources also ship inside the package (fusedattn/_csrc): where the extension was not
built here (plain `pip install .` builds in an isolated environment without torch),
backend="cuda" compiles it on first use into a per-user cache (fusedattn.ops.core.extension).
"""

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent


def _load_toolkit_helpers():
    """python/fusedattn/_build/toolkit.py (stdlib only), shared with the first-use build."""
    path = ROOT / "python" / "fusedattn" / "_build" / "toolkit.py"
    spec = importlib.util.spec_from_file_location("fusedattn_build_toolkit", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


toolkit = _load_toolkit_helpers()
DEFAULT_ARCH_LIST = toolkit.DEFAULT_ARCH_LIST
guess_cuda_home = toolkit.guess_cuda_home


def _flag(name: str, environ=os.environ) -> bool:
    return environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def cuda_build_decision(environ=os.environ, gpu_visible=None) -> tuple[bool, str]:
    """(build?, reason). Pure apart from probing torch, the GPU (gpu_visible=None: ask torch)
    and the file system; tested."""
    if _flag("FUSEDATTN_SKIP_CUDA_BUILD", environ):
        return False, "FUSEDATTN_SKIP_CUDA_BUILD is set"
    try:
        import torch
    except ImportError:
        return False, (
            "torch is not importable in the build environment (pip's isolated build); "
            "backend='cuda' compiles it on first use, or build it now with "
            "`pip install --no-build-isolation .`"
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
    if not _flag("FUSEDATTN_FORCE_CUDA_BUILD", environ):
        if gpu_visible is None:
            gpu_visible = torch.cuda.is_available()
        if not gpu_visible:
            return False, (
                "no CUDA device is visible here, so the compile (minutes) is left for later: "
                "backend='cuda' builds it on first use on a GPU machine; "
                "FUSEDATTN_FORCE_CUDA_BUILD=1 builds it now"
            )
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

    head_dims = toolkit.head_dims()
    sources = [str(p.relative_to(ROOT)) for p in toolkit.sources(ROOT / "csrc", head_dims)]
    print(f"fusedattn: building fusedattn._C for TORCH_CUDA_ARCH_LIST={arch_list}: {reason}")
    ext = CUDAExtension(
        name="fusedattn._C",
        sources=sources,
        include_dirs=[str(ROOT / "csrc")],
        extra_compile_args={
            "cxx": toolkit.CXX_FLAGS,
            "nvcc": [
                *toolkit.NVCC_FLAGS,
                *toolkit.head_dim_flags(head_dims),
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
            "fusedattn._csrc",
        ],
        package_dir={
            "fusedattn": "python/fusedattn",
            # Never a top-level `triton_kernels`: PyPI already has a package of that name.
            "fusedattn.triton_kernels": "triton_kernels",
            # The CUDA sources, for the first-use build where _C was not built at install.
            "fusedattn._csrc": "csrc",
        },
        package_data={"fusedattn._csrc": ["*.cpp", "**/*.cu", "**/*.cuh", "**/*.h"]},
        ext_modules=ext_modules,
        cmdclass=cmdclass,
        zip_safe=False,
    )
