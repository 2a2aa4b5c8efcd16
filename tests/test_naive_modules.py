"""The naive nn.Modules (fusedattn.modules.naive, what the reference transformer is made of)
against torch's: same state_dict, same outputs, same weights."""

import pytest
import torch
from torch import nn

from fusedattn.reference import modules as naive


def pair(batch_first, bias=True, dropout=0.0):
    ours = naive.MultiheadAttention(
        16, 4, dropout=dropout, bias=bias, batch_first=batch_first, dtype=torch.float64
    )
    theirs = nn.MultiheadAttention(
        16, 4, dropout=dropout, bias=bias, batch_first=batch_first, dtype=torch.float64
    )
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def test_state_dict_keys_and_shapes_match_torch():
    ours, theirs = pair(True)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: v.shape for k, v in theirs.state_dict().items()
    }
    ours_nb, theirs_nb = pair(True, bias=False)
    assert set(ours_nb.state_dict()) == set(theirs_nb.state_dict())


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mask", ["none", "bool", "float", "3d", "causal"])
@pytest.mark.parametrize("average", [True, False])
def test_mha_matches_torch(batch_first, mask, average):
    ours, theirs = pair(batch_first)
    B, Tq, Tk = 3, 5, 7
    shape = (lambda T: (B, T, 16)) if batch_first else (lambda T: (T, B, 16))
    q = torch.randn(shape(Tq), dtype=torch.float64)
    kv = torch.randn(shape(Tk), dtype=torch.float64)
    kpm = torch.zeros(B, Tk, dtype=torch.bool)
    kpm[1, 4:] = True
    kw = dict(key_padding_mask=kpm, average_attn_weights=average)
    if mask == "bool":
        kw["attn_mask"] = torch.rand(Tq, Tk) > 0.7  # True = NOT allowed, as torch
        kw["attn_mask"][:, 0] = False
    elif mask == "float":
        kw["attn_mask"] = torch.randn(Tq, Tk, dtype=torch.float64)
    elif mask == "3d":
        kw["attn_mask"] = torch.randn(B * 4, Tq, Tk, dtype=torch.float64)
    elif mask == "causal":
        q, kv, Tk = q, q, Tq
        kw["key_padding_mask"] = kpm[:, :Tq]
        kw["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(Tq, dtype=torch.float64)
        kw["is_causal"] = True
    out, w = ours(q, kv, kv, **kw)
    out_t, w_t = theirs(q, kv, kv, **kw)
    torch.testing.assert_close(out, out_t)
    torch.testing.assert_close(w, w_t)
    out_nw, none = ours(q, kv, kv, need_weights=False, **kw)
    assert none is None
    torch.testing.assert_close(out_nw, out_t)


def test_mha_gradients_match_torch():
    ours, theirs = pair(True)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    ours(x, x, x)[0].square().sum().backward()
    theirs(x, x, x)[0].square().sum().backward()
    for (name, p), (_, pt) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, pt.grad, msg=name)


def test_layer_norm_and_softmax_modules_match_torch():
    ln, ln_t = naive.LayerNorm(12, eps=1e-6), nn.LayerNorm(12, eps=1e-6)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    ln_t.load_state_dict(ln.state_dict())
    x = torch.randn(3, 4, 12)
    torch.testing.assert_close(ln(x), ln_t(x))
    torch.testing.assert_close(naive.Softmax(dim=1)(x), nn.Softmax(dim=1)(x))
    with pytest.warns(UserWarning, match="Implicit dimension"):
        torch.testing.assert_close(naive.Softmax()(x), torch.softmax(x, 0))
