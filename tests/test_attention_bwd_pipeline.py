"""The Triton backward's rotated interior loops (Tiles.pipeline on dkdv and dq, issue #61 item
2: the next tile's scores issued before this tile's softmax recomputation, its operands loaded
again for its own products): the same products and updates as the plain loops, so the same
gradient bits in the interpreter, and the k× rule against float64 over the variant grid and
packed sequences. Off by default until a GPU times them: on the sm_90 screen the dK/dV
candidates spill 12-624 B (benchmarks/results/sm90-static/), and Triton 3.6's ptxas (12.8)
crashes on every rotated dQ (CUDA 13.0's compiles it)."""

import dataclasses
from functools import partial

import pytest
import torch
from hard_shapes import AttentionShape, make_qkv
from kx_check import assert_op_kx
from test_attention_variants import SHAPES, VARIANTS, check
from tiles_patch import patch_attention_config

import fusedattn

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("kernel_device")]
K = pytest.importorskip("fusedattn.triton_kernels.attention")
triton_attention = partial(fusedattn.attention, backend="triton")
GPU = torch.cuda.is_available()


def with_rotation(monkeypatch, kernels: tuple[str, ...]):
    """Every Triton backward from here on rotates the interior loops of `kernels` (of dkdv,
    dq; none: the plain loops), in plans of its own (tiles_patch)."""

    def config(cfg, *args, **kw):
        return dataclasses.replace(cfg, **{
            name: dataclasses.replace(getattr(cfg, name), pipeline=name in kernels)
            for name in ("dkdv", "dq")
        })  # fmt: skip

    patch_attention_config(monkeypatch, config)


@pytest.fixture
def rotated_backward(monkeypatch):
    with_rotation(monkeypatch, ("dkdv", "dq"))


def gradients(monkeypatch, kernels, q, k, v, **kw):
    with monkeypatch.context() as m:
        with_rotation(m, kernels)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(11)  # dropout's seed
        out = triton_attention(*leaves, **kw)
        return torch.autograd.grad(out, leaves, torch.ones_like(out))


def test_tiles_take_the_rotation_on_every_kernel():
    for kernel in ("fwd", "dkdv", "dq"):
        assert K.Tiles.parse("64x64w4s2p", kernel).pipeline
    assert K.Tiles.parse("64x128w8s3mp", "dkdv").merge
    with pytest.raises(ValueError):
        K.Tiles.parse("64x64w4s2mp", "dq")  # merged boundary loops are dK/dV's


CASES = {
    "plain": {},
    "causal": dict(is_causal=True),
    "window": dict(window_size=(70, 45)),
    "dropout": dict(dropout_p=0.3),
    "softcap_alibi": dict(softcap=3.0, alibi_slopes="head"),
    "float_mask_key_padding": dict(attn_mask="float", key_padding_mask=True),
}


# no interior tile for each case on a GPU; in the interpreter for the plain case only (the
# rotated loop is then not entered: what the variants change is inside it). The variants
# through three interior tiles are `slow` (42 s of one CPU worker, dropout 15 s of it): make
# test runs them, the edit loop (test-fast) keeps the plain case's laps.
@pytest.mark.parametrize(
    ("case", "tiles"),
    [
        pytest.param(c, t, marks=[pytest.mark.slow] if t and c != "plain" else [])
        for c in CASES
        for t in (0, 3)
        if t or GPU or c == "plain"
    ],
)
def test_rotated_loops_equal_the_plain_loops(monkeypatch, case, tiles):
    """Tq and Tk of `tiles` whole tiles plus a cut one: the interior loops run no tile or 3
    (the prologue, two laps of the rotated loop, the epilogue). Same products and
    updates in the same order: the interpreter gives the same gradient bits; compiled, the
    dtype's tolerance."""
    dtype, D = (torch.bfloat16, 64) if GPU else (torch.float32, 16)
    cfg = K.attention_config(D, D, GPU)
    s = AttentionShape(2, 2, 1, tiles * cfg.dq.block_m + 9, tiles * cfg.dkdv.block_n + 7, D, D)
    q, k, v = make_qkv(s, dtype, torch.get_default_device())
    kw = dict(CASES[case], enable_gqa=True)
    if kw.get("alibi_slopes") == "head":
        kw["alibi_slopes"] = torch.rand(s.Hq) * 0.3
    if kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(1, s.Hq, s.Tq, s.Tk, dtype=dtype)
    if kw.pop("key_padding_mask", False):
        kw["key_padding_mask"] = torch.arange(s.Tk) >= torch.tensor([s.Tk - 3, s.Tk])[:, None]
    plain = gradients(monkeypatch, (), q, k, v, **kw)
    rotated = gradients(monkeypatch, ("dkdv", "dq"), q, k, v, **kw)
    for name, a, b in zip("qkv", plain, rotated, strict=True):
        if q.is_cuda:
            torch.testing.assert_close(b, a, msg=f"d{name}")
        else:
            assert torch.equal(a, b), f"d{name}"


# In the interpreter the rotated loops give the plain loops' bits (above), which the plain
# grids check against float64: one shape and small half/varlen cases there keep the k× checks
# of the rotated code in CI at a third of the interpreter time; a GPU runs them whole.
GRID_SHAPES = SHAPES[:2] if GPU else SHAPES[:1]
HALF_SHAPE = (
    AttentionShape(2, 2, 2, 150, 333, 64, 64) if GPU else AttentionShape(2, 2, 1, 75, 140, 32, 32)
)


@pytest.mark.slow
@pytest.mark.usefixtures("rotated_backward")
@pytest.mark.parametrize("shape", GRID_SHAPES, ids=str)
@pytest.mark.parametrize("name", VARIANTS)
def test_rotated_backward_variants_fp32(name, shape):
    check("triton", shape, torch.float32, VARIANTS[name])


@pytest.mark.usefixtures("rotated_backward")
@pytest.mark.parametrize("name", ["causal", "everything"])
def test_rotated_backward_half(name):
    variant = (VARIANTS | {"causal": dict(is_causal=True)})[name]
    check("triton", HALF_SHAPE, torch.bfloat16, variant)


@pytest.mark.usefixtures("rotated_backward")
def test_rotated_backward_varlen():
    """An empty sequence and two that cross several key and query tiles."""
    cu_q = torch.tensor([0, 0, 37, 140], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 80, 230], dtype=torch.int32)
    D = 64 if GPU else 32
    q = torch.randn(140, 4, D, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(230, 2, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    tensors = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    op = partial(fusedattn.varlen_attention, backend="triton")
    assert_op_kx(op, fusedattn.reference.varlen_attention, tensors,
                 kwargs=dict(max_seqlen_q=103, max_seqlen_k=150, window_size=(100, -1),
                             enable_gqa=True),
                 grad_of=("q", "k", "v"))  # fmt: skip
