"""Empty inputs give the same result on every backend (an empty or all-zero result, never a
crash): attention with no keys, no queries or no batch; softmax over an empty dim; LayerNorm and
RMSNorm over a normalized_shape holding a 0."""

import pytest
import torch

import fusedattn

BACKENDS = ["reference", "torch", pytest.param("triton", marks=pytest.mark.kernels)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(3, 0), (0, 4), (2, 0, 5)], ids=str)
def test_softmax_of_an_empty_tensor_is_empty(backend, shape, device):
    x = torch.randn(shape, device=device, requires_grad=True)
    for dim in range(len(shape)):
        y = fusedattn.softmax(x, dim, backend=backend)
        assert y.shape == x.shape and y.dtype == x.dtype
        (grad,) = torch.autograd.grad(y.sum(), x)
        assert grad.shape == x.shape


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,Tq,Tk", [(2, 5, 0), (2, 0, 5), (0, 5, 5)], ids=str)
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
def test_attention_with_nothing_to_attend(backend, B, Tq, Tk, with_sinks, device):
    """No keys: 0 output, lse -inf (the sink with sinks), 0 gradients; no queries or no batch:
    empty results."""
    q = torch.randn(B, 2, Tq, 8, device=device, requires_grad=True)
    k = torch.randn(B, 2, Tk, 8, device=device, requires_grad=True)
    v = torch.randn(B, 2, Tk, 8, device=device, requires_grad=True)
    sinks = torch.randn(2, device=device) if with_sinks else None
    lse_backend = "reference" if backend == "torch" else backend  # SDPA has no lse
    out, lse = fusedattn.attention(q, k, v, sinks=sinks, return_lse=True, backend=lse_backend)
    out = fusedattn.attention(q, k, v, sinks=sinks, backend=backend)
    assert out.shape == (B, 2, Tq, 8) and (out == 0).all()
    expect = float("-inf") if sinks is None else sinks[None, :, None].expand(B, 2, Tq)
    torch.testing.assert_close(
        lse, torch.full((B, 2, Tq), float("-inf"), device=device) if sinks is None else expect
    )
    grads = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
    for g, t in zip(grads, (q, k, v), strict=True):
        assert g is None or (g.shape == t.shape and (g == 0).all())


@pytest.mark.parametrize(
    "backend", [*BACKENDS, pytest.param("cuda", marks=pytest.mark.gpu), "auto"]
)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_norm_over_a_zero_sized_normalized_shape_is_empty(backend, op, device):
    """normalized_shape may hold a 0, as in F.layer_norm / F.rms_norm: an empty output and
    empty gradients (the kernel backends used to fail reshaping 0 elements into rows of 0)."""
    x = torch.randn(2, 0, 3, device=device, requires_grad=True)
    w = torch.randn(0, 3, device=device, requires_grad=True)
    b = torch.randn(0, 3, device=device, requires_grad=True)
    if op == "layer_norm":
        y, leaves = fusedattn.layer_norm(x, (0, 3), w, b, backend=backend), (x, w, b)
    else:
        y, leaves = fusedattn.rms_norm(x, (0, 3), w, backend=backend), (x, w)
    assert y.shape == x.shape and y.dtype == x.dtype
    grads = torch.autograd.grad(y.sum(), leaves)
    assert [g.shape for g in grads] == [t.shape for t in leaves]
    module = fusedattn.LayerNorm((0, 3)) if op == "layer_norm" else fusedattn.RMSNorm((0, 3))
    assert module.to(device)(x).shape == x.shape


# ---- the corners of every mask path: no keys, masks broadcast over the keys -------------------

MASKS = {  # name: (shape given Tq, Tk; dtype)
    "none": None,
    "bool (Tq, Tk)": (lambda Tq, Tk: (Tq, Tk), torch.bool),
    "bool (Tq, 1)": (lambda Tq, Tk: (Tq, 1), torch.bool),
    "float (Tq, Tk)": (lambda Tq, Tk: (Tq, Tk), torch.float32),
    "float (Tq, 1)": (lambda Tq, Tk: (Tq, 1), torch.float32),
    "float (B, 1, Tq, 1)": (lambda Tq, Tk: (2, 1, Tq, 1), torch.float32),
    "float (1,)": (lambda Tq, Tk: (1,), torch.float32),
}
OPTIONS = {
    "plain": {},
    "causal": dict(is_causal=True),
    "causal bottom-right": dict(is_causal=True, causal_alignment="bottom_right"),
    "window": dict(window_size=(2, 1)),
    "key padding": "kpm",
    "sinks": dict(sinks=True),
    "alibi": dict(alibi_slopes=True),
    "softcap": dict(softcap=5.0),
}


def mask_case(mask, option, Tq, Tk, device):
    g = torch.Generator().manual_seed(Tq * 31 + Tk)
    q = torch.randn(2, 3, Tq, 8, generator=g, dtype=torch.float64).to(device)
    k = torch.randn(2, 3, Tk, 8, generator=g, dtype=torch.float64).to(device)
    v = torch.randn(2, 3, Tk, 8, generator=g, dtype=torch.float64).to(device)
    kw = {}
    if MASKS[mask] is not None:
        shape, dtype = MASKS[mask]
        m = torch.randn(shape(Tq, Tk), generator=g) if dtype != torch.bool else None
        m = torch.rand(shape(Tq, Tk), generator=g) > 0.3 if m is None else m.double()
        kw["attn_mask"] = m.to(device)
    opt = OPTIONS[option]
    if opt == "kpm":
        kpm = torch.zeros(2, Tk, dtype=torch.bool)
        kpm[1, Tk // 2 :] = True
        kw["key_padding_mask"] = kpm.to(device)
    else:
        kw.update(opt)
        if kw.get("sinks") is True:
            kw["sinks"] = torch.randn(3, generator=g, dtype=torch.float64).to(device)
        if kw.get("alibi_slopes") is True:
            kw["alibi_slopes"] = (torch.rand(3, generator=g) + 0.1).to(device)
    return q, k, v, kw


def mask_grid():
    """torch: every mask, option and corner (softcap aside: SDPA has none); the Triton
    kernels (the interpreter, up to 2 s a case here): the masks broadcast over the keys and
    the full float one, with every option at no key, and one query over a few keys with the
    options whose tiles differ (positions, padding)."""
    for mask in MASKS:
        for option in OPTIONS:
            for Tq, Tk in ((5, 0), (5, 1), (1, 6), (0, 4)):
                case = f"{mask}-{option}-{Tq}x{Tk}"
                if option != "softcap":
                    yield pytest.param(mask, option, Tq, Tk, "torch", id=f"{case}-torch")
                few = (Tq, Tk) == (1, 6) and option in ("causal bottom-right", "key padding")
                if ("1)" in mask or mask == "float (Tq, Tk)") and ((Tq, Tk) == (5, 0) or few):
                    yield pytest.param(mask, option, Tq, Tk, "triton", id=f"{case}-triton",
                                       marks=pytest.mark.kernels)  # fmt: skip


@pytest.mark.parametrize(("mask", "option", "Tq", "Tk", "backend"), list(mask_grid()))
def test_every_mask_path_with_no_keys_or_a_mask_broadcast_over_them(mask, option, Tq, Tk,
                                                                     backend, device):  # fmt: skip
    """Every mask kind (bool, float; full or broadcast over the keys) with every option, at the
    corners: no keys (a row that sees none gives 0, lse -inf or its sink; the float-mask shift
    raised IndexError on an empty reduction), one key, one query, no queries. Against the
    float64 reference, forward and (where the backend has one) backward, in float64 (torch) or
    float32 (the Triton kernels)."""
    q, k, v, kw = mask_case(mask, option, Tq, Tk, device)
    if backend == "triton":
        q, k, v = q.float(), k.float(), v.float()
        kw = {n: t.float() if torch.is_tensor(t) and t.is_floating_point() and n != "alibi_slopes"
              else t for n, t in kw.items()}  # fmt: skip
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fusedattn.attention(q, k, v, backend=backend, **kw)
    ref_kw = {n: t.double() if torch.is_tensor(t) and t.is_floating_point() and n != "alibi_slopes"
              else t for n, t in kw.items()}  # fmt: skip
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want, lse_want = fusedattn.reference.attention(qd, kd, vd, return_lse=True, **ref_kw)
    tol = 1e-10 if q.dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    assert not out.isnan().any()
    if backend != "torch":
        _, lse = fusedattn.attention(q, k, v, backend=backend, return_lse=True, **kw)
        torch.testing.assert_close(lse.double(), lse_want.double(), atol=tol, rtol=tol)
    if q.numel() and k.numel():
        g = torch.randn_like(want)
        got = torch.autograd.grad(out, (q, k, v), g.to(out.dtype), allow_unused=True)
        ref = torch.autograd.grad(want, (qd, kd, vd), g, allow_unused=True)
        for a, b in zip(got, ref, strict=True):
            if b is None:
                continue
            torch.testing.assert_close(a.double(), b, atol=10 * tol, rtol=10 * tol)
