"""The Triton forward's pipelined interior loop (Tiles.pipeline: each tile's softmax runs while
the tensor cores work on the neighbouring tiles' products): against the float64 reference
under the k× rule, forward and backward, every variant, and against the plain loop it must
equal (the same tiles in the same order with the same arithmetic: bit for bit in the
interpreter), with 0 to 5 interior tiles. Off by default until a GPU times it
(scripts/tune_triton_attention.py, `p` candidates)."""

import dataclasses
from functools import partial

import pytest
import torch
from hard_shapes import AttentionShape, make_qkv
from kx_check import assert_op_kx
from test_attention_tma import tma_forward  # noqa: F401 (the fixture, used by name)
from test_attention_variants import SHAPES, VARIANTS, check, variant_inputs
from tiles_patch import patch_attention_config

import fusedattn
from fusedattn.ops.attention.triton_args import TritonAttentionLaunch

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("kernel_device")]
K = pytest.importorskip("fusedattn.triton_kernels.attention")
triton_attention = partial(fusedattn.attention, backend="triton")


# ptxas (Triton 3.6, sm_90a) segfaulted compiling the pipelined forward at 4 warps (64x64 tiles:
# D=32 plain, causal and softcap; D=64 causal: benchmarks/results/sm90-static/); on a GPU the
# flag goes only to the 8-warp tiles it was screened with (Hopper's, 2-byte dtypes, D 64-128)
GPU_REASON = "the pipelined loop runs on 8-warp tiles only (ptxas segfaulted at 4 warps)"


def with_pipeline(monkeypatch, on: bool):
    """Every Triton forward from here on runs (on=True) or skips the pipelined loop, on a GPU
    only where its tiles have 8 warps (in plans of its own: tiles_patch)."""

    def config(cfg, D, Dv, on_gpu, **kw):
        if on_gpu and cfg.fwd.num_warps < 8:
            return cfg
        return dataclasses.replace(cfg, fwd=dataclasses.replace(cfg.fwd, pipeline=on))

    patch_attention_config(monkeypatch, config)


@pytest.fixture
def pipelined_forward(monkeypatch):
    with_pipeline(monkeypatch, True)


def fwd_tiles(q, v):
    """The forward tiles a call with these inputs gets from the (patched) config."""
    _, _, constexprs = launch(q, v, None).fwd_args(
        q, q, v, torch.empty_like(q), torch.empty(q.shape[:3])
    )
    return constexprs


def launch(q, v, config):
    return TritonAttentionLaunch(
        q, q, v, None, None, None, None, None, None, 0, 0, window_left=-1, window_right=-1,
        bottom_right=False, scale=1.0, softcap=0.0, dropout_p=0.0, seed=None, config=config,
    )  # fmt: skip


def pipelined_or_skip(q, v):
    """Skip on a GPU where these inputs' forward tiles do not take the pipelined loop."""
    if not fwd_tiles(q, v).get("PIPELINE", False):
        assert q.is_cuda, "the interpreter runs the pipelined loop on any tiles"
        pytest.skip(GPU_REASON)


def test_tiles_spec_round_trips_and_flags_are_checked_per_kernel():
    for spec in ("128x64w8s3", "128x64w8s3p", "128x64w8s3tp", "64x128w8s3m", "64x64w4s2"):
        assert K.Tiles.parse(spec).spec == spec
    t = K.Tiles.parse("128x64w8s3tp", "fwd")
    assert (t.block_m, t.block_n, t.num_warps, t.num_stages) == (128, 64, 8, 3)
    assert t.tma and t.pipeline and not t.merge
    assert K.Tiles.parse("64x128w8s3m", "dkdv").merge
    bad = [("64x128w8s3m", "fwd"), ("128x64w8s3w", "dkdv"), ("64x64w4s2t", "dq"),
           ("128x64w8", None), ("128x64w8s3pt", None), ("128x64w8s3x", None)]  # fmt: skip
    for spec, kernel in bad:
        with pytest.raises(ValueError):
            K.Tiles.parse(spec, kernel)


def test_the_launcher_asks_for_the_pipelined_loop_only_when_the_tiles_do():
    s = AttentionShape(1, 2, 2, 40, 40, 16, 16)
    q, _, v = make_qkv(s, torch.float32, torch.get_default_device())
    base = K.attention_config(16, 16, q.is_cuda)
    for on in (False, True):
        cfg = dataclasses.replace(base, fwd=dataclasses.replace(base.fwd, pipeline=on))
        _, _, constexprs = launch(q, v, cfg).fwd_args(
            q, q, v, torch.empty_like(q), torch.empty(q.shape[:3])
        )
        assert constexprs.get("PIPELINE", False) is on


def forward(monkeypatch, pipeline: bool, q, k, v, **kw):
    """The Triton forward with the pipelined interior loop on or off, dropout's seed fixed."""
    with monkeypatch.context() as m:
        with_pipeline(m, pipeline)
        torch.manual_seed(11)
        return triton_attention(q, k, v, return_lse=True, **kw)


CASES = {
    "plain": {},
    "causal": dict(is_causal=True),
    "window": dict(window_size=(70, 45)),
    "dropout": dict(dropout_p=0.3),
    "softcap_alibi_sinks": dict(softcap=3.0, alibi_slopes="head", sinks=True),
    "float_mask_key_padding": dict(attn_mask="float", key_padding_mask=True),
}


def probe(dtype, D):
    """A one-row tensor that gets the forward tiles of (dtype, head dim D) calls."""
    return torch.empty(1, 1, 1, D, dtype=dtype)


# the interpreter: fp32 at D=16 (fast, exact comparisons); a GPU: the tiles timed on Hopper
GPU = torch.cuda.is_available()
# The flag changes the forward kernel alone. In the interpreter the variant grids check the
# forward only: the backward kernels are the plain ones (their own grids), and the out and lse
# they read are the plain loop's bit for bit (the equality test). On a GPU, gradients too.
FORWARD_ONLY = not GPU
DTYPE, HEAD_DIM = (torch.bfloat16, 128) if GPU else (torch.float32, 16)


@pytest.mark.slow
# 0, 1 and 3 interior tiles in the interpreter (none, one lap, laps carried into each other);
# 2 and 5 more laps of the same loop on a GPU
@pytest.mark.parametrize("interior", [0, 1, 2, 3, 5] if GPU else [0, 1, 3])
@pytest.mark.parametrize("case", CASES)
def test_pipelined_loop_equals_the_plain_loop(monkeypatch, case, interior):
    """Tk = interior whole key tiles plus a cut one: the interior loop (non-causal) runs
    `interior` tiles, the boundary loop the cut tile. Same tiles, same order, same arithmetic:
    the interpreter gives the same bits; compiled, the instruction order may differ."""
    with monkeypatch.context() as m:
        with_pipeline(m, True)
        pipelined_or_skip(probe(DTYPE, HEAD_DIM), probe(DTYPE, HEAD_DIM))
        bn = fwd_tiles(probe(DTYPE, HEAD_DIM), probe(DTYPE, HEAD_DIM))["BLOCK_N"]
    Tk = interior * bn + 7
    s = AttentionShape(2, 2, 1, 45, Tk, HEAD_DIM, HEAD_DIM)
    q, k, v = make_qkv(s, DTYPE, torch.get_default_device())
    kw = dict(CASES[case], enable_gqa=True)
    if kw.get("alibi_slopes") == "head":
        kw["alibi_slopes"] = torch.rand(s.Hq) * 0.3
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(s.Hq)
    if kw.get("attn_mask") == "float":
        kw["attn_mask"] = torch.randn(1, s.Hq, s.Tq, Tk, dtype=DTYPE)
    if kw.pop("key_padding_mask", False):
        kw["key_padding_mask"] = torch.arange(Tk) >= torch.tensor([Tk - 3, Tk])[:, None]
    plain = forward(monkeypatch, False, q, k, v, **kw)
    piped = forward(monkeypatch, True, q, k, v, **kw)
    for a, b in zip(plain, piped, strict=True):
        if q.is_cuda:
            torch.testing.assert_close(b, a)  # the dtype's own tolerance (bf16 out, fp32 lse)
        else:
            assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.usefixtures("pipelined_forward")
# one shape in the interpreter (its bits equal the plain loop's: the equality tests), both on
# a GPU (as test_attention_bwd_pipeline's grid; issue #70's test-time cut)
@pytest.mark.parametrize("shape", SHAPES[:2] if GPU else SHAPES[:1], ids=str)
@pytest.mark.parametrize("name", VARIANTS)
def test_pipelined_forward_variants_fp32(name, shape):
    pipelined_or_skip(probe(torch.float32, shape.D), probe(torch.float32, shape.Dv))
    check("triton", shape, torch.float32, VARIANTS[name], forward_only=FORWARD_ONLY)


@pytest.mark.slow
@pytest.mark.usefixtures("pipelined_forward")
@pytest.mark.parametrize(
    "name, dtype",
    [(name, torch.bfloat16) for name in ("plain", "causal", "wide_window", "softcap")]
    + [("everything", torch.bfloat16), ("everything", torch.float16)],
    ids=str,
)
def test_pipelined_forward_variants_half(name, dtype):
    """Head dim 64: on Hopper, the 8-warp tiles the flag is for (each case compiles three
    kernels on a GPU: a short list)."""
    pipelined_or_skip(probe(dtype, 64), probe(dtype, 64))
    variant = (VARIANTS | {"plain": {}, "causal": dict(is_causal=True)})[name]
    check(
        "triton",
        AttentionShape(2, 2, 2, 150, 333, 64, 64),
        dtype,
        variant,
        forward_only=FORWARD_ONLY,
    )


@pytest.mark.slow
@pytest.mark.usefixtures("pipelined_forward")
def test_pipelined_forward_varlen():
    pipelined_or_skip(probe(torch.bfloat16, 64), probe(torch.bfloat16, 64))
    cu_q = torch.tensor([0, 0, 37, 240], dtype=torch.int32)  # an empty sequence, two long ones
    cu_k = torch.tensor([0, 9, 90, 400], dtype=torch.int32)
    q = torch.randn(240, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(400, 2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    tensors = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    op = partial(fusedattn.varlen_attention, backend="triton")
    assert_op_kx(op, fusedattn.reference.varlen_attention, tensors,
                 kwargs=dict(max_seqlen_q=203, max_seqlen_k=310, window_size=(150, -1),
                             enable_gqa=True),
                 grad_of=() if FORWARD_ONLY else ("q", "k", "v"))  # fmt: skip


@pytest.mark.usefixtures("pipelined_forward", "tma_forward")
def test_pipelined_forward_tma_half():
    """With tensor descriptors as well (Tiles 't' + 'p'; the interpreter on CPU, sm_90 on a
    GPU)."""
    pipelined_or_skip(probe(torch.bfloat16, 64), probe(torch.bfloat16, 64))
    assert fwd_tiles(probe(torch.bfloat16, 64), probe(torch.bfloat16, 64))["USE_TMA"]
    tensors, kwargs, grad_of = variant_inputs(
        AttentionShape(2, 2, 2, 150, 333, 64, 64), torch.bfloat16, VARIANTS["everything"]
    )
    assert_op_kx(triton_attention, fusedattn.reference.attention, tensors, kwargs=kwargs,
                 grad_of=grad_of)  # fmt: skip


# ---- the screen's measure of the overlap (scripts/static_attention.py) -------------------------


@pytest.fixture(scope="module")
def screen():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "static_attention.py"
    spec = importlib.util.spec_from_file_location("static_attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mufu_under_wgmma_counts_exp2_issued_while_a_wgmma_is_in_flight(screen):
    wait_all = "WARPGROUP.DEPBAR.LE gsb0, 0x0"
    qk = "HGMMA.64x64x16.F32.BF16 R88, gdesc[UR8], R88, gsb0"
    pv = "HGMMA.64x128x16.F32.BF16 R24, R120, gdesc[UR8].tnspB, R24, gsb0"
    ex2 = "MUFU.EX2 R3, R4"
    # the shipped order: Q·K^T, wait, softmax, P·V left in flight into the next Q·K^T's wait
    assert screen.mufu_under_wgmma(["WARPGROUP.ARRIVE", qk, wait_all, ex2, ex2, pv]) == 0
    # pipelined: the softmax between the next Q·K^T and its wait, P·V across the back edge
    assert screen.mufu_under_wgmma([qk, ex2, "@P0 " + ex2, wait_all, "FMUL R1, R2, R3", pv]) == 2
    assert screen.mufu_under_wgmma([ex2, wait_all, pv]) == 1  # in flight from the last lap
    # a wait that leaves one group pending keeps the wgmma in flight
    assert screen.mufu_under_wgmma([qk, "WARPGROUP.DEPBAR.LE gsb0, 0x1", ex2, wait_all]) == 1


def test_screen_takes_tiles_as_tiles_parse_does(screen):
    import argparse

    kernel, tiles = screen.parse_tiles("fwd=128x64w8s3tp")
    assert kernel == "fwd" and tiles == K.Tiles(128, 64, 8, 3, tma=True, pipeline=True)
    for bad in ("fwd=64x128w8s3m", "bwd=128x64w8s3", "dq=128x64"):
        with pytest.raises(argparse.ArgumentTypeError):
            screen.parse_tiles(bad)
