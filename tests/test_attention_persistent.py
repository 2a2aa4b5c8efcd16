"""The Triton forward on persistent programs (Tiles.persistent, 'r': about one program per
multiprocessor, each looping over query blocks; under causal every head's longest block first):
the same per-block arithmetic as the plain grid, so the same bits in the interpreter (4
programs there: each takes several blocks, and more programs than blocks leave some idle);
against the float64 reference under the k× rule over the variant grid, varlen and fp8. Off by
default until a GPU times it (scripts/tune_triton_attention.py, `r` candidates)."""

import dataclasses
from functools import partial

import pytest
import torch
from hard_shapes import AttentionShape, make_qkv
from kx_check import assert_op_kx
from test_attention_variants import SHAPES, VARIANTS, check
from tiles_patch import patch_attention_config

import fusedattn
from fusedattn.ops.attention.triton_args import TritonAttentionLaunch

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("kernel_device")]
K = pytest.importorskip("fusedattn.triton_kernels.attention")
triton_attention = partial(fusedattn.attention, backend="triton")

GPU = torch.cuda.is_available()
# As the pipelined loop's grids (test_attention_pipeline.py): the flag changes the forward
# alone, the backward kernels read its out and lse (bit for bit the plain grid's, below).
FORWARD_ONLY = not GPU


def with_persistence(monkeypatch, on: bool):
    """Every Triton forward from here on runs on persistent programs (on=True) or the plain
    grid, in plans of its own (tiles_patch)."""

    def config(cfg, *args, **kw):
        return dataclasses.replace(cfg, fwd=dataclasses.replace(cfg.fwd, persistent=on))

    patch_attention_config(monkeypatch, config)


@pytest.fixture
def persistent_forward(monkeypatch):
    with_persistence(monkeypatch, True)


def launch(q, config):
    return TritonAttentionLaunch(
        q, q, q, None, None, None, None, None, None, 0, 0, window_left=-1, window_right=0,
        bottom_right=False, scale=1.0, softcap=0.0, dropout_p=0.0, seed=None, config=config,
    )  # fmt: skip


def test_the_grid_is_a_program_per_multiprocessor_only_when_the_tiles_ask():
    s = AttentionShape(3, 4, 4, 200, 200, 16, 16)
    q, _, _ = make_qkv(s, torch.float32, torch.get_default_device())
    base = K.attention_config(16, 16, q.is_cuda)
    blocks = s.B * s.Hq * -(-s.Tq // base.fwd.block_m)
    budget = torch.cuda.get_device_properties(q.device).multi_processor_count if GPU else 4
    for on in (False, True):
        cfg = dataclasses.replace(base, fwd=dataclasses.replace(base.fwd, persistent=on))
        grid, args, constexprs = launch(q, cfg).fwd_args(
            q, q, q, torch.empty_like(q), torch.empty(q.shape[:3])
        )
        assert constexprs.get("PERSISTENT", False) is on
        assert grid == ((min(blocks, budget),) if on else (blocks,))
        assert blocks in [a for a in args if type(a) is int]  # num_tiles: the loops' bound
    assert K.Tiles.parse("128x64w8s3pr", "fwd").persistent
    assert K.Tiles.parse("128x64w8s3r").spec == "128x64w8s3r"
    for spec, kernel in (("64x128w8s3r", "dkdv"), ("64x64w4s2r", "dq")):
        with pytest.raises(ValueError):
            K.Tiles.parse(spec, kernel)


def assert_same(plain, resident):
    """(out, lse) of both grids: the same bits in the interpreter, the dtype's tolerance
    compiled (another program may order a block's instructions differently)."""
    for a, b in zip(plain, resident, strict=True):
        if a.is_cuda:
            torch.testing.assert_close(b, a)
        else:
            assert torch.equal(a, b)


def forward(monkeypatch, persistent: bool, q, k, v, **kw):
    with monkeypatch.context() as m:
        with_persistence(m, persistent)
        torch.manual_seed(11)  # dropout's seed
        return triton_attention(q, k, v, return_lse=True, **kw)


CASES = {
    "plain": {},
    "causal": dict(is_causal=True),
    "bottom_right_window": dict(window_size=(40, 0), causal_alignment="bottom_right"),
    "dropout_key_padding": dict(dropout_p=0.3, key_padding_mask=True),
}


# in the interpreter (4 programs) every Tq is above the program count: 130 on a GPU only
@pytest.mark.parametrize("Tq", [1, 45, 130] if GPU else [1, 45])
@pytest.mark.parametrize("case", CASES)
def test_persistent_programs_equal_the_plain_grid(monkeypatch, case, Tq):
    """B·H·query blocks below, at and above the program count: each block's rows come out of
    the same arithmetic in another program, so the interpreter gives the same bits (compiled,
    the dtype's tolerance); dropout's per-element keep follows the block, not the program."""
    dtype, D = (torch.bfloat16, 64) if GPU else (torch.float32, 16)
    s = AttentionShape(2, 4, 2, Tq, 77, D, D)
    q, k, v = make_qkv(s, dtype, torch.get_default_device())
    kw = dict(CASES[case], enable_gqa=True)
    if kw.pop("key_padding_mask", False):
        kw["key_padding_mask"] = torch.arange(s.Tk) >= torch.tensor([s.Tk - 9, s.Tk])[:, None]
    plain = forward(monkeypatch, False, q, k, v, **kw)
    resident = forward(monkeypatch, True, q, k, v, **kw)
    assert_same(plain, resident)


@pytest.mark.slow
@pytest.mark.usefixtures("persistent_forward")
# one shape in the interpreter (its bits equal the plain loop's: the equality tests), both on
# a GPU (as test_attention_bwd_pipeline's grid; issue #70's test-time cut)
@pytest.mark.parametrize("shape", SHAPES[:2] if GPU else SHAPES[:1], ids=str)
@pytest.mark.parametrize("name", VARIANTS)
def test_persistent_forward_variants_fp32(name, shape):
    check("triton", shape, torch.float32, VARIANTS[name], forward_only=FORWARD_ONLY)


@pytest.mark.usefixtures("persistent_forward")
@pytest.mark.parametrize("name", ["causal", "everything"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_persistent_forward_variants_half(name, dtype):
    variant = (VARIANTS | {"causal": dict(is_causal=True)})[name]
    shape = AttentionShape(2, 2, 2, 150, 333, 64, 64)
    check("triton", shape, dtype, variant, forward_only=FORWARD_ONLY)


@pytest.mark.usefixtures("persistent_forward")
def test_persistent_forward_varlen():
    """Packed sequences: blocks past a sequence's end (num_tiles counts max_seqlen_q's
    blocks for every sequence) write nothing, an empty sequence included."""
    cu_q = torch.tensor([0, 0, 37, 240], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 90, 400], dtype=torch.int32)
    q = torch.randn(240, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(400, 2, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    tensors = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    op = partial(fusedattn.varlen_attention, backend="triton")
    assert_op_kx(op, fusedattn.reference.varlen_attention, tensors,
                 kwargs=dict(max_seqlen_q=203, max_seqlen_k=310, is_causal=True,
                             causal_alignment="bottom_right", enable_gqa=True),
                 grad_of=() if FORWARD_ONLY else ("q", "k", "v"))  # fmt: skip


@pytest.mark.usefixtures("persistent_forward")
def test_persistent_fp8_forward_equals_the_plain_grid(monkeypatch):
    """The fp8 forward (inference) on persistent programs: the plain grid's result."""
    from test_fp8 import fp8_inputs

    (q8, k8, v8), (qd, kd, vd) = fp8_inputs(2, 4, 2, 70, 70, 32)
    kw = dict(q_descale=qd, k_descale=kd, v_descale=vd, is_causal=True, enable_gqa=True)
    plain = forward(monkeypatch, False, q8, k8, v8, **kw)
    resident = forward(monkeypatch, True, q8, k8, v8, **kw)
    assert_same(plain, resident)


def test_a_measured_persistent_forward_is_not_taken_by_varlen_or_alibi(monkeypatch):
    """A tuning run's persistent winner (attention_tiles.TABLE) serves dense calls; varlen's
    persistent forward spilled 8 B at D=128 on the sm_90 screen, ALiBi's was not screened
    alone: they keep the plain grid."""
    from fusedattn.triton_kernels import attention_tiles

    monkeypatch.setattr(attention_tiles, "TABLE", {90: {128: {"fwd": "128x64w8s3r"}}})
    K.attention_config.cache_clear()
    try:
        assert K.attention_config(128, 128, True, arch=90).fwd.persistent
        assert not K.attention_config(128, 128, True, arch=90, alibi_or_varlen=True).fwd.persistent
    finally:
        K.attention_config.cache_clear()
