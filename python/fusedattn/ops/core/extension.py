"""fusedattn._C, the CUDA C++ kernels: built ahead of time, or compiled on first use.

`pip install --no-build-isolation .` compiles `fusedattn._C` at install time. Plain
`pip install .` builds in an isolated environment without torch, so the extension cannot be
compiled there; the CUDA sources ship inside the package (fusedattn/_csrc) instead, and the
first call that names backend="cuda" compiles them with torch's cpp_extension (ninja, nvcc)
into a per-user cache keyed by the torch and CUDA versions, the GPU arch and the sources
(`$FUSEDATTN_CACHE_DIR`, else `$XDG_CACHE_HOME/fusedattn` or `~/.cache/fusedattn`). Later
processes load the cached build at import, without compiling. `auto` never starts a build:
it uses the extension once it exists.

FUSEDATTN_EXTENSION=jit ignores an ahead-of-time `_C` (for example one built against another
torch) and uses the cache, building into it if needed.

Probed once at import (neither initialises CUDA nor imports triton), so dispatch reads plain
module attributes that torch.compile traces without graph breaks.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

from ..._build import toolkit

MODULE_NAME = "fusedattn_C"  # the first-use build's module (TORCH_EXTENSION_NAME)
MODE_ENV = "FUSEDATTN_EXTENSION"
CACHE_ENV = "FUSEDATTN_CACHE_DIR"


def source_dir() -> Path | None:
    """The CUDA sources: inside the installed package, else the repository's csrc/ (an
    editable install maps fusedattn._csrc there too)."""
    spec = importlib.util.find_spec("fusedattn._csrc")
    for root in list(spec.submodule_search_locations or []) if spec else []:
        if (Path(root) / "bindings.cpp").exists():
            return Path(root)
    repo = Path(__file__).resolve().parents[4] / "csrc"
    return repo if (repo / "bindings.cpp").exists() else None


def arch_list() -> str:
    """TORCH_CUDA_ARCH_LIST if set, else the visible GPU's arch (sm_90 as 9.0a, as setup.py
    builds it), else setup.py's default list."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return os.environ["TORCH_CUDA_ARCH_LIST"]
    import torch

    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}" + ("a" if major == 9 else "")
    return toolkit.DEFAULT_ARCH_LIST


def cache_dir() -> Path:
    """This torch/CUDA/arch/source combination's build folder."""
    import torch

    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fusedattn"
    )
    digest = hashlib.sha1()
    src = source_dir()
    dims = toolkit.head_dims()
    for path in toolkit.sources(src, dims) + sorted(src.rglob("*.h")) + sorted(src.rglob("*.cuh")):
        digest.update(str(path.relative_to(src)).encode())
        digest.update(path.read_bytes())
    digest.update(repr(dims).encode())
    arch = arch_list().replace(";", "_").replace(" ", "_").replace(".", "")
    key = f"torch{torch.__version__}-cuda{torch.version.cuda}-sm{arch}-{digest.hexdigest()[:12]}"
    return Path(root) / key.replace("+", "_")


def cannot_build() -> str | None:
    """Why a first-use build is impossible here (None: it is possible)."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build"
    if source_dir() is None:
        return "the CUDA sources are not installed with the package"
    if toolkit.guess_cuda_home() is None:
        return "no CUDA toolkit (nvcc) was found; set CUDA_HOME"
    if importlib.util.find_spec("ninja") is None:
        return "ninja is not installed (pip install ninja)"
    return None


def _load_cached() -> object | None:
    """The first-use build from the cache, if one exists for this combination."""
    try:
        folder = cache_dir()
    except (OSError, AttributeError):
        return None
    built = sorted(folder.glob(f"{MODULE_NAME}*.so"))
    if not built:
        return None
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, str(built[0]))
    spec = importlib.util.spec_from_loader(MODULE_NAME, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def probe() -> tuple[object | None, str, str | None]:
    """(module or None, origin "ahead-of-time" / "first-use build", why it is unavailable)."""
    if os.environ.get(MODE_ENV, "auto") != "jit":
        try:
            return importlib.import_module("fusedattn._C"), "ahead-of-time", None
        except ImportError as exc:
            aot_error = f"fusedattn._C is not built or does not load ({exc})"
    else:
        aot_error = f"{MODE_ENV}=jit ignores fusedattn._C"
    try:
        module = _load_cached()
    except ImportError as exc:  # a stale or broken cached build: rebuild on first use
        module, aot_error = None, f"{aot_error}; the cached first-use build does not load ({exc})"
    if module is not None:
        return module, "first-use build", None
    why = cannot_build()
    if why is None:
        return None, "", f"{aot_error}; backend='cuda' compiles it on first use"
    return None, "", f"{aot_error}; no first-use build either: {why}"


def build(*, verbose: bool = False):
    """Compile the extension into the cache (minutes) and load it; raises RuntimeError with
    the reason when it cannot."""
    why = cannot_build()
    if why is not None:
        raise RuntimeError(f"fusedattn cannot compile its CUDA extension: {why}")
    os.environ.setdefault("CUDA_HOME", toolkit.guess_cuda_home())
    archs = arch_list()
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    print(
        f"fusedattn: compiling the CUDA extension for {archs} into {folder} (first use of "
        "backend='cuda'; a few minutes, once per torch/CUDA/GPU)",
        file=sys.stderr,
        flush=True,
    )
    import torch.utils.cpp_extension as cpp

    cpp.CUDA_HOME = os.environ["CUDA_HOME"]  # torch guessed it at import, maybe wrongly
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    try:
        src = source_dir()
        dims = toolkit.head_dims()
        return cpp.load(
            name=MODULE_NAME,
            sources=[str(p) for p in toolkit.sources(src, dims)],
            extra_include_paths=[str(src)],
            extra_cflags=toolkit.CXX_FLAGS,
            extra_cuda_cflags=toolkit.NVCC_FLAGS + toolkit.head_dim_flags(dims),
            build_directory=str(folder),
            verbose=verbose,
        )
    except Exception as exc:
        raise RuntimeError(
            f"fusedattn could not compile its CUDA extension in {folder}: {exc}"
        ) from exc
    finally:
        if saved is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved
