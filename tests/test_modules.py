"""fusedattn.MultiheadAttention / LayerNorm / Softmax against torch's modules: constructor,
initialisation, state_dict, repr, every MHA option, outputs, weights and gradients."""

import itertools

import pytest
import torch
from dispatch_probe import count_dispatches
from torch import nn

import fusedattn

F64 = torch.float64
BACKENDS = ["reference", "torch"]


def mha_pair(backend="torch", **options):
    torch.manual_seed(3)
    theirs = nn.MultiheadAttention(16, 4, dtype=F64, **options)
    torch.manual_seed(3)
    ours = fusedattn.MultiheadAttention(16, 4, dtype=F64, backend=backend, **options)
    return ours, theirs


OPTIONS = [
    {},
    {"bias": False},
    {"add_bias_kv": True},
    {"add_zero_attn": True},
    {"kdim": 12, "vdim": 20},
    {"batch_first": True},
    {"add_bias_kv": True, "add_zero_attn": True, "kdim": 12, "vdim": 20, "batch_first": True},
]


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_same_init_state_dict_keys_and_repr(options):
    ours, theirs = mha_pair(**options)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for (name, a), (_, b) in zip(
        ours.state_dict().items(), theirs.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name  # same initialisation under the same seed
    assert repr(ours) == repr(theirs)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]


def inputs(options, B=3, Tq=5, Tk=7, batched=True):
    kdim, vdim = options.get("kdim", 16), options.get("vdim", 16)
    first = options.get("batch_first", False)

    def make(T, E):
        shape = (B, T, E) if first else (T, B, E)
        return torch.randn(shape if batched else (T, E), dtype=F64)

    return make(Tq, 16), make(Tk, kdim), make(Tk, vdim)


MASKS = ["none", "bool2d", "float2d", "bool3d", "float3d"]


def make_masks(kind, kpm_kind, B=3, Tq=5, Tk=7, H=4):
    attn_mask = None
    if kind.startswith("bool"):
        attn_mask = torch.rand((Tq, Tk) if kind == "bool2d" else (B * H, Tq, Tk)) > 0.7
        attn_mask[..., 0] = False  # True = NOT allowed (torch): keep key 0 visible
    elif kind.startswith("float"):
        attn_mask = torch.randn((Tq, Tk) if kind == "float2d" else (B * H, Tq, Tk), dtype=F64)
    kpm = None
    if kpm_kind == "bool":
        kpm = torch.zeros(B, Tk, dtype=torch.bool)
        kpm[1, 4:] = True
    elif kpm_kind == "float":
        kpm = torch.zeros(B, Tk, dtype=F64)
        kpm[1, 4:] = float("-inf")
    return attn_mask, kpm


@pytest.mark.filterwarnings("ignore:Support for mismatched")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("mask,kpm", list(itertools.product(MASKS, ["none", "bool", "float"])))
def test_forward_weights_and_grads_match_torch(backend, options, mask, kpm):
    ours, theirs = mha_pair(backend, **options)
    q, k, v = inputs(options)
    attn_mask, key_padding_mask = make_masks(mask, kpm)
    for need_weights, average in ((True, True), (True, False), (False, True)):
        kw = dict(attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                  need_weights=need_weights, average_attn_weights=average)  # fmt: skip
        out, w = ours(q, k, v, **kw)
        out_t, w_t = theirs(q, k, v, **kw)
        torch.testing.assert_close(out, out_t)
        if need_weights:
            torch.testing.assert_close(w, w_t)
        else:
            assert w is None and w_t is None
    out.square().sum().backward()
    out_t.square().sum().backward()
    for (name, p), (_, pt) in zip(ours.named_parameters(), theirs.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, pt.grad, msg=name)


@pytest.mark.filterwarnings("ignore:Support for mismatched")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", [{}, {"batch_first": True}, {"add_bias_kv": True}], ids=str)
def test_self_attention_with_causal_hint(backend, options):
    ours, theirs = mha_pair(backend, **options)
    x = inputs(options, Tk=5)[0]
    mask = nn.Transformer.generate_square_subsequent_mask(5, dtype=F64)
    kpm = torch.zeros(3, 5, dtype=torch.bool)
    kpm[2, 3:] = True
    for kw in (dict(attn_mask=mask, is_causal=True), dict(attn_mask=mask, is_causal=True,
                                                          key_padding_mask=kpm)):  # fmt: skip
        torch.testing.assert_close(ours(x, x, x, **kw)[0], theirs(x, x, x, **kw)[0])
    # Our extension: the hint alone builds the causal mask.
    torch.testing.assert_close(ours(x, x, x, is_causal=True)[0], theirs(x, x, x, attn_mask=mask)[0])


@pytest.mark.filterwarnings("ignore:Support for mismatched")
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", [{}, {"add_bias_kv": True}], ids=str)
def test_causal_hint_keeps_a_float_key_padding_mask(backend, options):
    """is_causal=True with torch's causal mask and a float key_padding_mask: the padding is
    added to the scores (it was dropped with the hint mask: the padded key was attended)."""
    ours, theirs = mha_pair(backend, **options)
    x = inputs(options, Tk=5)[0]
    mask = nn.Transformer.generate_square_subsequent_mask(5, dtype=F64)
    kpm = torch.zeros(3, 5, dtype=F64)
    kpm[:, 1] = float("-inf")
    kpm[2, 3] = -2.0
    kw = dict(attn_mask=mask, is_causal=True, key_padding_mask=kpm, need_weights=False)
    torch.testing.assert_close(ours(x, x, x, **kw)[0], theirs(x, x, x, **kw)[0])


@pytest.mark.parametrize(
    "shapes,match",
    [
        (((3, 2, 12), (3, 2, 16), (3, 2, 16)), "query must have 16 features"),
        (((3, 2, 16), (3, 2, 12), (3, 2, 16)), "key must have 16 features"),
        (((3, 2, 3, 16),) * 3, "query must be 3-D"),
        (((3, 2, 16), (4, 16), (4, 16)), "same number of dims"),
        (((3, 2, 16), (4, 3, 16), (4, 3, 16)), "same batch size"),
        (((3, 2, 16), (4, 2, 16), (5, 2, 16)), "key and value must have the same length"),
    ],
    ids=lambda c: c if isinstance(c, str) else "",
)
def test_bad_input_shapes_get_clear_errors(shapes, match):
    ours, _ = mha_pair("reference")
    with pytest.raises(ValueError, match=match):
        ours(*(torch.randn(s, dtype=F64) for s in shapes))


def test_modules_refuse_torch_jit_script_clearly():
    for module in (
        fusedattn.MultiheadAttention(16, 4),
        fusedattn.LayerNorm(8),
        fusedattn.Softmax(-1),
    ):
        with pytest.raises(TypeError, match=r"not scriptable .* use torch.compile"):
            torch.jit.script(nn.Sequential(module))
    trace = torch.jit.trace(fusedattn.LayerNorm(8, backend="torch"), torch.randn(2, 8))
    assert trace(torch.randn(2, 8)).shape == (2, 8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unbatched_inputs(backend):
    ours, theirs = mha_pair(backend)
    q, k, v = inputs({}, batched=False)
    kpm = torch.tensor([False] * 5 + [True] * 2)
    out, w = ours(q, k, v, key_padding_mask=kpm)
    out_t, w_t = theirs(q, k, v, key_padding_mask=kpm)
    assert out.shape == out_t.shape == (5, 16) and w.shape == w_t.shape == (5, 7)
    torch.testing.assert_close(out, out_t)
    torch.testing.assert_close(w, w_t)


def test_checkpoints_load_both_ways():
    theirs = nn.MultiheadAttention(16, 4, kdim=12, vdim=20, add_bias_kv=True)
    ours = fusedattn.MultiheadAttention(16, 4, kdim=12, vdim=20, add_bias_kv=True)
    ours.load_state_dict(theirs.state_dict())
    back = nn.MultiheadAttention(16, 4, kdim=12, vdim=20, add_bias_kv=True)
    back.load_state_dict(ours.state_dict())
    q, k, v = inputs({"kdim": 12, "vdim": 20})
    q, k, v = q.float(), k.float(), v.float()
    torch.testing.assert_close(back(q, k, v)[0], theirs(q, k, v)[0])
    torch.testing.assert_close(ours(q, k, v)[0], theirs(q, k, v)[0])


def test_fully_masked_rows_give_zero_where_torch_gives_nan():
    ours, theirs = mha_pair("torch", batch_first=True)
    x = torch.randn(2, 4, 16, dtype=F64)
    kpm = torch.zeros(2, 4, dtype=torch.bool)
    kpm[1] = True  # batch 1: every key is padding
    out, w = ours(x, x, x, key_padding_mask=kpm)
    out_t, w_t = theirs(x, x, x, key_padding_mask=kpm)
    assert torch.isnan(w_t[1]).all()  # torch's behaviour, for the record
    assert (w[1] == 0).all() and not out.isnan().any()
    # The attention output of a dead row is 0, so the module returns out_proj's bias there.
    torch.testing.assert_close(out[1], ours.out_proj.bias.expand(4, 16))
    torch.testing.assert_close(out[0], out_t[0])


def test_module_runs_the_chosen_backend_and_dropout_only_in_training():
    ours, _ = mha_pair("torch", dropout=0.5, batch_first=True)
    x = torch.randn(2, 6, 16, dtype=F64)
    with count_dispatches() as counts:
        ours(x, x, x, need_weights=False)
    assert counts == {("attention", "torch"): 1}
    ours.eval()
    torch.testing.assert_close(ours(x, x, x)[0], ours(x, x, x)[0])
    ours.train()
    assert not torch.equal(ours(x, x, x)[0], ours(x, x, x)[0])
    with pytest.raises(ValueError, match="backend='triton'"):
        ours.backend = "triton"
        ours(x, x, x)


def test_constructor_errors_match_torch():
    with pytest.raises(ValueError, match="must be greater than 0"):
        fusedattn.MultiheadAttention(0, 2)
    with pytest.raises(ValueError, match="divisible"):
        fusedattn.MultiheadAttention(10, 4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kw", [{}, {"elementwise_affine": False}, {"bias": False}, {"eps": 1e-3}],
                         ids=str)  # fmt: skip
def test_layer_norm_module_matches_torch(backend, kw):
    theirs = nn.LayerNorm((4, 6), **kw)
    ours = fusedattn.LayerNorm((4, 6), backend=backend, **kw)
    if theirs.weight is not None:
        with torch.no_grad():
            theirs.weight.normal_()
            if theirs.bias is not None:
                theirs.bias.normal_()
    ours.load_state_dict(theirs.state_dict())
    assert repr(ours) == repr(theirs) and list(ours.state_dict()) == list(theirs.state_dict())
    x = torch.randn(3, 4, 6, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    torch.testing.assert_close(ours(x), theirs(x2))
    ours(x).sum().backward()
    theirs(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_softmax_module_matches_torch(backend):
    x = torch.randn(3, 4, 5)
    for dim in (0, 1, -1):
        ours, theirs = fusedattn.Softmax(dim, backend=backend), nn.Softmax(dim)
        assert repr(ours) == repr(theirs)
        torch.testing.assert_close(ours(x), theirs(x))
    with pytest.warns(UserWarning, match="Implicit dimension"):
        torch.testing.assert_close(fusedattn.Softmax(backend=backend)(x), nn.Softmax()(x))
    dead = torch.full((2, 3), float("-inf"))
    assert (fusedattn.Softmax(-1, backend=backend)(dead) == 0).all()
