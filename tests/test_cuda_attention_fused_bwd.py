"""The CUDA attention's fused backward (one pass per key block, per-split fp32 dQ partials;
FUSEDATTN_CUDA_BACKWARD=fused) against float64 under the k× rule, on shapes sized so that it
really runs on the GPU at hand (its plan is checked first: 0 accumulators would mean the
two-kernel backward ran), with 1, 2 and 4 splits, causal with Tq < Tk and Tq > Tk, key padding
(whole batches of it), GQA, head dims that pad, and bitwise determinism. The choice of
backward itself is checked everywhere."""

import pytest
import torch
from hard_shapes import AttentionShape, make_qkv
from kx_check import assert_op_kx

import fusedattn
from fusedattn import masks, reference
from fusedattn.ops.attention import cuda_args as flash_attention
from fusedattn.ops.core.kernels import extension

gpu = pytest.mark.gpu
ALL = ("q", "k", "v")
FUSED = flash_attention.CUDA_BACKWARD_KERNELS["fused"]


def cuda_attention(*args, **kwargs):
    return fusedattn.attention(*args, backend="cuda", **kwargs)


def dq_splits(q, k, v, *, backward_kernel=FUSED, is_causal=False, key_padding_mask=None,
              attn_mask=None, dropout_p=0.0):  # fmt: skip
    """The fp32 dQ accumulators the CUDA backward of these inputs takes (0: two kernels)."""
    out = torch.empty(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    kpm = None if key_padding_mask is None else key_padding_mask.contiguous()
    seed = torch.zeros(1, dtype=torch.int64, device=q.device) if dropout_p else None
    return extension().attention_bwd_dq_splits(
        q.contiguous(), k.contiguous(), v.contiguous(), out, lse, attn_mask, kpm, is_causal,
        q.shape[-1] ** -0.5, dropout_p, seed, backward_kernel,
    )  # fmt: skip


def kv_blocks_for(splits: int) -> int:
    """Batch x kv heads that the split chooser (tiling.h) fills with `splits` splits when one
    block is resident per SM (8 warps at up to 255 registers)."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    return -(-sms // splits)


# ---- everywhere: the choice of backward ------------------------------------------------------


@pytest.mark.parametrize("value, kernel", [("", 0), ("auto", 0), ("split", 1), (" fused ", 2)])
def test_backward_kernel_from_the_environment(monkeypatch, value, kernel):
    monkeypatch.setenv(flash_attention.CUDA_BACKWARD_ENV, value)
    assert flash_attention.cuda_backward_kernel() == kernel


def test_unknown_backward_kernel_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(flash_attention.CUDA_BACKWARD_ENV, "fast")
    with pytest.raises(ValueError, match="FUSEDATTN_CUDA_BACKWARD='fast': expected one of auto"):
        flash_attention.cuda_backward_kernel()


# ---- GPU ----------------------------------------------------------------------------------------

# (splits wanted, B, Hq per kv head, Tq, Tk, D, Dv, causal, key padding lengths or None)
CASES = [
    (1, 2, 1, 389, 517, 128, 128, False, None),
    (2, 2, 2, 389, 517, 128, 128, True, None),  # causal, Tq < Tk: key blocks no query sees
    (4, 1, 1, 517, 389, 128, 128, True, None),  # causal, Tq > Tk
    (4, 3, 1, 300, 700, 64, 64, False, "lengths"),  # key padding, a batch padded throughout
    (2, 2, 1, 257, 513, 40, 40, True, "lengths"),  # head dim 40 pads to 64
    (4, 1, 2, 129, 640, 120, 120, False, None),  # head dim 120 pads to 128
    (2, 1, 1, 200, 450, 48, 128, True, None),  # D != Dv: the 128 instantiation
]


def case_id(c):
    splits, B, group, Tq, Tk, D, Dv, causal, kpm = c
    return f"s{splits}-B{B}-g{group}-Tq{Tq}-Tk{Tk}-D{D}-Dv{Dv}-{'causal' if causal else 'full'}" + (
        f"-{kpm}" if kpm else ""
    )


def case_inputs(c, dtype=torch.bfloat16):
    splits, B, group, Tq, Tk, D, Dv, causal, kpm = c
    Hkv = -(-kv_blocks_for(splits) // B)
    s = AttentionShape(B, Hkv * group, Hkv, Tq, Tk, D, Dv)
    q, k, v = make_qkv(s, dtype, "cuda", layout="transposed")
    kw = dict(is_causal=causal, enable_gqa=group > 1)
    if kpm:
        lengths = torch.tensor([Tk - 17 * (b + 1) for b in range(B)])
        lengths[-1] = 0 if B > 2 else lengths[-1]  # a batch whose every key is padding
        kw["key_padding_mask"] = masks.padding_mask_from_lengths(lengths, Tk).cuda()
    return q, k, v, kw


@gpu
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fused_backward_kx(monkeypatch, case):
    monkeypatch.setenv(flash_attention.CUDA_BACKWARD_ENV, "fused")
    q, k, v, kw = case_inputs(case)
    planned = dq_splits(q, k, v, is_causal=kw["is_causal"],
                        key_padding_mask=kw.get("key_padding_mask"))  # fmt: skip
    assert planned == case[0], f"planned {planned} splits (0 = the two-kernel backward)"
    assert_op_kx(cuda_attention, reference.attention, dict(q=q, k=k, v=v), kwargs=kw,
                 grad_of=ALL)  # fmt: skip


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fused_backward_is_deterministic_and_near_the_two_kernel_one(monkeypatch, dtype):
    q, k, v, kw = case_inputs(CASES[1], dtype)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    grad = torch.randn(*q.shape[:3], v.shape[-1], dtype=dtype, device="cuda")
    runs = {}
    for kernel in ("fused", "fused", "split"):
        monkeypatch.setenv(flash_attention.CUDA_BACKWARD_ENV, kernel)
        out = cuda_attention(*leaves, **kw)
        runs.setdefault(kernel, []).append(torch.autograd.grad(out, leaves, grad))
    for a, b in zip(*runs["fused"], strict=True):
        assert torch.equal(a, b), "two fused backwards differ"
    for a, b in zip(runs["fused"][0], runs["split"][0], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@gpu
def test_fused_backward_dead_rows_and_batches_give_zero_gradients(monkeypatch):
    monkeypatch.setenv(flash_attention.CUDA_BACKWARD_ENV, "fused")
    q, k, v, kw = case_inputs(CASES[3])
    kpm = kw["key_padding_mask"]
    assert kpm[-1].all(), "the last batch is padding throughout"
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = cuda_attention(*leaves, **kw)
    dq, dk, dv = torch.autograd.grad(out, leaves, torch.randn_like(out))
    for t in (out, dq, dk, dv):
        assert not t.isnan().any()
    assert (dq[-1] == 0).all() and (dk[-1] == 0).all() and (dv[-1] == 0).all()
    hidden = kpm[0].nonzero().flatten()  # padded keys of batch 0 get no gradient
    assert (dk[0][:, hidden] == 0).all() and (dv[0][:, hidden] == 0).all()


@gpu
def test_auto_takes_the_fused_backward_where_it_won_and_never_for_what_it_lacks():
    """auto runs the fused backward where it was faster on the H100 (attention_launch.cuh:
    fused_backward_by_default): not causal, or causal with key padding at head dim <= 64; the
    two kernels for the rest. Fused never takes an attn_mask, dropout, head dim 256, or a call
    too small to fill the GPU."""
    auto = flash_attention.CUDA_BACKWARD_KERNELS["auto"]
    q, k, v, _ = case_inputs(CASES[0])
    assert dq_splits(q, k, v) == 1
    assert dq_splits(q, k, v, backward_kernel=auto) == 1  # not causal
    assert dq_splits(q, k, v, backward_kernel=auto, is_causal=True) == 0
    assert dq_splits(q, k, v, backward_kernel=flash_attention.CUDA_BACKWARD_KERNELS["split"]) == 0
    q, k, v, kw = case_inputs(CASES[4])  # causal, key padding, head dim 40 (pads to 64)
    assert dq_splits(q, k, v, backward_kernel=auto, is_causal=True) == 0
    assert dq_splits(q, k, v, backward_kernel=auto, is_causal=True,
                     key_padding_mask=kw["key_padding_mask"]) == 2  # fmt: skip
    q, k, v, kw = case_inputs(CASES[1])  # head dim 128, causal: with key padding too
    kpm = torch.zeros(q.shape[0], k.shape[2], dtype=torch.bool, device="cuda")
    kpm[:, -5:] = True
    assert dq_splits(q, k, v, backward_kernel=auto, is_causal=True, key_padding_mask=kpm) == 0
    q, k, v, _ = case_inputs(CASES[0])
    keep = torch.ones(1, 1, 1, 1, dtype=torch.bool, device="cuda")
    assert dq_splits(q, k, v, attn_mask=keep.expand(*q.shape[:3], k.shape[2])) == 0
    assert dq_splits(q, k, v, dropout_p=0.1) == 0
    wide = torch.randn(*q.shape[:3], 256, dtype=q.dtype, device="cuda")
    assert dq_splits(wide, k.new_zeros(*k.shape[:3], 256), v) == 0
    small = AttentionShape(1, 2, 2, 300, 300, 64, 64)
    assert dq_splits(*make_qkv(small, torch.bfloat16, "cuda")) == 0
