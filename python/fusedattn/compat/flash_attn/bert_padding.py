"""flash-attention's padding helpers (`flash_attn.bert_padding`) in plain torch: a padded
(batch, seqlen, ...) batch to the packed (total, ...) rows the varlen functions take, and
back. Indexing through autograd (the gradient of a gather is a scatter of zeros and the
gradient rows). `unpad_input` returns flash-attention 2.6's five values, as transformers'
flash-attention path expects.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "index_first_axis",
    "index_put_first_axis",
    "pad_input",
    "unpad_input",
    "unpad_input_for_concatenated_sequences",
]


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """input[indices] along the first axis (input at least 2-D)."""
    if input.dim() < 2:
        raise ValueError(f"index_first_axis needs a tensor of 2 dims or more, got {input.dim()}")
    return input[indices]


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int):
    """A (first_axis_dim, ...) zero tensor with `values` at rows `indices`."""
    out = values.new_zeros(first_axis_dim, *values.shape[1:])
    return out.index_put((indices,), values)


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """hidden_states (batch, seqlen, ...), attention_mask (batch, seqlen) bool/int (1 = a token)
    -> (the tokens (total, ...), their indices in the flattened batch (total,), cu_seqlens
    (batch + 1,) int32, max_seqlen_in_batch int, used_seqlens_in_batch (batch,) int32).
    unused_mask (batch, seqlen): tokens allocated but not used, kept in the packing and
    counted in cu_seqlens, not in used_seqlens_in_batch. max_seqlen_in_batch is read to the
    host (a sync), as flash-attention does."""
    every = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens = every.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(every.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max()) if seqlens.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen, used


def unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length):
    """Several sequences concatenated in each row: attention_mask_in_length (batch, seqlen)
    holds each row's sequence lengths in order, then zeros. Returns (tokens, indices,
    cu_seqlens over every sequence, max_seqlen_in_batch)."""
    length = attention_mask_in_length.sum(dim=-1)
    seqlen = attention_mask_in_length.shape[-1]
    positions = torch.arange(seqlen, device=length.device, dtype=length.dtype)
    keep = positions.expand(len(length), seqlen) < length[:, None]
    lengths = attention_mask_in_length.flatten()
    lengths = lengths[lengths != 0].to(torch.int32)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    max_seqlen = int(lengths.max()) if lengths.numel() else 0
    cu_seqlens = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return index_first_axis(flat, indices), indices, cu_seqlens, max_seqlen


def pad_input(hidden_states, indices, batch, seqlen):
    """Packed (total, ...) rows back to (batch, seqlen, ...), zeros where nothing was."""
    out = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
