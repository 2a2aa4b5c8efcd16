"""Float attn_masks with large finite values, in every backend that runs on this machine
(reference, torch, Triton under the interpreter), against float64 (issue #31).

The rule (README, "Masks"): a float mask's finite values are finite. Softmax does not change
when one value is added to a whole row, so each row is shifted by its largest mask entry
before any backend runs: a row masked with -1e9 or finfo.min on every key gives the softmax
of its scores, and no large offset is rounded into the scores. Before the shift, the Triton
backward recomputed every probability of such a row as 1 (dv summing to the key count) and
torch's CPU flash backward returned wrong gradients; fp32 Triton failed the k× rule from a
common offset of 1e3 on."""

import pytest
import torch
from kx_check import assert_op_kx

import fusedattn
from fusedattn import reference
from fusedattn.testing import assert_close_kx

BACKENDS = ["reference", "torch", pytest.param("triton", marks=pytest.mark.kernels)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HUGE = {"-1e9": lambda dtype: -1e9, "finfo32.min": lambda dtype: torch.finfo(torch.float32).min,
        "finfo.min": lambda dtype: torch.finfo(dtype).min}  # fmt: skip


def _inputs(dtype, B=1, H=1, T=8, D=16):
    q, k, v = (torch.randn(B, H, T, D, dtype=dtype) for _ in range(3))
    return q, k, v


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("value", list(HUGE), ids=str)
def test_a_row_masked_everywhere_with_a_huge_value_is_the_softmax_of_its_scores(
    backend, dtype, value
):
    """Issue #31 items 2-4: B=1 H=1 T=8 D=16, row 3 masked with the value on every key, dO
    nonzero on row 3 only. The truth is the unmasked row; dv must sum to dO's row (the row's
    probabilities sum to 1: they summed to 8 in the Triton backward)."""
    q, k, v = _inputs(dtype)
    mask = torch.zeros(1, 1, 8, 8)
    mask[..., 3, :] = HUGE[value](dtype)
    grad = torch.zeros(1, 1, 8, 16, dtype=dtype)
    grad[..., 3, :] = torch.randn(16, dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, mask)]
    out = fusedattn.attention(*leaves[:3], leaves[3], backend=backend)
    got = torch.autograd.grad(out, leaves, grad)
    # The truth: the mask is a constant per row, so it is attention without a mask, whose
    # score gradient is the mask's.
    truth = [t.double().requires_grad_() for t in (q, k, v, torch.zeros(1, 1, 8, 8))]
    want_out = reference.attention(*truth[:3], truth[3])
    want = torch.autograd.grad(want_out, truth, grad.double())
    base = [t.clone().requires_grad_() for t in (q, k, v, torch.zeros(1, 1, 8, 8, dtype=dtype))]
    base_out = reference.attention(*base[:3], base[3])
    base_grads = torch.autograd.grad(base_out, base, grad)
    assert_close_kx(out, want_out, base_out, name="out")
    for name, a, r, b in zip(("q", "k", "v", "mask"), got, want, base_grads, strict=True):
        assert_close_kx(a, r, b, name=f"d{name}")
    dv_sum = got[2].double().sum(dim=2)[0, 0]
    assert torch.allclose(dv_sum, grad.double()[0, 0, 3], atol=0.02, rtol=0.02), dv_sum


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("offset", [1e3, 1e5, 1e9], ids=str)
def test_float_mask_with_a_large_common_offset_per_row_keeps_the_kx_rule(backend, dtype, offset):
    """A random float mask minus a large offset on some rows (every key of those rows):
    forward, dq, dk, dv and the mask's gradient under the k× rule. fp32 Triton failed here
    from an offset of 1e3 on before rows were shifted (dk 1.4x the limit at 1e3, dq 32x at
    1e9)."""
    B, H, T, D = 1, 2, 8, 16
    q, k, v = _inputs(dtype, B, H, T, D)
    mask = torch.randn(B, H, T, T) * 0.5
    mask[:, :, 3] -= offset
    mask[:, 1, 6] -= offset
    op = fusedattn.attention if backend == "reference" else _named(backend)
    assert_op_kx(op, reference.attention, dict(q=q, k=k, v=v, attn_mask=mask.to(dtype)),
                 grad_of=("q", "k", "v", "attn_mask"))  # fmt: skip


def _named(backend):
    def op(**kw):
        return fusedattn.attention(**kw, backend=backend)

    return op


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_entries_beside_ordinary_ones_contribute_nothing(backend):
    """masked_fill(mask == 0, -1e9) beside zeros, and finfo.min beside a learned bias: the huge
    entries weigh exp(-1e9) = 0, as in exact arithmetic, and the lse agrees with float64."""
    q, k, v = _inputs(torch.float32, 2, 2, 9, 16)
    keep = torch.rand(2, 1, 9, 9) > 0.4
    keep[..., 0] = True
    for huge in (-1e9, torch.finfo(torch.float32).min):
        mask = torch.where(keep, torch.randn(2, 1, 9, 9), huge)
        out, lse = _attention_with_lse(q, k, v, mask, backend)
        want, want_lse = reference.attention(
            q.double(),
            k.double(),
            v.double(),
            mask.double().masked_fill(~keep, float("-inf")),
            return_lse=True,
        )
        base, base_lse = reference.attention(q, k, v, mask.masked_fill(~keep, float("-inf")),
                                             return_lse=True)  # fmt: skip
        assert_close_kx(out, want, base, name="out")
        if lse is not None:
            assert_close_kx(lse, want_lse, base_lse, name="lse")


def _attention_with_lse(q, k, v, mask, backend, **kw):
    """(out, lse), lse None for the torch backend (SDPA returns no lse: it refuses)."""
    if backend == "torch":
        return fusedattn.attention(q, k, v, mask, backend=backend, **kw), None
    return fusedattn.attention(q, k, v, mask, return_lse=True, backend=backend, **kw)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch"])
def test_lse_of_a_shifted_row_carries_the_shift_back(backend):
    """The lse returned is that of the unshifted scores: a row masked with -1e9 everywhere has
    lse = its unmasked lse - 1e9 (in fp32: the nearest float)."""
    q, k, v = _inputs(torch.float32, 1, 2, 6, 8)
    mask = torch.zeros(6, 6)
    mask[2] = -1e9
    _, lse = fusedattn.attention(q, k, v, mask, return_lse=True, backend=backend)
    _, plain = reference.attention(q.double(), k.double(), v.double(), return_lse=True)
    expected = plain.double()
    expected[..., 2] -= 1e9
    assert torch.allclose(lse.double(), expected, rtol=1e-6, atol=1e-4)


def test_the_reference_in_float64_gives_a_finfo_min_row_its_softmax_not_the_average():
    """float64 itself rounds s + finfo.min to finfo.min (ulp 7e22): a naive float64 row is the
    plain average. The documented rule, and the reference that every test compares with, give
    the softmax of the scores."""
    q, k, v = (t.double() for t in _inputs(torch.float32, 1, 1, 5, 8))
    mask = torch.full((5, 5), torch.finfo(torch.float32).min, dtype=torch.float64)
    out = reference.attention(q, k, v, mask)
    assert torch.allclose(out, reference.attention(q, k, v))
    assert not torch.allclose(out, v.mean(dim=2, keepdim=True).expand_as(out))


@pytest.mark.parametrize("backend", BACKENDS)
def test_calls_with_sinks_are_not_shifted_the_sink_wins_a_hugely_masked_row(backend):
    """With sinks a row shift would move the keys against the sink logit; unshifted, a row
    masked with -1e9 on every key gives 0 output and lse = the sink, as exact arithmetic."""
    q, k, v = _inputs(torch.float32, 1, 2, 6, 8)
    sinks = torch.tensor([0.5, -1.0])
    mask = torch.zeros(6, 6)
    mask[4] = -1e9
    out, lse = _attention_with_lse(q, k, v, mask, backend, sinks=sinks)
    assert out[..., 4, :].abs().max() < 1e-6
    if lse is not None:
        assert torch.allclose(lse[0, :, 4], sinks)


# Issue #50 item 8: the row's shift is its largest mask entry over the keys it can see. Each
# case: (keywords, Tq, Tk, the row, the keys that row sees by position / padding).
VISIBLE_ONLY = {
    "window_top_left": (dict(window_size=(1, 0)), 6, 6, 3, [2, 3]),
    "causal_top_left": (dict(is_causal=True), 6, 6, 3, [0, 1, 2, 3]),
    "causal_bottom_right": (
        dict(is_causal=True, causal_alignment="bottom_right"), 4, 7, 1, [0, 1, 2, 3, 4],
    ),
    "window_both_sides_bottom_right": (
        dict(window_size=(1, 1), causal_alignment="bottom_right"), 4, 7, 1, [3, 4, 5],
    ),
    "key_padding": (dict(key_padding_mask=True), 6, 6, 3, [0, 1, 2, 3]),
    "sinks_and_window": (dict(window_size=(1, 0), sinks=True), 6, 6, 3, [2, 3]),
}  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(VISIBLE_ONLY))
def test_a_row_at_the_masking_value_on_every_visible_key_is_the_softmax_of_its_scores(
    backend, case
):
    """The row holds finfo.min on every key it can see and 0 on the keys a window, causal or
    key padding hides: exact arithmetic gives the softmax of its scores over the visible keys
    (the mask is constant there). The shift used to be the maximum over all keys (0, from a
    hidden key), leaving finfo.min in place: Triton returned 0 for the row, the reference
    and torch the plain average. With sinks there is no shift: the sink takes the row and its
    output is ~0, as float64 says."""
    kwargs, Tq, Tk, row, seen = VISIBLE_ONLY[case]
    kwargs = dict(kwargs)
    B, H, D = 2, 2, 16
    q = torch.randn(B, H, Tq, D)
    k, v = torch.randn(B, H, Tk, D), torch.randn(B, H, Tk, D)
    mask = torch.randn(B, 1, Tq, Tk)
    hidden = torch.ones(Tk, dtype=torch.bool)
    hidden[seen] = False
    mask[:, :, row, ~hidden] = torch.finfo(torch.float32).min
    mask[:, :, row, hidden] = 0.0
    if kwargs.get("key_padding_mask"):
        kwargs["key_padding_mask"] = hidden.expand(B, Tk).clone()  # keys 4, 5 padded
    if kwargs.get("sinks"):
        kwargs["sinks"] = torch.randn(H)
    grad = torch.randn(B, H, Tq, D)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = fusedattn.attention(*leaves, mask, backend=backend, return_lse=True, **kwargs) \
        if backend != "torch" else (fusedattn.attention(*leaves, mask, backend=backend, **kwargs), None)  # fmt: skip
    got = torch.autograd.grad(out, leaves, grad)
    exact = mask.double()
    if "sinks" not in kwargs:  # the mask is one constant over the row's visible keys
        exact[:, :, row] = 0.0
    truth = [t.double().requires_grad_() for t in (q, k, v)]
    f64 = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
           for n, t in kwargs.items()}  # fmt: skip
    want_out, want_lse = reference.attention(*truth, exact, return_lse=True, **f64)
    want = torch.autograd.grad(want_out, truth, grad.double())
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    for name, a, b in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4, msg=f"d{name}")
    if lse is not None and "sinks" not in kwargs:  # the lse of the mask as given
        shift = exact.new_zeros(B, 1, Tq)
        shift[:, :, row] = torch.finfo(torch.float32).min
        torch.testing.assert_close(lse.double(), want_lse + shift, rtol=1e-5, atol=1e-5)
