"""Mask builders: causal alignment, padding from lengths, and merging."""

import torch

from fusedattn import masks


def test_causal_top_left_and_bottom_right():
    tl = masks.causal_mask(2, 4)
    assert tl.tolist() == [[True, False, False, False], [True, True, False, False]]
    br = masks.causal_mask(2, 4, bottom_right=True)
    assert br.tolist() == [[True, True, True, False], [True, True, True, True]]
    # Tq > Tk, bottom-right: the first Tq - Tk queries see nothing.
    assert masks.causal_mask(4, 2, bottom_right=True).sum(-1).tolist() == [0, 0, 1, 2]


def test_padding_from_lengths():
    kpm = masks.padding_mask_from_lengths(torch.tensor([3, 1]), 4)
    assert kpm.tolist() == [[False, False, False, True], [False, True, True, True]]
    assert masks.key_padding_to_attn_mask(kpm).shape == (2, 1, 1, 4)


def test_merge_keeps_kind_and_minimal_shape():
    assert masks.merge_masks(None, None, False, 3, 4) is None
    assert masks.merge_masks(None, None, True, 3, 4).shape == (3, 4)
    kpm = torch.tensor([[False, True, False, False]])
    merged = masks.merge_masks(None, kpm, True, 3, 4)
    assert merged.dtype == torch.bool and merged.shape == (1, 1, 3, 4)
    assert merged[0, 0].tolist() == [
        [True, False, False, False],
        [True, False, False, False],
        [True, False, True, False],
    ]
    bias = torch.randn(3, 4)
    fmerged = masks.merge_masks(bias, kpm, False, 3, 4)
    assert fmerged.dtype == bias.dtype
    assert torch.isinf(fmerged[0, 0, :, 1]).all()
    torch.testing.assert_close(fmerged[0, 0, :, 0], bias[:, 0])
