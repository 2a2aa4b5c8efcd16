"""fusedattn.reference.attention against float64 math (torch's SDPA math path, an independent
implementation) on hard shapes, every mask kind, GQA, lse, dropout and fully masked rows."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hard_shapes import AttentionShape, attention_shapes, leaf_copies, make_qkv

from fusedattn import masks, reference

F64 = torch.float64


def sdpa64(q, k, v, visible=None, additive=None, scale=None):
    """SDPA in float64 with one explicit mask; rows that see no key are zeroed by hand."""
    q, k, v = (t.to(F64) for t in (q, k, v))
    mask = None
    if visible is not None:
        mask = torch.zeros(visible.shape, dtype=F64).masked_fill(~visible, float("-inf"))
    if additive is not None:
        mask = additive.to(F64) if mask is None else mask + additive.to(F64)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    if mask is not None:
        dead = (mask.expand(*out.shape[:-1], k.shape[-2]) == float("-inf")).all(-1, keepdim=True)
        out = out.masked_fill(dead, 0.0)
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", attention_shapes(), ids=str)
def test_forward_and_grads_match_float64(shape, causal):
    q, k, v = make_qkv(shape, F64, "cpu", layout="transposed", requires_grad=True)
    out = reference.attention(q, k, v, is_causal=causal, enable_gqa=True)
    visible = masks.causal_mask(shape.Tq, shape.Tk) if causal else None
    q2, k2, v2 = leaf_copies((q, k, v))
    expected = sdpa64(q2, k2, v2, visible=visible)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    torch.autograd.backward(out, grad)
    torch.autograd.backward(expected, grad)
    for name, a, b in (("dq", q, q2), ("dk", k, k2), ("dv", v, v2)):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-9, msg=name)


MASK_SHAPES = [(7, 9), (1, 1, 7, 9), (2, 1, 1, 9), (3, 7, 9), (2, 3, 7, 9), (2, 3, 1, 9)]


@pytest.mark.parametrize("mask_shape", MASK_SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_broadcast_masks(mask_shape, kind):
    s = AttentionShape(B=2, Hq=3, Hkv=3, Tq=7, Tk=9, D=16, Dv=24)
    q, k, v = make_qkv(s, F64, "cpu")
    if kind == "bool":
        mask = torch.rand(mask_shape) > 0.3
        expected = sdpa64(q, k, v, visible=mask.expand(2, 3, 7, 9))
    else:
        mask = torch.randn(mask_shape, dtype=F64)
        expected = sdpa64(q, k, v, additive=mask.expand(2, 3, 7, 9))
    out = reference.attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)


def test_every_mask_at_once_with_scale_and_gqa():
    s = AttentionShape(B=2, Hq=4, Hkv=2, Tq=6, Tk=10, D=8, Dv=8)
    q, k, v = make_qkv(s, F64, "cpu", layout="sliced")
    attn_mask = torch.rand(1, 4, 6, 10) > 0.2
    kpm = masks.padding_mask_from_lengths(torch.tensor([10, 4]), 10)
    out = reference.attention(
        q, k, v, attn_mask, is_causal=True, scale=0.3, enable_gqa=True, key_padding_mask=kpm
    )
    visible = attn_mask & ~kpm[:, None, None, :] & masks.causal_mask(6, 10)
    torch.testing.assert_close(out, sdpa64(q, k, v, visible=visible, scale=0.3))


def test_bottom_right_causal_through_attn_mask():
    s = AttentionShape(B=1, Hq=2, Hkv=2, Tq=3, Tk=8, D=8, Dv=8)
    q, k, v = make_qkv(s, F64, "cpu")
    mask = masks.causal_mask(3, 8, bottom_right=True)
    out = reference.attention(q, k, v, attn_mask=mask)
    # The last query sees every key: the same as unmasked attention for that row.
    torch.testing.assert_close(out[:, :, -1], reference.attention(q, k, v)[:, :, -1])
    torch.testing.assert_close(out, sdpa64(q, k, v, visible=mask))


def test_lse_is_the_row_log_sum_exp():
    s = AttentionShape(B=2, Hq=2, Hkv=2, Tq=5, Tk=7, D=16, Dv=16)
    q, k, v = make_qkv(s, F64, "cpu")
    _out, lse = reference.attention(q, k, v, is_causal=True, return_lse=True)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(16)
    scores = scores.masked_fill(~masks.causal_mask(5, 7), float("-inf"))
    assert lse.dtype == torch.float32 and lse.shape == (2, 2, 5)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fully_masked_rows_give_zero_output_zero_grads_and_minus_inf_lse(dtype):
    s = AttentionShape(B=2, Hq=2, Hkv=2, Tq=5, Tk=6, D=16, Dv=16)
    q, k, v = make_qkv(s, dtype, "cpu", requires_grad=True)
    attn_mask = torch.ones(5, 6, dtype=torch.bool)
    attn_mask[1] = False  # query 1 sees nothing
    float_mask = torch.zeros(2, 2, 5, 6, requires_grad=True)
    float_mask.data[:, :, 3] = float("-inf")  # query 3 sees nothing through the float mask
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1] = True  # batch 1: every key is padding
    for mask in (attn_mask, float_mask):
        out, lse = reference.attention(q, k, v, mask, key_padding_mask=kpm, return_lse=True)
        dead_row = 1 if mask is attn_mask else 3
        (out.float() * torch.randn(out.shape)).sum().backward()
        assert not out.isnan().any() and not q.grad.isnan().any() and not k.grad.isnan().any()
        assert (out[:, :, dead_row] == 0).all() and (out[1] == 0).all()
        assert (q.grad[:, :, dead_row] == 0).all() and (q.grad[1] == 0).all()
        assert (k.grad[1] == 0).all() and (v.grad[1] == 0).all()
        assert (lse[:, :, dead_row] == float("-inf")).all() and (lse[1] == float("-inf")).all()
        assert torch.isfinite(lse[0, :, 0]).all() and (out[0, :, 0] != 0).any()
        q.grad = k.grad = v.grad = None
    assert not float_mask.grad.isnan().any() and (float_mask.grad[1] == 0).all()


def test_float_mask_gradient_by_gradcheck():
    s = AttentionShape(B=1, Hq=2, Hkv=1, Tq=3, Tk=4, D=5, Dv=3)
    q, k, v = make_qkv(s, F64, "cpu", requires_grad=True)
    bias = torch.randn(2, 3, 4, dtype=F64, requires_grad=True)  # a learned position bias
    kpm = torch.tensor([[False, False, True, False]])

    def fn(q, k, v, bias):
        return reference.attention(
            q, k, v, bias, is_causal=True, enable_gqa=True, key_padding_mask=kpm
        )

    assert torch.autograd.gradcheck(fn, (q, k, v, bias))


def test_dropout_is_reproducible_keeps_one_minus_p_and_is_unbiased():
    s = AttentionShape(B=4, Hq=4, Hkv=4, Tq=64, Tk=64, D=8, Dv=8)
    q = torch.zeros(s.B, s.Hq, s.Tq, s.D)  # uniform attention: out = mean of kept v rows
    k = torch.randn(s.B, s.Hkv, s.Tk, s.D)
    v = torch.ones(s.B, s.Hkv, s.Tk, s.Dv)
    torch.manual_seed(7)
    a = reference.attention(q, k, v, dropout_p=0.25)
    torch.manual_seed(7)
    b = reference.attention(q, k, v, dropout_p=0.25)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Each output is (kept keys / Tk) / (1 - p): its mean is 1 and the kept share is 0.75.
    kept_share = (a[..., 0] * 0.75).mean().item()
    assert abs(kept_share - 0.75) < 0.01
    assert abs(a.mean().item() - 1.0) < 0.015
    assert not torch.equal(a, reference.attention(q, k, v))


def test_half_inputs_give_half_outputs_and_float32_lse():
    s = AttentionShape(B=1, Hq=2, Hkv=2, Tq=4, Tk=4, D=256, Dv=256)
    q, k, v = make_qkv(s, torch.float16, "cpu")
    out, lse = reference.attention(q * 30, k * 30, v, return_lse=True)  # large scores
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()


# ---- variants: against masks and sums built here, element by element ----------------------


def loop_visibility(Tq, Tk, left, right, bottom_right):
    """(Tq, Tk) bool of the window rule, one element at a time."""
    offset = Tk - Tq if bottom_right else 0
    visible = torch.zeros(Tq, Tk, dtype=torch.bool)
    for i in range(Tq):
        for j in range(Tk):
            p = i + offset
            visible[i, j] = (left < 0 or j >= p - left) and (right < 0 or j <= p + right)
    return visible


@pytest.mark.parametrize("Tq,Tk", [(7, 7), (5, 11), (11, 5)])
@pytest.mark.parametrize("window", [(2, 1), (3, -1), (-1, 0), (0, 0), (-1, 2)], ids=str)
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_window_and_alignment_match_an_element_by_element_mask(Tq, Tk, window, alignment):
    s = AttentionShape(B=2, Hq=2, Hkv=1, Tq=Tq, Tk=Tk, D=8, Dv=8)
    q, k, v = make_qkv(s, F64, "cpu")
    out, lse = reference.attention(q, k, v, enable_gqa=True, window_size=window,
                                   causal_alignment=alignment, return_lse=True)  # fmt: skip
    visible = loop_visibility(Tq, Tk, *window, alignment == "bottom_right")
    torch.testing.assert_close(out, sdpa64(q, k, v, visible=visible))
    dead = ~visible.any(-1)
    assert (lse[:, :, dead] == float("-inf")).all() and torch.isfinite(lse[:, :, ~dead]).all()


def test_is_causal_makes_the_right_side_zero_and_alignment_moves_it():
    s = AttentionShape(B=1, Hq=2, Hkv=2, Tq=4, Tk=9, D=8, Dv=8)
    q, k, v = make_qkv(s, F64, "cpu")
    for alignment in ("top_left", "bottom_right"):
        br = alignment == "bottom_right"
        got = reference.attention(q, k, v, is_causal=True, window_size=(3, 5),
                                  causal_alignment=alignment)  # fmt: skip
        torch.testing.assert_close(got, sdpa64(q, k, v, visible=loop_visibility(4, 9, 3, 0, br)))
        plain = reference.attention(q, k, v, is_causal=True, causal_alignment=alignment)
        torch.testing.assert_close(
            plain, sdpa64(q, k, v, visible=masks.causal_mask(4, 9, bottom_right=br))
        )


@pytest.mark.parametrize("slopes_shape", [(3,), (2, 3)], ids=str)
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_alibi_adds_minus_slope_times_distance(slopes_shape, alignment):
    s = AttentionShape(B=2, Hq=3, Hkv=3, Tq=4, Tk=6, D=8, Dv=8)
    q, k, v = make_qkv(s, F64, "cpu")
    slopes = torch.rand(slopes_shape)
    offset = 2 if alignment == "bottom_right" else 0
    bias = torch.zeros(2, 3, 4, 6, dtype=F64)
    for b, h, i, j in itertools.product(range(2), range(3), range(4), range(6)):
        slope = slopes[h] if slopes.dim() == 1 else slopes[b, h]
        bias[b, h, i, j] = -float(slope) * abs(i + offset - j)
    got = reference.attention(q, k, v, alibi_slopes=slopes, causal_alignment=alignment)
    torch.testing.assert_close(got, sdpa64(q, k, v, additive=bias))


def test_softcap_caps_the_scaled_scores_before_the_masks():
    s = AttentionShape(B=1, Hq=2, Hkv=2, Tq=5, Tk=6, D=8, Dv=8)
    q, k, v = make_qkv(s, F64, "cpu")
    q = q * 4  # scores well past the cap
    bias = torch.randn(5, 6, dtype=F64)
    got, lse = reference.attention(q, k, v, bias, is_causal=True, scale=0.7, softcap=2.0,
                                   return_lse=True)  # fmt: skip
    scores = 2.0 * torch.tanh((q @ k.transpose(-1, -2)) * 0.7 / 2.0) + bias
    scores = scores.masked_fill(~masks.causal_mask(5, 6), float("-inf"))
    torch.testing.assert_close(got, torch.softmax(scores, -1) @ v)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1).float())


def test_sinks_join_the_normaliser_and_rows_that_see_nothing_give_zero_and_the_sink():
    s = AttentionShape(B=2, Hq=3, Hkv=3, Tq=4, Tk=5, D=8, Dv=8)
    q, k, v = make_qkv(s, F64, "cpu", requires_grad=True)
    sinks = torch.randn(3, dtype=F64, requires_grad=True)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[1] = True  # batch 1 sees nothing
    out, lse = reference.attention(q, k, v, key_padding_mask=kpm, sinks=sinks, return_lse=True)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(8)
    scores = scores.masked_fill(kpm[:, None, None, :], float("-inf"))
    norm = torch.exp(sinks)[None, :, None] + torch.exp(scores).sum(-1)
    want = (torch.exp(scores) / norm[..., None]) @ v
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, torch.log(norm).float())
    assert (out[1] == 0).all() and torch.equal(lse[1], sinks.detach().float()[:, None].expand(3, 4))
    assert torch.autograd.gradcheck(
        lambda q, sinks: reference.attention(q, k.detach(), v.detach(), sinks=sinks,
                                             key_padding_mask=kpm),
        (q, sinks),
    )  # fmt: skip


def test_varlen_matches_each_sequence_padded_into_a_batch():
    lengths_q, lengths_k = [3, 0, 7, 5], [4, 6, 7, 1]
    cu_q = torch.tensor([0, *itertools.accumulate(lengths_q)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lengths_k)], dtype=torch.int32)
    q = torch.randn(sum(lengths_q), 4, 8, dtype=F64)
    k = torch.randn(sum(lengths_k), 2, 8, dtype=F64)
    v = torch.randn(sum(lengths_k), 2, 6, dtype=F64)
    kw = dict(is_causal=True, causal_alignment="bottom_right", window_size=(3, -1))
    out, lse = reference.varlen_attention(q, k, v, cu_q, cu_k, 7, 7, enable_gqa=True,
                                        return_lse=True, **kw)  # fmt: skip
    assert out.shape == (15, 4, 6) and lse.shape == (4, 15)
    # Pad every sequence to (B, H, 7, D) and hide the padding keys; each sequence's own
    # bottom-right offset comes from an explicit per-sequence mask.
    for b in range(4):
        qs = q[cu_q[b] : cu_q[b + 1]].transpose(0, 1)[None]
        ks = k[cu_k[b] : cu_k[b + 1]].transpose(0, 1)[None]
        vs = v[cu_k[b] : cu_k[b + 1]].transpose(0, 1)[None]
        visible = loop_visibility(lengths_q[b], lengths_k[b], 3, 0, True)
        want = (
            sdpa64(qs, ks, vs, visible=visible)
            if lengths_k[b]
            else torch.zeros(1, 4, lengths_q[b], 6, dtype=F64)
        )
        torch.testing.assert_close(out[cu_q[b] : cu_q[b + 1]], want[0].transpose(0, 1))
