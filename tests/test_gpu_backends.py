"""On a GPU: the reference and torch backends at realistic sizes in bf16/fp16 under the k×
rule, fully masked rows through each SDPA backend, and auto's choice on CUDA. Skipped
cleanly without CUDA (conftest marker)."""

from functools import partial

import pytest
import torch
from hard_shapes import AttentionShape, make_qkv
from kx_check import assert_op_kx, attention_inputs

import fusedattn
from fusedattn import masks, reference
from fusedattn.ops.core import backends
from fusedattn.testing import assert_close_kx

pytestmark = pytest.mark.gpu
HALF = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "shape",
    [AttentionShape(2, 8, 8, 1000, 1000, 128, 128), AttentionShape(1, 8, 2, 129, 1031, 80, 80)],
    ids=str,
)
def test_torch_backend_attention_on_cuda(shape, causal, dtype):
    q, k, v = make_qkv(shape, dtype, "cuda", layout="transposed")
    lengths = torch.tensor([shape.Tk, shape.Tk // 3], device="cuda")[: shape.B]
    assert_op_kx(
        partial(fusedattn.attention, backend="torch"),
        reference.attention,
        dict(q=q, k=k, v=v),
        kwargs=dict(
            is_causal=causal,
            enable_gqa=True,
            key_padding_mask=masks.padding_mask_from_lengths(lengths, shape.Tk),
        ),
        grad_of=("q", "k", "v"),
    )


@pytest.mark.parametrize("sdpa", ["EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"])
def test_fully_masked_rows_are_zero_through_each_sdpa_backend(sdpa):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    s = AttentionShape(2, 4, 4, 64, 64, 64, 64)
    q, k, v = make_qkv(s, torch.bfloat16, "cuda", requires_grad=True)
    kpm = torch.zeros(2, 64, dtype=torch.bool, device="cuda")
    kpm[1] = True
    try:
        with sdpa_kernel(getattr(SDPBackend, sdpa)):
            out = fusedattn.attention(q, k, v, key_padding_mask=kpm, backend="torch")
            out.float().sum().backward()
    except RuntimeError as exc:
        pytest.skip(f"SDPA {sdpa} does not take this case here: {exc}")
    assert (out[1] == 0).all() and not out.isnan().any()
    assert (q.grad[1] == 0).all() and not q.grad.isnan().any()


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("N", [1000, 4097, 65536])
def test_torch_backend_layer_norm_and_softmax_on_cuda(N, dtype):
    x = torch.randn(64, N, device="cuda", dtype=dtype) * 3
    w = torch.randn(N, device="cuda", dtype=torch.float32)
    out = fusedattn.layer_norm(x, N, w, None, backend="torch")
    assert_close_kx(
        out, reference.layer_norm(x.double(), N, w.double()), reference.layer_norm(x, N, w)
    )
    keep = torch.rand(64, N, device="cuda") > 0.5
    out = fusedattn.softmax(x, mask=keep, backend="torch")
    assert_close_kx(out, reference.softmax(x.double(), mask=keep), reference.softmax(x, mask=keep))


def test_auto_on_cuda_picks_the_first_usable_backend():
    q = torch.randn(1, 2, 8, 16, device="cuda")
    inputs = attention_inputs(q, q, q)
    usable = [
        b
        for b in backends.AUTO_ORDER["cuda"]["attention"]
        if not backends.refusals("attention", b, q.device, inputs)
    ]
    assert backends.select("attention", "auto", q.device, inputs).backend == usable[0]
