"""The package as users get it: the source distribution ships every source, and a wheel built
from it without the extension (what plain `pip install .` gives: an isolated build environment
has no torch) imports, reports that `backend="cuda"` will compile `_C`, and compiles it from
its own copy of the sources on first use.

One nvcc build (one arch, ~1 min on 2 cores). The ahead-of-time build of `_C` by setup.py is
CI's own install (`make install` with FUSEDATTN_FORCE_CUDA_BUILD=1: a compile error fails CI;
test_build.py checks its archs and metadata); it compiles the same csrc/ the sdist must ship
(checked file for file below), which the first-use build here compiles from the wheel built
out of the sdist. (A second nvcc build, of a wheel with `_C` from the sdist, took 76 of the
suite's 757 s on CI's 2-core machine and proved nothing these two do not.) Everything happens
in a copy of the working tree and temporary folders: nothing is installed into this
environment.
"""

import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow
needs_nvcc = pytest.mark.skipif(
    torch.version.cuda is None
    or (not Path("/usr/local/cuda/bin/nvcc").exists() and "CUDA_HOME" not in os.environ),
    reason="needs a CUDA build of torch and nvcc",
)
# The sdist's own extras: headers that only #include pulls in, and the tests' helpers.
MUST_SHIP = [
    "csrc/bindings.cpp", "csrc/attention/attention_launch.cuh", "csrc/attention/kernel_traits.h",
    "csrc/common/static_switch.h", "csrc/layernorm/layernorm.h", "triton_kernels/attention.py",
    "tests/conftest.py", "tests/hard_shapes.py", "tests/kx_check.py", "tests/dispatch_probe.py",
    "benchmarks/harness.py", "MANIFEST.in", "python/fusedattn/_build/toolkit.py",
]  # fmt: skip


# The installed copy alone: this environment's editable install of the repository would
# otherwise answer imports the installed wheel cannot (its finder comes after PYTHONPATH's).
ISOLATE = (
    "import sys; sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in repr(f)]; "
)


def installed_python(code: str) -> list[str]:
    return [sys.executable, "-c", ISOLATE + code]


INFO = "import runpy; sys.argv = ['info', '--extension']; runpy.run_module('fusedattn.info', run_name='__main__')"


def run(cmd, cwd, env=None, timeout=900):
    """cmd in a clean build environment: fusedattn's build switches of this process (CI sets
    FUSEDATTN_FORCE_CUDA_BUILD) do not leak in, only those `env` names."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("FUSEDATTN_")}
    env = {**inherited, "PYTHONNOUSERSITE": "1", **(env or {})}
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def install_stamp() -> str:
    return re.search(r"^INSTALL_STAMP := (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)


def test_make_keeps_its_stamp_out_of_a_folder_named_like_a_module():
    """A build/ folder at the root (make's stamp was there) is a namespace package named
    `build`: where the real `build` is not installed, `python -m build` then fails with
    "No module named build.__main__" instead of saying build is missing."""
    top = Path(install_stamp()).parts[0]
    assert not top.isidentifier(), f"make's stamp folder {top!r} can be imported as a module"


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """The sdist of a copy of the working tree (tracked and new, never ignored, files)."""
    src = tmp_path_factory.mktemp("src")
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    for name in listed:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    # the tree as `make` leaves it: with its install stamp
    (src / install_stamp()).parent.mkdir(parents=True, exist_ok=True)
    (src / install_stamp()).touch()
    out = tmp_path_factory.mktemp("dist")
    env = {"FUSEDATTN_SKIP_CUDA_BUILD": "1"}
    run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "-o", str(out)], src, env)
    (tarball,) = out.glob("fusedattn-*.tar.gz")
    return tarball


def test_sdist_ships_every_source_header_and_test_helper(sdist):
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    missing = [f for f in MUST_SHIP if f not in names]
    assert not missing, f"the sdist lacks {missing}"
    tracked = subprocess.run(["git", "ls-files", "csrc"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()  # fmt: skip
    sources = [f for f in tracked if (ROOT / f).is_file()]
    assert sources and not [f for f in sources if f not in names], "the sdist lacks CUDA sources"
    assert not any(n.startswith("benchmarks/results/") for n in names)


def wheel_from(sdist, out, env):
    run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
         "-w", str(out), str(sdist)], out, env)  # fmt: skip
    (wheel,) = out.glob("fusedattn-*.whl")
    return wheel


def install(wheel, target):
    run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target),
         str(wheel)], target.parent)  # fmt: skip
    return {"PYTHONPATH": str(target)}


@pytest.fixture(scope="module")
def plain_wheel(sdist, tmp_path_factory):
    """(wheel, environment running it installed) of a wheel built from the sdist without _C
    (FUSEDATTN_SKIP_CUDA_BUILD, as pip's isolated build gives), installed in a folder."""
    out = tmp_path_factory.mktemp("wheel")
    wheel = wheel_from(sdist, out, {"FUSEDATTN_SKIP_CUDA_BUILD": "1"})
    return wheel, install(wheel, out / "site")


def test_the_wheel_ships_the_kernels_and_the_sources_a_first_use_build_needs(plain_wheel, sdist):
    wheel, _ = plain_wheel
    names = zipfile.ZipFile(wheel).namelist()
    assert not any(n.startswith("fusedattn/_C") for n in names)
    assert "fusedattn/triton_kernels/attention.py" in names
    assert "fusedattn/_csrc/attention/attention_launch.cuh" in names
    with tarfile.open(sdist) as tar:
        csrc = [
            n.split("/", 1)[1]
            for n in tar.getnames()
            if "/csrc/" in n and tar.getmember(n).isfile()
        ]
    missing = [f for f in csrc if "fusedattn/_" + f not in names]
    assert csrc and not missing, f"the wheel lacks {missing}"


@needs_nvcc
def test_plain_install_compiles_the_extension_on_first_use(plain_wheel, tmp_path):
    """info says backend='cuda' will compile _C; the first use compiles it from the installed
    sources into the cache, says so in one line, and a new process loads it from there.

    One head dim (FUSEDATTN_CUDA_HEAD_DIMS=64): 2 of the 10 per-head-dim attention units, about
    half the build's 155 s on 2 cores; the install's build (CI's FORCE build) compiles all."""
    _, env = plain_wheel
    env = env | {"FUSEDATTN_CACHE_DIR": str(tmp_path / "cache"), "TORCH_CUDA_ARCH_LIST": "8.0",
                 "MAX_JOBS": "2", "FUSEDATTN_CUDA_HEAD_DIMS": "64"}  # fmt: skip
    before = run(installed_python(INFO), tmp_path, env)
    assert "compiles it on first use" in before
    # What the first call with backend="cuda" runs (its kernels need a GPU, the build not).
    code = "from fusedattn.ops.core import backends; e = backends.extension(); "
    code += "print(e.build_info()['ops'], backends.EXTENSION_ORIGIN, e.__file__); "
    code += "print('head dims', e.build_info()['attention_head_dims'])"
    built = run(installed_python(code), tmp_path, env)
    assert "compiling the CUDA extension for 8.0" in built
    assert "['attention', 'layer_norm', 'rms_norm', 'softmax'] first-use build" in built
    assert "head dims [64]" in built  # 32 rounds up to 64; 96 and above refused in Python
    after = run(installed_python(INFO), tmp_path, env)
    assert "first-use build" in after and str(tmp_path / "cache") in after
