"""Bad input gets a clear TypeError/ValueError naming the argument, on every backend, before
any computation, and the caller's tensors are never written."""

import pytest
import torch

import fusedattn
from fusedattn import reference

BACKENDS = ["reference", "torch", "auto"]


def qkv(B=2, H=4, Tq=5, Tk=6, D=8, dtype=torch.float32):
    return (
        torch.randn(B, H, Tq, D, dtype=dtype),
        torch.randn(B, H, Tk, D, dtype=dtype),
        torch.randn(B, H, Tk, D, dtype=dtype),
    )


q, k, v = qkv()
jagged = torch.nested.nested_tensor(
    [torch.randn(4, 3, 8), torch.randn(4, 5, 8)], layout=torch.jagged
)
ATTENTION_CASES = [
    ("q is a nested (jagged) tensor", TypeError, dict(q=jagged, k=jagged, v=jagged)),
    ("q must be a torch.Tensor", TypeError, dict(q=[1.0])),
    ("q must be 4-D", ValueError, dict(q=q[0])),
    (
        "q must be float16, bfloat16, float32 or float64",
        TypeError,
        dict(q=q.int(), k=k.int(), v=v.int()),
    ),
    ("k must have the dtype of q", TypeError, dict(k=k.half())),
    ("same batch size", ValueError, dict(k=k[:1], v=v[:1])),
    ("head dim 8", ValueError, dict(k=torch.randn(2, 4, 6, 4))),
    ("v must have k's heads and length", ValueError, dict(v=v[:, :, :3])),
    ("enable_gqa=True", ValueError, dict(k=k[:, :2], v=v[:, :2])),
    ("multiple of Hkv", ValueError, dict(k=k[:, :3], v=v[:, :3], enable_gqa=True)),
    (
        "attn_mask of shape (5, 7) does not broadcast to (2, 4, 5, 6)",
        ValueError,
        dict(attn_mask=torch.ones(5, 7, dtype=torch.bool)),
    ),
    (
        "attn_mask of shape (1, 2, 4, 5, 6)",
        ValueError,
        dict(attn_mask=torch.ones(1, 2, 4, 5, 6, dtype=torch.bool)),
    ),
    (
        "attn_mask must be bool or floating point",
        TypeError,
        dict(attn_mask=torch.ones(5, 6, dtype=torch.int64)),
    ),
    ("key_padding_mask must be bool", TypeError, dict(key_padding_mask=torch.zeros(2, 6))),
    (
        "key_padding_mask must have shape (B, Tk) = (2, 6)",
        ValueError,
        dict(key_padding_mask=torch.zeros(2, 5, dtype=torch.bool)),
    ),
    ("dropout_p must be in [0, 1)", ValueError, dict(dropout_p=1.0)),
    ("dropout_p must be a float", TypeError, dict(dropout_p="0.1")),
    ("is_causal must be a bool", TypeError, dict(is_causal=1)),
    ("scale must be finite", ValueError, dict(scale=float("nan"))),
    ("scale must be a float", TypeError, dict(scale="1")),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "match,error,change", ATTENTION_CASES, ids=[c[0][:40] for c in ATTENTION_CASES]
)
def test_attention_rejects_bad_input(backend, match, error, change):
    args = dict(q=q, k=k, v=v) | change
    with pytest.raises(
        error, match=match.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        fusedattn.attention(**args, backend=backend)


LN_CASES = [
    ("x must be a torch.Tensor", TypeError, dict(x=1.0)),
    ("x must be float16", TypeError, dict(x=torch.ones(3, 8, dtype=torch.int32))),
    ("must end with normalized_shape", ValueError, dict(normalized_shape=(7,))),
    ("normalized_shape must be an int or a sequence", TypeError, dict(normalized_shape="8")),
    ("weight must have shape normalized_shape", ValueError, dict(weight=torch.ones(7))),
    ("bias must be torch.float32", TypeError, dict(bias=torch.ones(8, dtype=torch.float64))),
    ("eps must be a non-negative float", ValueError, dict(eps=-1.0)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("match,error,change", LN_CASES, ids=[c[0][:40] for c in LN_CASES])
def test_layer_norm_rejects_bad_input(backend, match, error, change):
    args = dict(x=torch.randn(3, 8), normalized_shape=8) | change
    with pytest.raises(error, match=match):
        fusedattn.layer_norm(**args, backend=backend)


SOFTMAX_CASES = [
    ("x must be float16", TypeError, dict(x=torch.ones(3, 8, dtype=torch.int64))),
    ("dim 2 is out of range", ValueError, dict(dim=2)),
    (
        r"Dimension out of range \(expected to be in range of \[-2, 1\], but got -3\)",
        IndexError,
        dict(dim=-3),
    ),  # torch's error, as vLLM's test_row_softmax_invalid_negative_dim
    (r"in range of \[-1, 0\], but got 1", IndexError, dict(x=torch.tensor(1.0), dim=1)),
    ("dim must be an int", TypeError, dict(dim=1.0)),
    ("does not broadcast", ValueError, dict(mask=torch.ones(3, 3, 8, dtype=torch.bool))),
    ("is_causal=True needs", ValueError, dict(is_causal=True, dim=0)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "match,error,change", SOFTMAX_CASES, ids=[c[0][:40] for c in SOFTMAX_CASES]
)
def test_softmax_rejects_bad_input(backend, match, error, change):
    args = dict(x=torch.randn(3, 8), dim=-1) | change
    with pytest.raises(error, match=match):
        fusedattn.softmax(**args, backend=backend)


def test_reference_ops_validate_too():
    with pytest.raises(ValueError, match="q must be 4-D"):
        reference.attention(q[0], k, v)
    with pytest.raises(ValueError, match="must end with normalized_shape"):
        reference.layer_norm(torch.randn(3, 8), 7)
    with pytest.raises(ValueError, match="out of range"):
        reference.softmax(torch.randn(3, 8), 5)


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_inputs_are_never_written(backend):
    a, b, c = (t.clone() for t in qkv())
    mask = torch.randn(5, 6)
    saved = [t.clone() for t in (a, b, c, mask)]
    fusedattn.attention(a, b, c, mask, is_causal=True, backend=backend)
    x = torch.randn(3, 8)
    x_saved = x.clone()
    fusedattn.softmax(x, mask=torch.rand(3, 8) > 0.5, backend=backend)
    fusedattn.layer_norm(x, 8, backend=backend)
    for before, after in zip([*saved, x_saved], [a, b, c, mask, x], strict=True):
        assert torch.equal(before, after)
