"""The warp-specialized Triton forward (Tiles.warp_spec, issue #61): the interior key loop
through `tl.range(warp_specialize=True)`, K and V read through tensor descriptors the kernel
makes for each head (attention_fwd's WARP_SPEC). Against the float64 reference under the k×
rule, forward and backward, over the variant grid, and against the plain loop, which it must
equal: the interpreter runs the same tiles in the same order (it ignores the specialization
and zero-fills the descriptors' copies where the plain loop masks), so the bits agree. Off by
default until a GPU times it (scripts/tune_triton_attention.py, `w` candidates)."""

import dataclasses
from functools import partial

import pytest
import torch
from hard_shapes import AttentionShape, make_qkv
from kx_check import assert_op_kx
from test_attention_pipeline import fwd_tiles, launch, probe
from test_attention_variants import SHAPES, VARIANTS, check
from tiles_patch import patch_attention_config

import fusedattn
from fusedattn.ops.attention.triton_args import TritonAttentionLaunch

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("kernel_device")]
K = pytest.importorskip("fusedattn.triton_kernels.attention")
triton_attention = partial(fusedattn.attention, backend="triton")

GPU = torch.cuda.is_available()
# The flag changes the forward kernel alone. In the interpreter the variant grids check the
# forward only: the backward kernels are the plain ones (their own grids), and the out and lse
# they read are the plain loop's bit for bit (the equality test). On a GPU, gradients too.
FORWARD_ONLY = not GPU
HOPPER = GPU and torch.cuda.get_device_capability() == (9, 0)
GPU_REASON = "Triton's warp specialization of the forward is a Hopper (sm_90) pass"


def with_warp_spec(monkeypatch, on: bool):
    """Every Triton forward from here on runs (on=True) its interior loop warp-specialized
    with 4 warps, or plainly with the same tiles (on a GPU: sm_90 only)."""

    def config(cfg, *args, **kwargs):
        if GPU and not HOPPER:
            return cfg
        fwd = dataclasses.replace(cfg.fwd, num_warps=4, tma=False, pipeline=False, warp_spec=on)
        return dataclasses.replace(cfg, fwd=fwd)

    patch_attention_config(monkeypatch, config)


@pytest.fixture
def warp_specialized_forward(monkeypatch):
    with_warp_spec(monkeypatch, True)


def specialized_or_skip(q, v):
    if not fwd_tiles(q, v).get("WARP_SPEC", False):
        assert GPU, "the interpreter takes any tiles"
        pytest.skip(GPU_REASON)


def test_tiles_spec_takes_the_flag_for_the_forward_alone():
    t = K.Tiles.parse("128x128w4s3w", "fwd")
    assert t.warp_spec and t.num_warps == 4 and t.spec == "128x128w4s3w"
    for spec, kernel in [("128x128w4s3w", "dq"), ("64x128w4s3w", "dkdv"),
                         ("128x128w8s3w", "fwd"), ("128x128w4s3tw", "fwd"),
                         ("128x128w4s3pw", "fwd"), ("128x128w4s3wt", "fwd")]:  # fmt: skip
        with pytest.raises(ValueError):
            K.Tiles.parse(spec, kernel)


def test_the_launcher_specializes_only_rows_the_kernel_can_describe():
    """WARP_SPEC only when the tiles ask for it and every K/V head's rows start 16-byte
    aligned with 16-byte row strides (else the plain loop: the same result)."""
    s = AttentionShape(1, 2, 2, 40, 40, 16, 16)
    q, _, v = make_qkv(s, torch.float32, torch.get_default_device())
    base = K.attention_config(16, 16, q.is_cuda)
    ws = dataclasses.replace(base, fwd=K.Tiles(64, 64, 4, 2, warp_spec=True))
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    for cfg, want in ((base, False), (ws, not GPU or q.element_size() == 2)):
        _, _, constexprs = launch(q, v, cfg).fwd_args(q, q, v, out, lse)
        assert constexprs.get("WARP_SPEC", False) is want
    odd = torch.randn(1, 2, 40, 17, device=q.device)[..., :16]  # rows 68 bytes apart
    _, _, constexprs = launch(odd, odd, ws).fwd_args(odd, odd, odd, out, lse)
    assert not constexprs.get("WARP_SPEC", False)


def test_masks_padding_and_dropout_keep_the_plain_loop(monkeypatch):
    """Triton 3.6's warp specialization fails to compile a key loop that loads through
    pointers (an attn_mask, key padding): those calls, and dropout's, keep the plain loop,
    with the same result."""
    with_warp_spec(monkeypatch, True)
    s = AttentionShape(1, 2, 2, 40, 40, 16, 16)
    q, _, v = make_qkv(s, torch.float32, torch.get_default_device())
    cfg = K.attention_config(16, 16, q.is_cuda)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3])
    for extra in (dict(attn_mask=torch.zeros(40, 40)),
                  dict(key_padding_mask=torch.zeros(1, 40, dtype=torch.bool)),
                  dict(dropout_p=0.1)):  # fmt: skip
        args = dict(attn_mask=None, key_padding_mask=None, dropout_p=0.0) | extra
        L = TritonAttentionLaunch(
            q, q, v, args["attn_mask"], args["key_padding_mask"], None, None, None, None, 0, 0,
            window_left=-1, window_right=-1, bottom_right=False, scale=1.0, softcap=0.0,
            dropout_p=args["dropout_p"], seed=None, config=cfg,
        )  # fmt: skip
        _, _, constexprs = L.fwd_args(q, q, v, out, lse)
        assert not constexprs.get("WARP_SPEC", False), extra


# the pipelined loop's cases the specialized loop takes (masks, padding, dropout: the test above)
CASES = {
    "plain": {},
    "causal": dict(is_causal=True),
    "window": dict(window_size=(70, 45)),
    "softcap_alibi_sinks": dict(softcap=3.0, alibi_slopes="head", sinks=True),
}
SPECIALIZED_VARIANTS = {
    name: v for name, v in VARIANTS.items() if "attn_mask" not in v and "key_padding_mask" not in v
}


def forward(monkeypatch, on: bool, q, k, v, **kw):
    with monkeypatch.context() as m:
        with_warp_spec(m, on)
        torch.manual_seed(11)
        return triton_attention(q, k, v, return_lse=True, **kw)


DTYPE, HEAD_DIM = (torch.bfloat16, 128) if GPU else (torch.float32, 16)


@pytest.mark.parametrize("interior", [0, 1, 3])
@pytest.mark.parametrize("case", CASES)
def test_specialized_loop_equals_the_plain_loop(monkeypatch, case, interior):
    """Tk = interior whole key tiles plus a cut one, every variant of the pipelined loop's
    test: the same bits in the interpreter (compiled, the dtype's tolerance)."""
    with monkeypatch.context() as m:
        with_warp_spec(m, True)
        specialized_or_skip(probe(DTYPE, HEAD_DIM), probe(DTYPE, HEAD_DIM))
        bn = fwd_tiles(probe(DTYPE, HEAD_DIM), probe(DTYPE, HEAD_DIM))["BLOCK_N"]
    Tk = interior * bn + 7
    s = AttentionShape(2, 2, 1, 45, Tk, HEAD_DIM, HEAD_DIM)
    q, k, v = make_qkv(s, DTYPE, torch.get_default_device())
    kw = dict(CASES[case], enable_gqa=True)
    if kw.get("alibi_slopes") == "head":
        kw["alibi_slopes"] = torch.rand(s.Hq) * 0.3
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(s.Hq)
    with monkeypatch.context() as m:
        with_warp_spec(m, True)
        tiles = fwd_tiles(q, v)
    assert tiles.get("WARP_SPEC", False) or GPU  # the interpreter runs the specialized loop
    plain = forward(monkeypatch, False, q, k, v, **kw)
    special = forward(monkeypatch, True, q, k, v, **kw)
    for a, b in zip(plain, special, strict=True):
        if q.is_cuda:
            torch.testing.assert_close(b, a)
        else:
            assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.usefixtures("warp_specialized_forward")
# one shape in the interpreter (its bits equal the plain loop's: the equality tests), both on
# a GPU (as test_attention_bwd_pipeline's grid; issue #70's test-time cut)
@pytest.mark.parametrize("shape", SHAPES[:2] if GPU else SHAPES[:1], ids=str)
@pytest.mark.parametrize("name", SPECIALIZED_VARIANTS)
def test_specialized_forward_variants_fp32(name, shape):
    """The variant grid but its masked variant (fp32 in the interpreter, which runs the
    descriptor path for any dtype; a GPU takes 2-byte inputs only and skips)."""
    if GPU:
        pytest.skip("fp32 keeps the plain loop on a GPU")
    check("triton", shape, torch.float32, SPECIALIZED_VARIANTS[name], forward_only=FORWARD_ONLY)


@pytest.mark.slow
@pytest.mark.usefixtures("warp_specialized_forward")
@pytest.mark.parametrize(
    "name, dtype",
    [(name, torch.bfloat16) for name in ("plain", "causal", "wide_window", "softcap")]
    + [("alibi_per_batch_bottom_right", torch.float16), ("sinks", torch.float16)],
    ids=str,
)
def test_specialized_forward_variants_half(name, dtype):
    specialized_or_skip(probe(dtype, 64), probe(dtype, 64))
    variant = (VARIANTS | {"plain": {}, "causal": dict(is_causal=True)})[name]
    check(
        "triton",
        AttentionShape(2, 2, 2, 150, 333, 64, 64),
        dtype,
        variant,
        forward_only=FORWARD_ONLY,
    )


@pytest.mark.usefixtures("warp_specialized_forward")
def test_specialized_forward_varlen():
    """Packed sequences: each sequence's rows are its own descriptor (an empty one too)."""
    specialized_or_skip(probe(torch.bfloat16, 64), probe(torch.bfloat16, 64))
    cu_q = torch.tensor([0, 0, 37, 240], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 90, 400], dtype=torch.int32)
    q = torch.randn(240, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(400, 2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    tensors = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    op = partial(fusedattn.varlen_attention, backend="triton")
    assert_op_kx(op, fusedattn.reference.varlen_attention, tensors,
                 kwargs=dict(max_seqlen_q=203, max_seqlen_k=310, window_size=(150, -1),
                             enable_gqa=True),
                 grad_of=() if FORWARD_ONLY else ("q", "k", "v"))  # fmt: skip
