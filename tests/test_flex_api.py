"""torch's FlexAttention API in full (issue #84 item 2): fusedattn's BlockMask field for field,
method for method against torch's own (create_block_mask eager on the CPU), slicing, the
constructors, assignable fields; create_mask, noop_mask, create_block_mask's keywords;
flex_attention's return_aux and K/V batch broadcast; block sizes down to 16 on the kernels.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import flex_attention as flex

import fusedattn
from fusedattn.compat import flex_attention as compat
from fusedattn.masks import BlockMask, create_block_mask, create_mask, noop_mask

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _doc_causal(lengths):
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))

    def document_causal(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    return document_causal


MASKS = {  # (mask_mod, B, H, Q_LEN, KV_LEN, BLOCK_SIZE)
    "causal_16": (lambda b, h, q, kv: q >= kv, None, None, 53, 53, 16),
    "document_32": (_doc_causal([20, 31, 19]), None, None, 70, 70, 32),
    "per_head_window_64x32": (
        lambda b, h, q, kv: (q - kv).abs() <= 9 + 20 * h,
        2,
        3,
        130,
        97,
        (64, 32),
    ),
    "per_batch_prefix_16x64": (
        lambda b, h, q, kv: (kv < 5 + 30 * b) | (q >= kv),
        3,
        1,
        40,
        150,
        (16, 64),
    ),
    "empty_rows_128": (lambda b, h, q, kv: (q > 150) & (kv < q), None, 2, 300, 260, 128),
}


def _both(name, **kw):
    mask_mod, B, H, Q, KV, bs = MASKS[name]
    want = flex.create_block_mask(mask_mod, B, H, Q, KV, device="cpu", BLOCK_SIZE=bs, **kw)
    got = create_block_mask(mask_mod, B, H, Q, KV, device="cpu", BLOCK_SIZE=bs, **kw)
    return got, want


def _same_fields(got, want):
    assert isinstance(got, BlockMask) and isinstance(got, flex.BlockMask)
    for name in flex.BlockMask._TENSOR_ATTRS:
        a, b = getattr(got, name, None), getattr(want, name, None)
        if b is None or isinstance(b, bool):
            assert a is b or a == b, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name
    assert got.BLOCK_SIZE == want.BLOCK_SIZE and got.seq_lengths == want.seq_lengths


@pytest.mark.parametrize("name", MASKS)
def test_create_block_mask_gives_torchs_fields_and_methods(name):
    got, want = _both(name)
    _same_fields(got, want)
    assert torch.equal(got.to_dense(), want.to_dense())  # torch's block map
    assert got.to_string() == want.to_string()
    assert got.shape == want.shape and got.numel() == want.numel()
    assert got.sparsity() == pytest.approx(want.sparsity())
    assert all(a is b or torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
               for a, b in zip(got.as_tuple(), want.as_tuple(), strict=True))  # fmt: skip
    # what the kernels read is the mask_mod's exact pattern
    mask_mod, B, H, Q, KV, _ = MASKS[name]
    dense = create_mask(mask_mod, B or 1, H or 1, Q, KV, device="cpu")
    assert torch.equal(got.dense_mask(), dense)


def test_create_block_mask_keywords_are_torchs_and_unknown_ones_raise():
    got, want = _both("document_32", separate_full_blocks=False)
    _same_fields(got, want)
    assert got.full_kv_num_blocks is None
    got, want = _both("causal_16", compute_dq_write_order=True)
    _same_fields(got, want)
    with pytest.raises(TypeError, match="BLOCKSIZE"):
        create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 32, 32, BLOCKSIZE=16)
    with pytest.raises(ValueError, match="BLOCK_SIZE"):
        create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 32, 32, BLOCK_SIZE=8)


@pytest.mark.parametrize("index", [0, (slice(None), 1), (slice(None), slice(None), 1),
                                   (1, slice(0, 2)), (slice(None), 2, slice(1, 3))])  # fmt: skip
def test_slices_are_torchs_and_need_a_mask_mod_before_use(index):
    got, want = _both("per_head_window_64x32")
    sliced, torch_sliced = got[index], want[index]
    assert isinstance(sliced, BlockMask)
    _same_fields(sliced, torch_sliced)
    assert torch.equal(sliced.to_dense(), torch_sliced.to_dense())
    if sliced.kv_num_blocks.dim() < 3:
        return
    q = torch.randn(sliced.kv_num_blocks.shape[0], sliced.kv_num_blocks.shape[1], 130, 16)
    kv = torch.randn(q.shape[0], q.shape[1], 97, 16)
    with pytest.raises(RuntimeError, match="sliced BlockMask"):
        fusedattn.attention(q, kv, kv, block_mask=sliced, backend="reference")


def test_from_kv_blocks_adjust_and_assigned_fields_are_used_by_the_kernels():
    got, _ = _both("document_32")
    rebuilt = BlockMask.from_kv_blocks(
        got.kv_num_blocks, got.kv_indices, got.full_kv_num_blocks, got.full_kv_indices,
        BLOCK_SIZE=got.BLOCK_SIZE, mask_mod=got.mask_mod, seq_lengths=got.seq_lengths,
    )  # fmt: skip
    assert torch.equal(rebuilt.dense_mask(), got.dense_mask())
    torch_built = flex.BlockMask.from_kv_blocks(
        got.kv_num_blocks, got.kv_indices, got.full_kv_num_blocks, got.full_kv_indices,
        BLOCK_SIZE=got.BLOCK_SIZE, mask_mod=got.mask_mod, seq_lengths=got.seq_lengths,
    )  # fmt: skip
    q = torch.randn(1, 2, 70, 16, dtype=torch.float64)
    want = fusedattn.attention(q, q, q, block_mask=got, backend="reference")
    assert torch.equal(fusedattn.attention(q, q, q, block_mask=torch_built, backend="reference"),
                       want)  # fmt: skip
    # _adjust: torch's, a shorter sequence of the same blocks
    short, torch_short = (
        got._adjust(40, 40),
        flex.create_block_mask(
            MASKS["document_32"][0], None, None, 70, 70, device="cpu", BLOCK_SIZE=32
        )._adjust(40, 40),
    )
    _same_fields(short, torch_short)
    assert torch.equal(short.dense_mask(), create_mask(got.mask_mod, 1, 1, 40, 40, "cpu"))
    # an assigned field is what the next call runs (the kernels' form made again), with
    # compiled Flex's meaning: the lists say which blocks are visited, the new mask_mod
    # decides the partial ones (torch's eager flex_attention evaluates mask_mod everywhere
    # and ignores the lists: docs/block_masks.md)
    before = got.dense_mask()
    shifted = lambda b, h, q_idx, kv_idx: q_idx >= kv_idx + 3  # noqa: E731
    got.mask_mod = shifted
    assert torch.equal(got.dense_mask(), _compiled_flex_pattern(got))
    assert not torch.equal(got.dense_mask(), before)
    got.full_kv_num_blocks = got.full_kv_indices = None  # every listed block partial now
    assert torch.equal(got.dense_mask(), _compiled_flex_pattern(got))


def _compiled_flex_pattern(mask):
    """(1, 1, Q_LEN, KV_LEN) what compiled Flex computes from a mask's fields: its listed
    blocks, full ones whole, partial ones where mask_mod is True."""
    bsq, bsk = mask.BLOCK_SIZE
    Q, KV = mask.seq_lengths

    def blocks(num, idx):
        grid = torch.zeros(num.shape[-1], -(-KV // bsk), dtype=torch.bool)
        for r in range(num.shape[-1]):
            grid[r, idx[0, 0, r, : num[0, 0, r]].long()] = True
        return grid.repeat_interleave(bsq, 0).repeat_interleave(bsk, 1)[:Q, :KV]

    partial = blocks(mask.kv_num_blocks, mask.kv_indices)
    full = (blocks(mask.full_kv_num_blocks, mask.full_kv_indices)
            if mask.full_kv_num_blocks is not None else torch.zeros_like(partial))  # fmt: skip
    mod = create_mask(mask.mask_mod, 1, 1, Q, KV, "cpu")[0, 0]
    return (full | (partial & mod))[None, None]


def test_create_mask_and_noop_mask_are_torchs():
    mask_mod = MASKS["per_head_window_64x32"][0]
    assert torch.equal(create_mask(mask_mod, 2, 3, 30, 20, device="cpu"),
                       flex.create_mask(mask_mod, 2, 3, 30, 20, device="cpu"))  # fmt: skip
    assert compat.noop_mask is flex.noop_mask is noop_mask
    everything = create_block_mask(noop_mask, None, None, 48, 48, device="cpu", BLOCK_SIZE=16)
    assert bool(everything.dense_mask().all())


def test_return_aux_and_kv_batch_broadcast_are_flexs():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 2, 40, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 40, 16, generator=g, dtype=torch.float64) for _ in range(2))
    bm = create_block_mask(lambda b, h, i, j: (i >= j) | (b == 2), 4, None, 40, 40,
                           device="cpu", BLOCK_SIZE=16)  # fmt: skip
    want, want_lse = flex.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    out, aux = compat.flex_attention(q, k, v, block_mask=bm,
                                     return_aux=compat.AuxRequest(lse=True))  # fmt: skip
    assert isinstance(aux, compat.AuxOutput) and aux.max_scores is None
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(aux.lse.double(), want_lse, rtol=1e-6, atol=1e-6)
    k2, v2 = k.expand(2, -1, -1, -1) * 1.5, v.expand(2, -1, -1, -1) - 0.5
    with pytest.raises(RuntimeError, match=r"Bq and Bkv must broadcast\. Got Bq=4 and Bkv=2"):
        compat.flex_attention(q, k2, v2, block_mask=bm)
    with pytest.raises(ValueError, match="non-none block_mask"):
        compat.flex_attention(q, k, v)
    with pytest.raises(ValueError, match="Cannot specify both return_lse and return_aux"):
        compat.flex_attention(q, k, v, block_mask=bm, return_lse=True,
                              return_aux=compat.AuxRequest(lse=True))  # fmt: skip
    with pytest.raises(ValueError, match="max_scores"):
        compat.flex_attention(q, k, v, block_mask=bm,
                              return_aux=compat.AuxRequest(max_scores=True))  # fmt: skip


@pytest.mark.kernels
@pytest.mark.parametrize("block_size", [16, (16, 32), (32, 16)])
def test_the_kernels_take_blocks_of_16(block_size):
    """The kernels under the interpreter at 16-row and 16-key blocks, against float64."""
    from kx_check import assert_op_kx

    mask_mod = _doc_causal([21, 30])
    bm = create_block_mask(mask_mod, None, None, 51, 51, device="cpu", BLOCK_SIZE=block_size)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 51, 16, generator=g) for _ in range(3))
    dense = create_mask(mask_mod, 1, 1, 51, 51, device="cpu")
    assert_op_kx(
        lambda q, k, v: fusedattn.attention(q, k, v, block_mask=bm, backend="triton"),
        lambda q, k, v: fusedattn.attention(q, k, v, attn_mask=dense, backend="reference"),
        dict(q=q, k=k, v=v), grad_of=("q", "k", "v"),
    )  # fmt: skip
