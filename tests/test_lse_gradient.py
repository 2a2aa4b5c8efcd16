"""The lse that attention returns is differentiable (issue #82): a loss that reads it (users
merge partial outputs by their lse: cascade, blockwise and ring attention) gets its part of
dq, dk, dv, the float mask's and the sinks' gradients, against float64 autograd under the k×
rule. The Triton backward takes dlse into the row term (delta - dlse); the CUDA backend
refuses a call that returns the lse and records a backward; the torch backend returns no
lse."""

import pytest
import torch
from hard_shapes import AttentionShape, make_qkv

import fusedattn
from fusedattn import reference
from fusedattn.testing import assert_close_kx

pytestmark = [pytest.mark.usefixtures("kernel_device"), pytest.mark.kernels]

SHAPE = AttentionShape(B=2, Hq=4, Hkv=2, Tq=37, Tk=70, D=40, Dv=24)

CASES = {
    "plain": {},
    "causal+padding+sinks": dict(
        is_causal=True, causal_alignment="bottom_right", key_padding_mask=True, sinks=True
    ),
    "float mask+softcap": dict(attn_mask=True, softcap=2.0),
    "window+alibi": dict(window_size=(9, 4), alibi_slopes=True),
}


def _inputs(case, dtype, device):
    q, k, v = make_qkv(SHAPE, dtype, device)
    tensors, kwargs = dict(q=q, k=k, v=v), dict(enable_gqa=True)
    for name, value in CASES[case].items():
        if name == "key_padding_mask":
            kpm = torch.zeros(SHAPE.B, SHAPE.Tk, dtype=torch.bool, device=device)
            kpm[1, 40:] = True
            kwargs[name] = kpm
        elif name == "sinks":
            tensors[name] = torch.randn(SHAPE.Hq, dtype=dtype, device=device)
        elif name == "attn_mask":
            tensors[name] = torch.randn(1, SHAPE.Hq, SHAPE.Tq, SHAPE.Tk, dtype=dtype, device=device)
        elif name == "alibi_slopes":
            kwargs[name] = torch.rand(SHAPE.Hq, device=device) * 0.3
        else:
            kwargs[name] = value
    return tensors, kwargs


def _grads(op, tensors, kwargs, dtype, g_out, g_lse, only_lse=False):
    leaves = {n: t.detach().to(dtype).requires_grad_() for n, t in tensors.items()}
    out, lse = op(**leaves, **kwargs, return_lse=True)
    loss = (lse * g_lse.to(lse.dtype)).sum()
    if not only_lse:
        loss = loss + (out * g_out.to(out.dtype)).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=only_lse)
    # the lse alone does not read v: its gradient is None (autograd's) or 0 (the kernels')
    return [torch.zeros_like(leaves[n]) if g is None else g
            for n, g in zip(leaves, grads, strict=True)]  # fmt: skip


def assert_lse_grads_kx(op, tensors, kwargs, *, only_lse=False, reference_op=None):
    reference_op = reference_op or reference.attention
    dtype = tensors["q"].dtype
    truth = {n: v for n, v in kwargs.items() if n not in ("backend", "block_mask")}
    with torch.no_grad():
        out, lse = reference_op(**tensors, **truth, return_lse=True)
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
    got = _grads(op, tensors, kwargs, dtype, g_out, g_lse, only_lse)
    want = _grads(reference_op, tensors, truth, torch.float64, g_out, g_lse, only_lse)
    base = _grads(reference_op, tensors, truth, dtype, g_out, g_lse, only_lse)
    for name, a, w, b in zip(tensors, got, want, base, strict=True):
        assert_close_kx(a, w, b, name=f"d{name}")


@pytest.mark.parametrize(
    "case,dtype",
    [*((case, torch.float32) for case in CASES), ("causal+padding+sinks", torch.bfloat16),
     ("float mask+softcap", torch.bfloat16)],
    ids=str,
)  # fmt: skip
def test_triton_lse_gradient_matches_float64(case, dtype):
    tensors, kwargs = _inputs(case, dtype, torch.get_default_device())
    assert_lse_grads_kx(fusedattn.attention, tensors, dict(kwargs, backend="triton"))


def test_a_loss_of_the_lse_alone():
    """No gradient reaches the output: dO is zero, dlse alone drives dq and dk (dv is 0)."""
    tensors, kwargs = _inputs("causal+padding+sinks", torch.float32, torch.get_default_device())
    assert_lse_grads_kx(fusedattn.attention, tensors, dict(kwargs, backend="triton"),
                        only_lse=True)  # fmt: skip


def test_the_lse_gradient_is_not_dropped():
    """The mutation check: the same loss with the lse detached gives other gradients, so the
    tests above see the dlse term (it was marked non-differentiable: lost without an error)."""
    tensors, kwargs = _inputs("plain", torch.float32, torch.get_default_device())
    leaves = [t.clone().requires_grad_() for t in tensors.values()]
    out, lse = fusedattn.attention(*leaves, **kwargs, return_lse=True, backend="triton")
    dq_with, = torch.autograd.grad(out.sum() + lse.sum(), leaves[0])  # fmt: skip
    out, lse = fusedattn.attention(*leaves, **kwargs, return_lse=True, backend="triton")
    dq_without, = torch.autograd.grad(out.sum() + lse.detach().sum(), leaves[0])  # fmt: skip
    assert (dq_with - dq_without).abs().max() > 1e-2


def test_varlen_lse_gradient_matches_float64():
    lengths_q, lengths_k = [5, 0, 17, 9], [9, 4, 17, 30]
    cu_q = torch.tensor([0, 5, 5, 22, 31], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 13, 30, 60], dtype=torch.int32)
    q = torch.randn(sum(lengths_q), 4, 16)
    k, v = torch.randn(sum(lengths_k), 2, 16), torch.randn(sum(lengths_k), 2, 8)
    kwargs = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=17, max_seqlen_k=30,
                  is_causal=True, causal_alignment="bottom_right", enable_gqa=True)  # fmt: skip
    assert_lse_grads_kx(fusedattn.varlen_attention, dict(q=q, k=k, v=v),
                        dict(kwargs, backend="triton"),
                        reference_op=reference.varlen_attention)  # fmt: skip


@pytest.mark.parametrize("with_mod", [False, True], ids=["block_mask", "block_mask+score_mod"])
def test_block_mask_lse_gradient_matches_float64(with_mod):
    """The lse's gradient through the block-sparse kernels, and through a score_mod's
    derivative too (a bias and a tanh of the score)."""
    from fusedattn.masks import create_block_mask

    tensors, kwargs = _inputs("plain", torch.float32, torch.get_default_device())
    bm = create_block_mask(lambda b, h, i, j: (j <= i + 33) & ((i + j) % 3 != 0), None, None,
                           SHAPE.Tq, SHAPE.Tk, device=tensors["q"].device, BLOCK_SIZE=32)  # fmt: skip
    dense = bm.dense_mask()
    mod = None
    if with_mod:

        def mod(s, b, h, i, j):
            return 3.0 * torch.tanh(s / 3.0) + 0.01 * (i - j) + 0.1 * h

    def op(block_mask=None, backend=None, **kw):
        if backend is None:  # the reference (truth and baseline): the same mask, dense
            return reference.attention(attn_mask=dense, score_mod=mod, **kw)
        return fusedattn.attention(block_mask=block_mask, score_mod=mod, backend=backend, **kw)

    assert_lse_grads_kx(op, tensors, dict(kwargs, block_mask=bm, backend="triton"),
                        reference_op=op)  # fmt: skip


def test_compiled_lse_gradient_is_the_eager_one():
    """torch.compile records the custom ops, whose backward gets dlse (zeros where unread)."""
    tensors, kwargs = _inputs("causal+padding+sinks", torch.float32, torch.get_default_device())

    def loss(q, k, v, sinks):
        out, lse = fusedattn.attention(q, k, v, sinks=sinks, return_lse=True, backend="triton",
                                       **kwargs)  # fmt: skip
        return (out * out.detach().cos()).sum() + (lse * lse.detach().sin()).sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    grads = []
    for fn in (loss, compiled):
        leaves = [t.clone().requires_grad_() for t in tensors.values()]
        grads.append(torch.autograd.grad(fn(*leaves), leaves))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_cuda_refuses_a_differentiable_lse_by_name():
    q, k, v = (torch.randn(1, 2, 8, 16, dtype=torch.float16, requires_grad=True) for _ in range(3))
    with pytest.raises(ValueError, match="no gradient for the lse"):
        fusedattn.attention(q, k, v, return_lse=True, backend="cuda")
