"""One forward+backward check under the k× rule, shared by every backend's tests.

`assert_op_kx(op, reference_op, tensors, grad_of=...)` runs `op` on the tensors, the reference
op on float64 copies (the truth) and on same-dtype copies (the baseline: naive PyTorch in the
kernel's dtype), and compares the output and the gradients of `grad_of` with the k× rule.
"""

from __future__ import annotations

import torch

from fusedattn import reference
from fusedattn.masks import NO_WINDOW
from fusedattn.testing import assert_close_kx


def _copies(tensors, grad_of, dtype=None):
    out = {}
    for name, t in tensors.items():
        if t is None or not isinstance(t, torch.Tensor):
            out[name] = t
            continue
        c = t.detach()
        if dtype is not None and c.dtype.is_floating_point:
            c = c.to(dtype)
        out[name] = c.requires_grad_(name in grad_of)
    return out


def assert_op_kx(op, reference_op, tensors, *, kwargs=None, grad_of=(), k=2.0, grad_atol=None):
    kwargs = kwargs or {}
    mine, truth, base = (_copies(tensors, grad_of, d) for d in (None, torch.float64, None))
    out = op(**mine, **kwargs)
    ref = reference_op(**truth, **kwargs)
    baseline = reference_op(**base, **kwargs)
    assert out.dtype == next(t for t in tensors.values() if isinstance(t, torch.Tensor)).dtype
    assert_close_kx(out, ref, baseline, k=k, name="out")
    if not grad_of:
        return
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [mine[n] for n in grad_of], grad)
    want = torch.autograd.grad(ref, [truth[n] for n in grad_of], grad.double())
    base_grads = torch.autograd.grad(baseline, [base[n] for n in grad_of], grad)
    for name, a, r, b in zip(grad_of, got, want, base_grads, strict=True):
        assert_close_kx(a, r, b, k=k, atol=grad_atol, name=f"d{name}")


def attention_inputs(q, k, v, **overrides):
    """The full keyword set `fusedattn.attention` hands a backend, for dispatch tests."""
    base = dict(q=q, k=k, v=v, attn_mask=None, dropout_p=0.0, scale=None, enable_gqa=False,
                key_padding_mask=None, window=NO_WINDOW, softcap=0.0, alibi_slopes=None,
                sinks=None, return_lse=False)  # fmt: skip
    return base | overrides


def assert_offsets_past_2_to_the_31(attention):
    """`attention(q, k, v)` on a q and out of 2^31 + 1024 elements (bf16, CUDA): the first and
    last rows match float64 under the k× rule, so every offset must be 64-bit."""
    Tq, D = 2**25 + 16, 64
    q = torch.randn(1, 1, Tq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 1, 32, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 1, 32, D, device="cuda", dtype=torch.bfloat16)
    out = attention(q, k, v)
    for rows in (slice(0, 64), slice(Tq - 64, Tq)):
        qs = q[:, :, rows]
        want = reference.attention(qs.double(), k.double(), v.double())
        assert_close_kx(out[:, :, rows], want, reference.attention(qs, k, v))
