"""The CUDA attention kernels' index arithmetic, run on the host (no GPU, no nvcc).

csrc/attention/tiling.h holds what the kernels compute about tiles without touching the GPU:
which thread copies which 16-byte chunk, which rows a lane hands to ldmatrix, which key tiles
need no mask. tests/tiling_check.cpp checks it exhaustively on every tile shape the kernels
instantiate; this test builds that with the host C++ compiler and runs it.
"""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
COMPILER = shutil.which("c++") or shutil.which("g++")


@pytest.mark.skipif(COMPILER is None, reason="no host C++ compiler")
def test_tiling_arithmetic_on_the_host(tmp_path):
    exe = tmp_path / "tiling_check"
    build = subprocess.run(
        [COMPILER, "-std=c++17", "-O1", "-Wall", "-Werror", "-I", str(ROOT / "csrc"),
         str(ROOT / "tests" / "tiling_check.cpp"), "-o", str(exe)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().endswith("0 failures")
