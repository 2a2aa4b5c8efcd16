"""Which autograd path the kernel backends take (Triton: interpreter on CPU, compiled on GPU):
eager calls that want a gradient build one plain autograd.Function node (cheaper on the host
than torch.library's autograd layer, benchmarks/bench_host.py), calls that want none build no
node, torch.compile traces the custom ops (the compile tests of each op), and a double backward
is a clear error, as through the custom ops, never a silently missing term."""

import pytest
import torch

import fusedattn

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def ops():
    """(name, call(x, w, b) -> out, the autograd node's class name) per op."""
    return [
        (
            "layer_norm",
            lambda x, w, b: fusedattn.layer_norm(x, (16,), w, b, backend="triton"),
            "EagerLayerNormBackward",
        ),
        (
            "rms_norm",
            lambda x, w, b: fusedattn.rms_norm(x, (16,), w, backend="triton"),
            "EagerRMSNormBackward",
        ),
        (
            "softmax",
            lambda x, w, b: fusedattn.softmax(x, -1, backend="triton"),
            "EagerSoftmaxBackward",
        ),
        (
            "attention",
            lambda x, w, b: fusedattn.attention(*(x.view(1, 2, 6, 16),) * 3, backend="triton"),
            "EagerAttentionBackward",
        ),
    ]


def leaves(requires_grad=True):
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(12, 16, generator=g), torch.randn(16, generator=g), torch.randn(16)
    return [t.to(DEVICE).requires_grad_(requires_grad) for t in (x, w, b)]


@pytest.mark.kernels
@pytest.mark.parametrize("name, call, node", ops(), ids=[o[0] for o in ops()])
def test_eager_gradient_calls_build_one_autograd_function_node(name, call, node):
    x, w, b = leaves()
    out = call(x, w, b)
    assert type(out.grad_fn).__name__ == node
    grads = torch.autograd.grad(out, x, torch.ones_like(out))
    assert grads[0].shape == x.shape and torch.isfinite(grads[0]).all()


@pytest.mark.kernels
@pytest.mark.parametrize("name, call, node", ops(), ids=[o[0] for o in ops()])
def test_calls_that_want_no_gradient_build_no_node(name, call, node):
    x, w, b = leaves(requires_grad=False)
    assert call(x, w, b).grad_fn is None
    x, w, b = leaves()
    with torch.no_grad():
        assert call(x, w, b).grad_fn is None


@pytest.mark.kernels
@pytest.mark.parametrize("name, call, node", ops(), ids=[o[0] for o in ops()])
def test_double_backward_is_a_clear_error(name, call, node):
    x, w, b = leaves()
    out = call(x, w, b)
    # a gradient penalty, as a training step runs it: the op's own second derivative is
    # missing, and backward() says so instead of leaving that term out
    (dx,) = torch.autograd.grad(out.square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        (out.sum() + dx.square().sum()).backward()


@pytest.mark.kernels
def test_eager_and_custom_op_paths_agree():
    """The eager Function and the custom op run the same kernels: equal outputs and grads."""
    from fusedattn.ops.rowwise import norm_ops as norm_kernels

    x, w, b = leaves()
    eager = fusedattn.layer_norm(x, (16,), w, b, backend="triton")
    op = norm_kernels.layer_norm_fwd(x, 16, w, b, 1e-5, "triton")[0]
    assert type(op.grad_fn).__name__ != type(eager.grad_fn).__name__
    grad = torch.randn_like(eager)
    for a, b_ in zip(
        (eager, *torch.autograd.grad(eager, (x, w, b), grad)),
        (op, *torch.autograd.grad(op, (x, w, b), grad)),
        strict=True,
    ):
        torch.testing.assert_close(a, b_, rtol=0, atol=0)


@pytest.mark.kernels
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize(
    "module, shape",
    [
        (lambda: fusedattn.LayerNorm(16, backend="triton"), (3, 16)),
        (lambda: fusedattn.RMSNorm(16, backend="triton"), (3, 16)),
        (lambda: fusedattn.Softmax(-1, backend="triton"), (3, 16)),
        (
            lambda: fusedattn.MultiheadAttention(16, 2, batch_first=True, backend="triton"),
            (1, 5, 16),
        ),
    ],
    ids=["LayerNorm", "RMSNorm", "Softmax", "MultiheadAttention"],
)
def test_jit_trace_records_the_custom_op_and_replays_new_inputs(module, shape, grad):
    """torch.jit.trace (deprecated in torch 2.14, still used) must record the
    kernel: a trace of the eager path records no launch and replays the traced call's output
    for every input (the LayerNorm no-grad trace did, silently)."""
    mod = module().to(DEVICE)
    n_args = 3 if isinstance(mod, fusedattn.MultiheadAttention) else 1
    x = torch.randn(shape, device=DEVICE)
    with torch.set_grad_enabled(grad):
        traced = torch.jit.trace(mod, (x,) * n_args, check_trace=False)
    assert any(node.kind().startswith("fusedattn::") for node in traced.graph.nodes())
    x2 = torch.randn(shape, device=DEVICE, requires_grad=True)
    got, want = traced(*(x2,) * n_args), mod(*(x2,) * n_args)
    got, want = (got[0], want[0]) if isinstance(got, tuple) else (got, want)
    torch.testing.assert_close(got, want)
    (g_got,) = torch.autograd.grad(got.sum(), x2)
    (g_want,) = torch.autograd.grad(want.sum(), x2)
    torch.testing.assert_close(g_got, g_want)
