"""The Triton forward through tensor descriptors (Tiles.tma: Hopper's TMA copies) against the
float64 reference under the k× rule, forward and backward, in the interpreter on CPU and
compiled on a GPU: the descriptor copies zero-fill past the sequence and head-dim ends and clip
the output store there, so the kernel drops its bounds masks; key padding still zeroes padded
values. Layouts the TMA unit cannot describe, and fp32, fall back to pointer loads."""

import dataclasses
from functools import partial

import pytest
import torch
from hard_shapes import AttentionShape, make_qkv
from kx_check import assert_op_kx
from test_attention_variants import VARIANTS, variant_inputs
from tiles_patch import patch_attention_config

import fusedattn
from fusedattn import reference
from fusedattn.ops.attention.triton_args import TritonAttentionLaunch, tma_compatible

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("kernel_device")]
K = pytest.importorskip("fusedattn.triton_kernels.attention")
triton_attention = partial(fusedattn.attention, backend="triton")
ALL = ("q", "k", "v")


@pytest.fixture
def tma_forward(monkeypatch):
    """Every Triton forward of the test asks for tensor descriptors (TMA: sm_90 and later on a
    GPU; the interpreter on CPU)."""
    device = torch.get_default_device()
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (9, 0):
        pytest.skip("tensor descriptors need sm_90 or later")

    def with_tma(cfg, *args, **kwargs):
        return dataclasses.replace(cfg, fwd=dataclasses.replace(cfg.fwd, tma=True))

    patch_attention_config(monkeypatch, with_tma)


def launch_flags(q, k, v, **kw):
    """The forward's USE_TMA and its first argument for these inputs, as a call would get."""
    cfg = K.attention_config(q.shape[-1], v.shape[-1], q.is_cuda)
    sizes = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0) | kw
    L = TritonAttentionLaunch(
        q, k, v, None, None, None, None, **sizes, window_left=-1, window_right=-1,
        bottom_right=False, scale=1.0, softcap=0.0, dropout_p=0.0, seed=None,
        config=dataclasses.replace(cfg, fwd=dataclasses.replace(cfg.fwd, tma=True)),
    )  # fmt: skip
    out = torch.empty_like(q)
    lse = torch.empty(L.lse_shape)
    _, args, constexprs = L.fwd_args(q, k, v, out, lse)
    return constexprs["USE_TMA"], args[0]


def test_descriptors_are_built_only_for_layouts_the_tma_unit_takes():
    s = AttentionShape(2, 4, 2, 33, 40, 64, 64)
    q, k, v = make_qkv(s, torch.bfloat16, torch.get_default_device())
    use, first = launch_flags(q, k, v)
    assert use and type(first).__name__ == "TensorDescriptor"
    # 20 bf16 elements per row: 40-byte strides, not a multiple of 16
    q, k, v = make_qkv(AttentionShape(1, 2, 2, 9, 9, 20, 20), torch.bfloat16, q.device)
    assert not tma_compatible(q) and launch_flags(q, k, v) == (False, q)
    # a view whose rows are not 16-byte aligned
    base = torch.randn(1, 2, 9, 65, dtype=torch.bfloat16)
    assert not tma_compatible(base[..., 1:])
    # fp32: descriptors are for 2-byte dtypes (fp32 tiles spilled through them)
    q, k, v = make_qkv(s, torch.float32, q.device)
    assert tma_compatible(q) and launch_flags(q, k, v) == (False, q)


@pytest.mark.usefixtures("tma_forward")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "shape",
    [AttentionShape(2, 4, 2, 63, 129, 16, 16), AttentionShape(1, 2, 2, 100, 37, 40, 40),
     AttentionShape(2, 2, 1, 33, 33, 64, 32)],
    ids=str,
)  # fmt: skip
def test_tma_forward_hard_shapes(shape, causal):
    q, k, v = make_qkv(shape, torch.bfloat16, torch.get_default_device())
    assert launch_flags(q, k, v)[0]  # the path under test is the descriptor one
    assert_op_kx(triton_attention, reference.attention, dict(q=q, k=k, v=v),
                 kwargs=dict(is_causal=causal, enable_gqa=shape.Hq != shape.Hkv),
                 grad_of=ALL)  # fmt: skip


@pytest.mark.slow
@pytest.mark.usefixtures("tma_forward")
@pytest.mark.parametrize(
    "name", ["window", "bottom_right_causal", "softcap", "sinks", "everything"]
)
def test_tma_forward_variants(name):
    s = AttentionShape(2, 4, 2, 63, 129, 16, 16)
    tensors, kwargs, grad_of = variant_inputs(s, torch.bfloat16, VARIANTS[name])
    assert_op_kx(triton_attention, reference.attention, tensors, kwargs=kwargs, grad_of=grad_of)


@pytest.mark.usefixtures("tma_forward")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_tma_forward_half_precision(dtype):
    s = AttentionShape(2, 2, 2, 70, 90, 32, 32)
    q, k, v = make_qkv(s, dtype, torch.get_default_device())
    assert launch_flags(q, k, v)[0]
    assert_op_kx(triton_attention, reference.attention, dict(q=q, k=k, v=v),
                 kwargs=dict(is_causal=True), grad_of=ALL)  # fmt: skip


@pytest.mark.usefixtures("tma_forward")
def test_tma_forward_padded_keys_never_contribute_even_nan_values():
    s = AttentionShape(2, 2, 2, 20, 50, 16, 16)
    q, k, v = make_qkv(s, torch.bfloat16, torch.get_default_device())
    kpm = torch.zeros(2, 50, dtype=torch.bool)
    kpm[0, 30:] = True
    kpm[1, :7] = True
    v = v.clone()
    v[0, :, 30:] = float("nan")
    v[1, :, :7] = float("nan")
    out = triton_attention(q, k, v, key_padding_mask=kpm)
    want = reference.attention(q.double(), k.double(), v.nan_to_num(0.0).double(),
                               key_padding_mask=kpm)  # fmt: skip
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)  # bf16 outputs


@pytest.mark.usefixtures("tma_forward")
def test_tma_forward_leaves_varlen_on_pointers():
    cu = torch.tensor([0, 5, 17], dtype=torch.int32)
    q, k, v = (torch.randn(17, 2, 16, dtype=torch.bfloat16) for _ in range(3))
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=12, max_seqlen_k=12)
    assert launch_flags(q, k, v, **kw) == (False, q)
    out = fusedattn.varlen_attention(q, k, v, cu, cu, 12, 12, backend="triton")
    want = reference.varlen_attention(q.double(), k.double(), v.double(), cu, cu, 12, 12)
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)  # bf16 outputs
