"""fusedattn.linear and fusedattn.Linear (issue #73 item 3: the matmuls of a decoder step
under batch invariance): the Triton kernel against float64 with the k× rule, forward and
backward, on shapes no tile divides; a row's bits alone and among other rows (torch.equal),
with the mutation check that torch's own matmul does not hold it; dispatch under the switch;
the drop-in module and swap_modules(linear=True), tied weights included. Triton under the
interpreter here, compiled on a GPU (the `invariant` preset runs this file)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from kx_check import assert_op_kx
from torch import nn

import fusedattn
from fusedattn import reference

kernels = pytest.mark.kernels
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture
def K():
    return pytest.importorskip("fusedattn.triton_kernels.matmul")


@kernels
@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "lead, in_f, out_f, bias",
    [((1,), 1, 1, True), ((3, 5), 33, 70, True), ((130,), 200, 65, False), ((2, 1), 64, 64, True)],
)
def test_triton_kx(lead, in_f, out_f, bias, dtype):
    x = torch.randn(*lead, in_f, dtype=dtype)
    w = torch.randn(out_f, in_f, dtype=dtype) / in_f**0.5
    b = torch.randn(out_f, dtype=dtype) if bias else None
    tensors = dict(x=x, weight=w, bias=b)
    grad_of = tuple(n for n, t in tensors.items() if t is not None)
    op = partial(fusedattn.linear, backend="triton")
    assert_op_kx(op, reference.linear, tensors, grad_of=grad_of)


@kernels
@pytest.mark.usefixtures("kernel_device")
def test_strided_input_weight_and_bias():
    """x a transposed view, the weight and the bias slices: read through their strides (the
    bias copied to a unit stride), eager, planned and with autograd."""
    x = torch.randn(40, 6, 3).transpose(0, 2)  # (3, 6, 40), last stride 18
    w = torch.randn(50, 80)[:, ::2]  # (50, 40), stride (80, 2)
    b = torch.randn(100)[::2]  # stride 2
    want = x @ w.t() + b
    for _ in range(2):  # the full path, then the plan
        got = fusedattn.linear(x, w, b, backend="triton")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    b.requires_grad_()
    got = fusedattn.linear(x, w, b, backend="triton")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.sum().backward()
    torch.testing.assert_close(b.grad, torch.full((50,), 18.0))


@kernels
@pytest.mark.usefixtures("kernel_device")
def test_empty_inputs():
    w, b = torch.randn(5, 4), torch.randn(5)
    assert fusedattn.linear(torch.randn(0, 4), w, b, backend="triton").shape == (0, 5)
    # in_features 0: the sum over nothing is 0, plus the bias
    y = fusedattn.linear(torch.randn(3, 0), torch.randn(5, 0), b, backend="triton")
    assert torch.equal(y, b.expand(3, 5))


# ---- batch invariance -------------------------------------------------------------------------


def _rows_alone_vs_batched(dtype, backend, seed):
    """How many rows of a 33-row batch differ from the same row alone or in smaller batches at
    other positions."""
    g = torch.Generator().manual_seed(seed)
    in_f, out_f = 200, 130  # neither a multiple of the tiles
    w = torch.randn(out_f, in_f, generator=g).to(dtype)
    b = torch.randn(out_f, generator=g).to(dtype)
    x = torch.randn(33, in_f, generator=g).to(dtype)
    dev = torch.get_default_device()
    w, b, x = w.to(dev), b.to(dev), x.to(dev)
    full = fusedattn.linear(x, w, b, backend=backend)
    differ = 0
    for i in (0, 5, 17, 32):
        differ += not torch.equal(fusedattn.linear(x[i : i + 1], w, b, backend=backend)[0], full[i])
        lo = max(0, i - 7)
        window = fusedattn.linear(x[lo : i + 3], w, b, backend=backend)  # i at another place
        differ += not torch.equal(window[i - lo], full[i])
    return differ


@kernels
@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_row_is_the_same_bits_in_any_batch(dtype):
    with fusedattn.batch_invariant():
        assert _rows_alone_vs_batched(dtype, "auto", seed=0) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's matmul paths (mutation check)")
def test_mutation_check_torch_matmul_is_not_batch_invariant():
    """The check above can fail: torch's CPU matmul (what `auto` runs with the switch off) gives
    a row alone other bits than among 33 (seen for every row in fp32)."""
    assert _rows_alone_vs_batched(torch.float32, "auto", seed=0) > 0


@kernels
@pytest.mark.usefixtures("kernel_device")
def test_tiles_do_not_follow_the_shape(K):
    """matmul_config takes the element size only: no M, N or K can change a row's sum."""
    import inspect

    assert list(inspect.signature(K.matmul_config).parameters) == ["element_size"]
    assert K.matmul_config(2).block_k == 64 and K.matmul_config(4).block_k == 32


def test_dispatch_under_the_switch(monkeypatch):
    x, w = torch.randn(2, 8), torch.randn(3, 8)
    calls = []
    monkeypatch.setattr(
        torch.nn.functional, "linear", lambda *a: calls.append(a) or a[0] @ a[1].t()
    )
    fusedattn.linear(x, w)  # switch off: F.linear straight away
    assert len(calls) == 1
    with fusedattn.batch_invariant():
        with pytest.raises(fusedattn.BackendUnavailableError, match="batch_invariant"):
            fusedattn.linear(x, w, backend="torch")
        with pytest.raises(fusedattn.BackendUnavailableError, match="no cuda implementation"):
            fusedattn.linear(x, w, backend="cuda")


@pytest.mark.parametrize(
    "args, error, match",
    [
        ((torch.randn(2, 8), torch.randn(3, 7)), ValueError, "must end with in_features = 7"),
        ((torch.randn(2, 8), torch.randn(3, 8, 1)), ValueError, "weight must be 2-D"),
        ((torch.randn(2, 8), torch.randn(3, 8).double()), TypeError, "dtype of x"),
        ((torch.randn(2, 8), torch.randn(3, 8), torch.randn(4)), ValueError, "out_features = 3"),
        ((torch.randn(2, 8).int(), torch.randn(3, 8)), TypeError, "x must be float16"),
    ],
)
def test_bad_arguments_are_named(args, error, match):
    for backend in ("triton", "reference"):
        with pytest.raises(error, match=match):
            fusedattn.linear(*args, backend=backend)


@kernels
@pytest.mark.usefixtures("kernel_device")
def test_autocast_runs_the_lower_precision_matmul():
    x, w = torch.randn(4, 16), torch.randn(8, 16)
    dev = torch.get_default_device().type
    with torch.autocast(dev, dtype=torch.bfloat16), fusedattn.batch_invariant():
        y = fusedattn.linear(x, w)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, fusedattn.linear(x.bfloat16(), w.bfloat16(), backend="triton"))


# ---- the module ---------------------------------------------------------------------------------


def test_module_is_a_drop_in_nn_linear():
    torch.manual_seed(0)
    ref = nn.Linear(12, 5)
    mine = fusedattn.Linear(12, 5)
    assert isinstance(mine, nn.Linear) and repr(mine) == repr(ref)
    assert mine.state_dict().keys() == ref.state_dict().keys()
    mine.load_state_dict(ref.state_dict())
    x = torch.randn(3, 12)
    assert torch.equal(mine(x), ref(x))  # switch off: F.linear itself
    assert fusedattn.Linear(12, 5, bias=False).bias is None


def test_swap_keeps_the_parameters_and_their_ties():
    emb = nn.Embedding(20, 8)
    model = nn.ModuleDict(dict(emb=emb, head=nn.Linear(8, 20, bias=False), proj=nn.Linear(8, 8)))
    model["head"].weight = emb.weight  # tied, as a language model's head
    proj_weight = model["proj"].weight
    assert type(fusedattn.swap_modules(model)["head"]) is nn.Linear  # linear=False by default
    fusedattn.swap_modules(model, linear=True)
    assert type(model["head"]) is fusedattn.Linear and type(model["proj"]) is fusedattn.Linear
    assert model["head"].weight is emb.weight and model["proj"].weight is proj_weight
    assert len(list(model.parameters())) == 3  # emb/head weight, proj weight and bias


@kernels
@pytest.mark.usefixtures("kernel_device")
def test_module_under_the_switch_runs_the_kernel_and_trains():
    torch.manual_seed(0)
    layer = fusedattn.Linear(16, 8)
    x = torch.randn(5, 16, requires_grad=True)
    with fusedattn.batch_invariant():
        y = layer(x)
        alone = layer(x[2:3].detach())
    assert torch.equal(alone[0], y[2].detach())
    y.square().sum().backward()
    want = nn.functional.linear(x.detach().double(), layer.weight.double(), layer.bias.double())
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    assert layer.weight.grad is not None and x.grad is not None


@kernels
@pytest.mark.usefixtures("kernel_device")
def test_planned_calls_equal_the_full_path_and_skip_dispatch(monkeypatch):
    """An eager call of known metadata takes its plan (no validation, no backends.select, the
    launch bound): new values each call give the full path's bits, with and without grad."""
    from fusedattn.ops.core import backends
    from fusedattn.ops.linear import api

    w, b = torch.randn(24, 40), torch.randn(24)
    api.PLANS.clear()
    for grad in (False, True):
        for seed in range(3):
            x = torch.randn(7, 40, generator=torch.Generator().manual_seed(seed))
            x = x.to(torch.get_default_device()).requires_grad_(grad)
            planned = fusedattn.linear(x, w, b, backend="triton")
            api.PLANS.clear()
            full = fusedattn.linear(x, w, b, backend="triton")
            assert torch.equal(planned, full) and planned.requires_grad == grad
    x = torch.randn(7, 40)
    before = fusedattn.linear(x, w, b, backend="triton")  # makes the plan
    monkeypatch.setattr(backends, "select", lambda *a: pytest.fail("the plan was not used"))
    assert torch.equal(fusedattn.linear(x, w, b, backend="triton"), before)
