"""RMSNorm in every backend against float64 with the k× rule (Triton: interpreter on CPU,
compiled on a GPU; CUDA C++ on a GPU): sizes no block divides, one-pass and looped paths,
optional/fp32/strided parameters, layouts, F.rms_norm's eps; the drop-in module against
nn.RMSNorm; swap_modules on nn.RMSNorm and on Hugging Face Llama-family models."""

import copy
from functools import partial

import pytest
import torch
from dispatch_probe import count_dispatches
from kx_check import assert_op_kx
from launch_probe import probe_kernels
from torch import nn

import fusedattn
from fusedattn import reference
from fusedattn.testing import ABS_FLOOR, assert_close_kx

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
kernels = pytest.mark.kernels


def check(x, weight=None, shape=None, backend="triton", eps=1e-6):
    shape = shape or x.shape[-1:]
    tensors = dict(x=x, weight=weight)
    grad_of = tuple(n for n, t in tensors.items() if t is not None)
    # dx rounding noise grows with rstd (large where a row's values are small)
    ms = x.double().flatten(-len(shape)).square().mean(-1)
    rstd = torch.rsqrt(ms + (torch.finfo(x.dtype).eps if eps is None else eps)).max().item()
    op = partial(fusedattn.rms_norm, backend=backend)
    assert_op_kx(op, reference.rms_norm, tensors, kwargs=dict(normalized_shape=shape, eps=eps),
                 grad_of=grad_of, grad_atol=ABS_FLOOR[x.dtype] * max(1.0, rstd))  # fmt: skip


@pytest.fixture
def K():
    return pytest.importorskip("fusedattn.triton_kernels.layernorm")


# ---- Triton ----------------------------------------------------------------------------------


@kernels
@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [1, 7, 127, 1000, 4097])
def test_triton_one_pass_kx(N, dtype, K, monkeypatch):
    probes = probe_kernels(monkeypatch, K, "layer_norm_fwd_one_pass", "layer_norm_bwd_one_pass")
    x = (torch.randn(3, 5, N) * 2 + 1).to(dtype)
    check(x, torch.randn(N, dtype=dtype))
    assert probes["layer_norm_fwd_one_pass"].grids == [(15,)]


@kernels
@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("N", [1000, 4097])
def test_triton_looped_path_kx(N, dtype, K, monkeypatch):
    monkeypatch.setattr(K, "MAX_ONE_PASS_N", 256)  # force rows longer than one block
    names = ("layer_norm_fwd_looped", "layer_norm_bwd_dx_looped", "layer_norm_bwd_params_looped")
    probes = probe_kernels(monkeypatch, K, *names)
    check((torch.randn(2, 3, N) * 3 + 5).to(dtype), torch.randn(N, dtype=dtype))
    assert all(len(probes[n].grids) == 1 for n in names)


@kernels
@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize(
    "case", ["no_weight", "fp32_weight_bf16_x", "strided_weight", "expanded_weight",
             "transposed_x", "two_dims", "eps_none"],
)  # fmt: skip
def test_triton_parameters_layouts_and_eps(case):
    x = torch.randn(6, 40)
    if case == "no_weight":
        check(x, None)
    elif case == "fp32_weight_bf16_x":
        check(x.bfloat16(), torch.randn(40))
    elif case == "strided_weight":
        check(x, torch.randn(80)[::2])
    elif case == "expanded_weight":
        check(x, torch.randn(1).expand(40))
    elif case == "transposed_x":
        check(torch.randn(8, 6, 40).transpose(0, 1), torch.randn(40))
    elif case == "two_dims":
        check(torch.randn(3, 4, 10), torch.randn(4, 10), shape=(4, 10))
    else:  # F.rms_norm's default: torch.finfo(x.dtype).eps
        check(torch.randn(6, 40).half() * 1e-3, torch.randn(40).half(), eps=None)


@kernels
@pytest.mark.usefixtures("kernel_device")
def test_triton_empty_batch_deterministic_grads_and_compile():
    x = torch.randn(0, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    fusedattn.rms_norm(x, 16, w, backend="triton").sum().backward()
    assert (w.grad == 0).all()
    x = torch.randn(64, 48, requires_grad=True)
    grads = []
    for _ in range(2):
        w.grad = None
        g = torch.Generator().manual_seed(1)  # a CPU generator: draw there, then move
        w48 = torch.randn(48, generator=g, device="cpu").to(x.device).requires_grad_()
        fusedattn.rms_norm(x, 48, w48, backend="triton").square().sum().backward()
        grads.append(w48.grad.clone())
    assert torch.equal(grads[0], grads[1])
    torch._dynamo.reset()
    f = torch.compile(lambda x, w: fusedattn.rms_norm(x, 48, w, backend="triton"),
                      fullgraph=True, backend="aot_eager")  # fmt: skip
    torch.testing.assert_close(f(x, w48), fusedattn.rms_norm(x, 48, w48, backend="triton"))


# ---- reference and torch -----------------------------------------------------------------------


def test_reference_is_f_rms_norm_in_float64():
    x, w = torch.randn(4, 5, 33, dtype=torch.float64), torch.randn(33, dtype=torch.float64)
    for eps in (None, 1e-5):
        torch.testing.assert_close(
            reference.rms_norm(x, 33, w, eps), torch.nn.functional.rms_norm(x, (33,), w, eps)
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [1, 7, 1000, 4097])
def test_torch_backend_kx(N, dtype):
    check((torch.randn(3, 5, N) + 0.5).to(dtype), torch.randn(N, dtype=dtype), backend="torch")
    check(torch.randn(4, N).to(dtype), torch.randn(N), backend="torch")  # fp32 weight


def test_bad_input_gets_clear_errors():
    for backend in ("reference", "torch", "auto"):
        with pytest.raises(ValueError, match="must end with normalized_shape"):
            fusedattn.rms_norm(torch.randn(3, 8), 7, backend=backend)
        with pytest.raises(TypeError, match=r"weight must be torch\.float32"):
            fusedattn.rms_norm(torch.randn(3, 8), 8, torch.ones(8, dtype=torch.float64),
                               backend=backend)  # fmt: skip
        with pytest.raises(ValueError, match="eps must be a non-negative float"):
            fusedattn.rms_norm(torch.randn(3, 8), 8, eps=-1.0, backend=backend)


# ---- CUDA C++ ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [1, 7, 127, 1000, 1024, 1025, 4096, 4097, 65536])
def test_cuda_backend_kx(N, dtype):
    """The CUDA C++ kernels with RMS: warp-per-row up to 1024, block-per-row beyond, vector
    and scalar loads, fp32 and same-dtype weights, a strided input, no weight."""
    x = (torch.randn(3, 5, N, device="cuda") * 2 + 1).to(dtype)
    check(x, torch.randn(N, device="cuda", dtype=dtype), backend="cuda")
    check(x[:, ::2], torch.randn(N, device="cuda"), backend="cuda")
    check(x, None, backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [8, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 32776])
def test_cuda_fast_path_rows_kx(N, dtype):
    """RMS through the CUDA fast path (layernorm_rows.cuh) at every row shape it launches,
    with and without a weight, a sliced row view with aligned row starts, and a weight 4 bytes
    off alignment (the general kernels)."""
    x = (torch.randn(4, 3, N, device="cuda") * 2 + 1).to(dtype)
    check(x, torch.randn(N, device="cuda", dtype=dtype), backend="cuda")
    check(x, None, backend="cuda")
    wide = (torch.randn(4, 3, N + 8, device="cuda") * 2 + 1).to(dtype)
    check(wide[..., :N], torch.randn(N, device="cuda"), backend="cuda")
    check(x, torch.randn(N + 1, device="cuda")[1:], backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [256, 1024, 4096, 8192])
def test_cuda_fused_backward_many_rows_kx(N, dtype):
    """RMS through the fused backward (dx and the weight's partials in one pass) on rows well
    past one wave of its row groups."""
    x = (torch.randn(3000, N, device="cuda") * 2 + 1).to(dtype)
    check(x, torch.randn(N, device="cuda", dtype=dtype), backend="cuda")


# ---- modules and swap ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("kw", [{}, {"eps": 1e-3}, {"elementwise_affine": False}], ids=str)
def test_module_matches_nn_rmsnorm(backend, kw):
    torch.manual_seed(0)
    theirs = nn.RMSNorm((4, 8), **kw)
    with torch.no_grad():
        if theirs.weight is not None:
            theirs.weight.normal_()
    ours = fusedattn.RMSNorm((4, 8), **kw, backend=backend)
    assert repr(ours) == repr(theirs)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 4, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    torch.testing.assert_close(ours(x), theirs(x2))
    ours(x).square().sum().backward()
    theirs(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    if theirs.weight is not None:
        torch.testing.assert_close(ours.weight.grad, theirs.weight.grad)


def test_swap_replaces_nn_rmsnorm_and_runs_it():
    model = nn.Sequential(nn.Linear(8, 8), nn.RMSNorm(8, eps=1e-5), nn.LayerNorm(8))
    swapped = fusedattn.swap_modules(copy.deepcopy(model), backend="reference")
    assert isinstance(swapped[1], fusedattn.RMSNorm) and swapped[1].eps == 1e-5
    x = torch.randn(2, 8)
    with count_dispatches() as counts:
        torch.testing.assert_close(swapped(x), model(x))
    assert counts[("rms_norm", "reference")] == 1
    kept = fusedattn.swap_modules(copy.deepcopy(model), rmsnorm=False)
    assert type(kept[1]) is nn.RMSNorm


transformers = pytest.importorskip("transformers")


def llama_config(**kw):
    return transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["reference", "torch", pytest.param("triton", marks=kernels)])
def test_hf_llama_rmsnorm_swaps_and_logits_match_within_the_model_rule(backend, device):
    torch.manual_seed(0)
    # on the GPU when there is one: there the Triton backend refuses CPU tensors (H100 run)
    model = transformers.LlamaForCausalLM(llama_config()).eval().to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    truth = copy.deepcopy(model).double()
    swapped = fusedattn.swap_modules(copy.deepcopy(model), backend=backend, attention=False)
    norms = [m for m in swapped.modules() if isinstance(m, fusedattn.RMSNorm)]
    assert len(norms) == 2 * 2 + 1  # two per layer and the final norm
    assert all(m.eps == 1e-6 and m.weight_after_rounding for m in norms)
    assert swapped.state_dict().keys() == model.state_dict().keys()
    ids = torch.randint(0, 100, (2, 9), device=device)
    with count_dispatches() as counts:
        got = swapped(input_ids=ids).logits
    assert counts[("rms_norm", backend)] == 5
    assert_close_kx(got, truth(input_ids=ids).logits, model(input_ids=ids).logits, k=3.0)


def test_hf_norms_with_other_math_are_left_alone_and_mixed_dtypes_keep_hf_output_dtype():
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from fusedattn.modules.rmsnorm import is_hf_llama_rms_norm

    gemma = Gemma2RMSNorm(8)  # y * (1 + weight) in fp32: different math, not swapped
    assert not is_hf_llama_rms_norm(gemma)
    assert fusedattn.swap_modules(nn.Sequential(gemma))[0] is gemma
    llama = LlamaRMSNorm(8, eps=1e-5)  # fp32 weight
    with torch.no_grad():
        llama.weight.normal_()
    ours = fusedattn.swap_modules(nn.Sequential(copy.deepcopy(llama)), backend="reference")[0]
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    want = llama(x)
    got = ours(x)
    assert got.dtype == want.dtype == torch.float32  # HF promotes to the weight's dtype
    torch.testing.assert_close(got, want)
