"""Packaging: the setup.py build decision, and the compiled extension's real metadata.

CI sets FUSEDATTN_EXPECT_CUDA_BUILD=1 (it builds fusedattn._C with nvcc), so there a missing
or broken extension fails instead of skipping.
"""

import importlib.util
import os
from pathlib import Path

import pytest

import fusedattn.info

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def setup_module_():
    spec = importlib.util.spec_from_file_location("fusedattn_setup", ROOT / "setup.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # setup() only runs under __main__
    return module


def test_skip_flag_wins(setup_module_):
    build, reason = setup_module_.cuda_build_decision({"FUSEDATTN_SKIP_CUDA_BUILD": "1"})
    assert not build and "FUSEDATTN_SKIP_CUDA_BUILD" in reason


def test_no_toolkit_means_a_clean_skip(setup_module_, tmp_path, monkeypatch):
    monkeypatch.setattr(setup_module_.toolkit, "Path", lambda p: tmp_path / "nowhere")
    build, reason = setup_module_.cuda_build_decision({"PATH": str(tmp_path)})
    import torch

    if torch.version.cuda is None:
        assert not build and "CPU build" in reason
    else:
        assert not build and "nvcc" in reason


def test_no_gpu_means_no_compile_unless_forced(setup_module_, monkeypatch):
    """A CUDA torch and nvcc but no GPU (this CPU machine, CI): the minutes of nvcc are skipped
    with a reason, unless FUSEDATTN_FORCE_CUDA_BUILD=1 asks for them (CI does)."""
    import torch

    monkeypatch.setattr(setup_module_, "guess_cuda_home", lambda environ=None: "/usr/local/cuda")
    if torch.version.cuda is None:
        pytest.skip("torch is a CPU build here: the decision stops before the GPU")
    build, reason = setup_module_.cuda_build_decision({}, gpu_visible=False)
    assert not build and "no CUDA device is visible" in reason and "FORCE" in reason
    forced = {"FUSEDATTN_FORCE_CUDA_BUILD": "1"}
    assert setup_module_.cuda_build_decision(forced, gpu_visible=False)[0]
    assert setup_module_.cuda_build_decision({}, gpu_visible=True)[0]


def test_cuda_home_is_the_real_toolkit_not_the_wrapper_dir(setup_module_, tmp_path):
    toolkit = tmp_path / "cuda-13.0"
    (toolkit / "bin").mkdir(parents=True)
    (toolkit / "include").mkdir()
    (toolkit / "include" / "cuda_runtime.h").touch()
    nvcc = toolkit / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n")
    nvcc.chmod(0o755)
    wrapper_dir = tmp_path / "local-bin"
    wrapper_dir.mkdir()
    (wrapper_dir / "nvcc").symlink_to(nvcc)
    assert setup_module_.guess_cuda_home({"PATH": str(wrapper_dir)}) == str(toolkit)
    assert setup_module_.guess_cuda_home({"CUDA_HOME": str(toolkit), "PATH": ""}) == str(toolkit)
    assert setup_module_.guess_cuda_home({"CUDA_HOME": str(tmp_path), "PATH": ""}) is None


def test_extension_reports_real_build_metadata():
    ext = fusedattn.info.extension_info()
    if not ext["built"]:
        if os.environ.get("FUSEDATTN_EXPECT_CUDA_BUILD") == "1":
            pytest.fail(f"fusedattn._C should have been built: {ext['reason']}")
        pytest.skip(f"fusedattn._C not built here: {ext['reason']}")
    import torch

    assert ext["cuda_compiled"] == torch.version.cuda
    assert ext["archs"], "nvcc compiled for no arch"
    expected = os.environ.get("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    for arch in expected.replace(" ", ";").split(";"):
        if arch:
            assert "sm_" + arch.replace(".", "").rstrip("a").replace("+PTX", "") in ext["archs"]
    assert ext["attention_head_dims"] == [32, 64, 96, 128, 256]
    assert ext["torch_compiled"] == torch.__version__.split("+")[0]


def test_a_head_dim_subset_builds_its_units_only_and_refuses_larger_head_dims(monkeypatch):
    """FUSEDATTN_CUDA_HEAD_DIMS: the per-head-dim units of the others are left out (with the
    defines that discard their HEADDIM_SWITCH cases), a malformed list names the accepted
    values, and the cuda backend refuses a head dim above the largest built (auto goes on)."""
    import torch

    from fusedattn._build import toolkit
    from fusedattn.ops.attention import cuda_backend
    from fusedattn.ops.core import backends

    assert (
        toolkit.head_dims({}) == toolkit.HEAD_DIMS
        and toolkit.head_dim_flags(toolkit.HEAD_DIMS) == []
    )
    dims = toolkit.head_dims({"FUSEDATTN_CUDA_HEAD_DIMS": "128; 64"})
    assert dims == (64, 128)
    names = {p.name for p in toolkit.sources(ROOT / "csrc", dims)}
    assert {"attention_fwd_hdim64.cu", "attention_bwd_hdim128.cu", "bindings.cpp"} <= names
    assert not {n for n in names if "hdim32" in n or "hdim96" in n or "hdim256" in n}
    assert toolkit.head_dim_flags(dims) == [f"-DFUSEDATTN_HDIM{d}=0" for d in (32, 96, 256)]
    for bad in ("48", "64,x", ","):
        with pytest.raises(ValueError, match="subset of 32, 64, 96, 128, 256"):
            toolkit.head_dims({"FUSEDATTN_CUDA_HEAD_DIMS": bad})

    monkeypatch.setattr(backends, "EXTENSION", None)  # the dims a first-use build would make
    monkeypatch.setenv("FUSEDATTN_CUDA_HEAD_DIMS", "64")
    q = torch.zeros(1, 1, 4, 128, dtype=torch.float16)
    why = cuda_backend.refusals(q=q, k=q, v=q)
    assert any("head dims up to 64 (this build: FUSEDATTN_CUDA_HEAD_DIMS)" in r for r in why), why
    small = torch.zeros(1, 1, 4, 40, dtype=torch.float16)
    assert not any("head dims up to" in r for r in cuda_backend.refusals(q=small, k=small, v=small))
    monkeypatch.setenv("FUSEDATTN_CUDA_HEAD_DIMS", "65")
    assert any(
        "FUSEDATTN_CUDA_HEAD_DIMS='65'" in r
        for r in cuda_backend.refusals(q=small, k=small, v=small)
    )
