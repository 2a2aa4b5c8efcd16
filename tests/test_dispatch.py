"""Backend dispatch: names, FUSEDATTN_BACKEND, auto order, refusals listing every reason, and
which implementation actually ran."""

import json
import subprocess
import sys

import pytest
import torch
from kx_check import attention_inputs

import fusedattn
from fusedattn import reference
from fusedattn.ops.core import backends


def small_qkv():
    return torch.randn(1, 2, 3, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)


def chosen(op, backend="auto", **inputs):
    device = next(v for v in inputs.values() if isinstance(v, torch.Tensor)).device
    return backends.select(op, backend, device, inputs).backend


def attn_inputs(**overrides):
    return attention_inputs(*small_qkv(), **overrides)


def test_auto_on_cpu_runs_torch_and_falls_to_reference_only_for_what_torch_refuses():
    assert chosen("attention", **attn_inputs()) == "torch"
    assert chosen("attention", **attn_inputs(return_lse=True)) == "reference"
    assert (
        chosen(
            "layer_norm",
            x=torch.randn(2, 4),
            normalized_shape=(4,),
            weight=None,
            bias=None,
            eps=1e-5,
        )
        == "torch"
    )
    assert (
        chosen("softmax", x=torch.randn(2, 4), dim=1, mask=None, scale=None, is_causal=False)
        == "torch"
    )


def test_the_chosen_implementation_is_the_one_that_runs(monkeypatch):
    ran = []
    impl = backends._REGISTRY["softmax"]["reference"]
    monkeypatch.setitem(
        backends._REGISTRY["softmax"],
        "reference",
        backends.Implementation(
            "softmax",
            "reference",
            lambda **kw: ran.append("reference") or impl.run(**kw),
            impl.refusals,
        ),
    )
    fusedattn.softmax(torch.randn(2, 3), backend="reference")
    assert ran == ["reference"]
    fusedattn.softmax(torch.randn(2, 3))  # auto on CPU: torch
    assert ran == ["reference"]


def test_env_override_replaces_auto_but_not_an_explicit_backend(monkeypatch):
    monkeypatch.setenv("FUSEDATTN_BACKEND", "reference")
    assert chosen("attention", **attn_inputs()) == "reference"
    assert chosen("attention", backend="torch", **attn_inputs()) == "torch"
    monkeypatch.setenv("FUSEDATTN_BACKEND", "torch")
    with pytest.raises(ValueError, match=r"backend='torch' \(from FUSEDATTN_BACKEND\)"):
        fusedattn.attention(*small_qkv(), return_lse=True)
    monkeypatch.setenv("FUSEDATTN_BACKEND", "fastest")
    with pytest.raises(ValueError, match="FUSEDATTN_BACKEND must be one of"):
        fusedattn.attention(*small_qkv())


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="backend must be one of"):
        fusedattn.attention(*small_qkv(), backend="flash")


def test_explicit_backend_refusal_lists_every_reason(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(fusedattn.BackendUnavailableError) as info:
        fusedattn.attention(*(t.double() for t in small_qkv()), backend="triton")
    message = str(info.value)
    assert "TRITON_INTERPRET=1 is not set" in message
    assert "float16, bfloat16 and float32, got torch.float64" in message
    with pytest.raises(ValueError) as info:
        fusedattn.attention(*small_qkv(), backend="cuda")
    assert "needs CUDA tensors" in str(info.value)
    assert "float16 and bfloat16, got torch.float32" in str(info.value)


def test_torch_backend_refuses_return_lse_with_its_reason():
    with pytest.raises(ValueError, match="does not return the log-sum-exp"):
        fusedattn.attention(*small_qkv(), return_lse=True, backend="torch")


def test_no_backend_at_all_lists_each_candidate(monkeypatch):
    monkeypatch.setattr(backends, "AUTO_ORDER", {"cpu": {"softmax": ("triton", "cuda")}})
    with pytest.raises(ValueError, match="no backend can run softmax") as info:
        fusedattn.softmax(torch.randn(2, 3, dtype=torch.float64))
    assert "triton:" in str(info.value) and "cuda:" in str(info.value)


def test_available_backends_on_cpu(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton kernels run on CPU in it
    assert fusedattn.available_backends("cpu") == ["reference", "torch", "triton"]
    report = backends.backend_report("cpu")
    assert set(report) == {
        "attention", "varlen_attention", "attention_with_kvcache", "mla_attention_with_kvcache",
        "layer_norm", "rms_norm", "softmax", "linear",
    }  # fmt: skip
    assert report["mla_attention_with_kvcache"]["cuda"]  # no CUDA C++ MLA kernel: said so
    assert report["attention"]["reference"] == [] and report["attention"]["torch"] == []
    assert report["softmax"]["triton"] == [] and report["layer_norm"]["triton"] == []
    assert report["attention"]["triton"] == [] and report["softmax"]["cuda"]
    monkeypatch.delenv("TRITON_INTERPRET")
    assert fusedattn.available_backends("cpu") == ["reference", "torch"]


def _run(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)


def test_import_touches_neither_triton_nor_cuda():
    out = _run(
        "import sys, torch, fusedattn;print('triton' in sys.modules, torch.cuda.is_initialized())"
    ).stdout.split()
    assert out == ["False", "False"]


def test_info_cli_reports_versions_extension_and_backends():
    """`python -m fusedattn.info` as a user runs it (one process), then its --json and
    --extension answers through main() in this one (each process a torch import)."""
    import contextlib
    import io

    from fusedattn import info

    text = subprocess.run(
        [sys.executable, "-m", "fusedattn.info"], capture_output=True, text=True, check=True
    ).stdout
    assert f"fusedattn {fusedattn.__version__}" in text
    assert f"torch {torch.__version__}" in text
    assert "fusedattn._C:" in text and "attention:" in text

    def answer(*argv):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert info.main(list(argv)) in (0, None)
        return out.getvalue()

    data = json.loads(answer("--json"))
    assert data["torch"] == torch.__version__
    line = answer("--extension")
    assert line.startswith("fusedattn._C: ") and line.count("\n") == 1
    assert "reference" in data["available_backends"]


def test_dispatch_traces_without_graph_breaks_on_the_gpu_order():
    """torch.compile(fullgraph=True) must trace the whole auto order a GPU takes (cuda, triton,
    torch), not only the CPU one: select is run for a CUDA device on CPU tensors here."""
    torch._dynamo.reset()
    q = torch.randn(1, 2, 4, 8)

    def f(q):
        inputs = attention_inputs(q, q, q)
        return backends.select("attention", "auto", torch.device("cuda"), inputs).run(**inputs)

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q), f(q))


def test_cuda_named_may_compile_the_extension_on_first_use_auto_never_waits(monkeypatch):
    """Without a built extension but with a toolkit: backend="cuda" is accepted (its first
    call compiles the extension), auto skips cuda with the reason; once built, both use it."""
    cuda = torch.device("cuda")
    for name, value in (("EXTENSION", None), ("EXTENSION_ORIGIN", ""), ("EXTENSION_OPS", frozenset()),
                        ("EXTENSION_ERROR", "not built; backend='cuda' compiles it")):  # fmt: skip
        monkeypatch.setattr(backends, name, value)  # restored after the test
    monkeypatch.setattr(backends, "BUILD_ON_FIRST_USE", True)
    assert backends.device_refusals("cuda", cuda) == []
    assert backends.device_refusals("cuda", cuda, auto=True) == [backends.EXTENSION_ERROR]

    class Built:
        @staticmethod
        def build_info():
            return {"ops": ["attention", "layer_norm", "softmax"]}

    built = []
    monkeypatch.setattr(backends.extension_loader, "build", lambda: built.append(1) or Built)
    assert backends.extension() is Built and backends.extension() is Built and built == [1]
    assert backends.EXTENSION_ORIGIN == "first-use build" and "softmax" in backends.EXTENSION_OPS
    assert backends.device_refusals("cuda", cuda, auto=True) == []
    monkeypatch.setattr(backends, "EXTENSION", None)
    monkeypatch.setattr(backends, "BUILD_ON_FIRST_USE", False)  # no toolkit: refused by name
    assert backends.device_refusals("cuda", cuda) == [backends.EXTENSION_ERROR]


def test_the_reference_backend_serves_float64_rowwise_calls():
    """backend="reference" takes float64 row-wise calls through dispatch (the naive modules of
    the reference transformer used to be the only float64 callers; they now call the naive
    ops directly, fusedattn.reference.modules)."""
    x = torch.randn(3, 16, dtype=torch.float64)
    w, b = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    torch.testing.assert_close(
        fusedattn.layer_norm(x, 16, w, b, backend="reference"), reference.layer_norm(x, 16, w, b)
    )
    torch.testing.assert_close(fusedattn.softmax(x, -1, backend="reference"), reference.softmax(x))
