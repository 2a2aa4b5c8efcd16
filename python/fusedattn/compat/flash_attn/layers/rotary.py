"""flash-attention's rotary embedding (`flash_attn.layers.rotary`) in plain torch.

The same functions and module, arguments and conventions: cos / sin tables (seqlen_ro,
rotary_dim / 2) applied to the first rotary_dim of the head dim; GPT-NeoX style (the two
halves) or GPT-J style (`interleaved`: even and odd dims); per-sequence position offsets
(`seqlen_offsets`, an int or (B,)) and packed sequences (`cu_seqlens`); positions past the
table leave x as it is (flash-attention's kernel loads cos 1, sin 0 there). Computed in fp32,
returned in x's dtype; autograd differentiates it (flash-attention's hand-written backward is
the same rotation conjugated). The `*_` functions write in place, as flash-attention's do.
"""

from __future__ import annotations

import torch

__all__ = [
    "RotaryEmbedding",
    "apply_rotary_emb",
    "apply_rotary_emb_func",
    "apply_rotary_emb_kv_",
    "apply_rotary_emb_qkv_",
]


def _positions(x, seqlen_offsets, cu_seqlens):
    """Each row's rotary position: (B, T) for x (B, T, H, D); (total,) for packed x."""
    if cu_seqlens is None:
        B, T = x.shape[:2]
        pos = torch.arange(T, device=x.device).expand(B, T)
        offset = seqlen_offsets
        if isinstance(offset, torch.Tensor):
            offset = offset.to(x.device).long().view(-1, 1)
        return pos + offset
    rows = torch.arange(x.shape[0], device=x.device)
    seq = torch.searchsorted(cu_seqlens[1:].long(), rows, right=True)
    pos = rows - cu_seqlens.long()[seq]
    if isinstance(seqlen_offsets, torch.Tensor):
        return pos + seqlen_offsets.to(x.device).long()[seq]
    return pos + seqlen_offsets


def _rotate(x, cos, sin, interleaved, positions, conjugate=False):
    """x with its first 2 * cos.shape[-1] dims rotated at `positions` (broadcast over heads)."""
    half = cos.shape[-1]
    dim = 2 * half
    if dim > x.shape[-1]:
        raise ValueError(f"rotary_dim {dim} is larger than the head dim {x.shape[-1]}")
    inside = positions < cos.shape[0]
    index = positions.clamp(max=cos.shape[0] - 1)
    c = torch.where(inside[..., None], cos.float()[index], 1.0)[..., None, :]  # (..., 1, half)
    s = torch.where(inside[..., None], sin.float()[index], 0.0)[..., None, :]
    if conjugate:
        s = -s
    xr = x[..., :dim].float()
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., dim:]), dim=-1)


def apply_rotary_emb(
    x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None,
    max_seqlen=None,
):  # fmt: skip
    """x (B, T, H, D), or (total, H, D) with cu_seqlens (B + 1,); cos, sin (seqlen_ro,
    rotary_dim / 2); seqlen_offsets an int or (B,): row t of sequence b sits at position
    seqlen_offsets[b] + t. Returns x rotated (x itself, written, when inplace)."""
    out = _rotate(x, cos, sin, interleaved, _positions(x, seqlen_offsets, cu_seqlens))
    return x.copy_(out) if inplace else out


apply_rotary_emb_func = apply_rotary_emb  # flash-attention's older name


def apply_rotary_emb_qkv_(
    qkv, cos, sin, cos_k=None, sin_k=None, interleaved=False, seqlen_offsets=0, num_heads_q=None,
):  # fmt: skip
    """In place on q and k of qkv (B, T, 3, H, D), or (B, T, Hq + 2 * Hk, D) with
    num_heads_q (GQA); cos_k / sin_k for k if given (XPos). Returns qkv."""
    cos_k = cos if cos_k is None else cos_k
    sin_k = sin if sin_k is None else sin_k
    if qkv.dim() == 5:
        q, k = qkv[:, :, 0], qkv[:, :, 1]
    else:
        if num_heads_q is None:
            raise ValueError("qkv of shape (B, T, Hq + 2 * Hk, D) needs num_heads_q")
        heads_k = (qkv.shape[2] - num_heads_q) // 2
        q, k = qkv[:, :, :num_heads_q], qkv[:, :, num_heads_q : num_heads_q + heads_k]
    positions = _positions(qkv, seqlen_offsets, None)
    q.copy_(_rotate(q, cos, sin, interleaved, positions))
    k.copy_(_rotate(k, cos_k, sin_k, interleaved, positions))
    return qkv


def apply_rotary_emb_kv_(kv, cos, sin, interleaved=False, seqlen_offsets=0):
    """In place on k of kv (B, T, 2, H, D). Returns kv."""
    k = kv[:, :, 0]
    k.copy_(_rotate(k, cos, sin, interleaved, _positions(kv, seqlen_offsets, None)))
    return kv


class RotaryEmbedding(torch.nn.Module):
    """Rotary position embedding (RoFormer; XPos with scale_base), as flash-attention's: a
    cos/sin table grown on demand in fp32 and kept in the inputs' dtype, applied in place to
    qkv (B, T, 3, H, D) or (B, T, Hq + 2 * Hk, D) with num_heads_q, or to q (B, T, H, D) and
    kv (B, T, 2, H, D)."""

    def __init__(self, dim: int, base=10000.0, interleaved=False, scale_base=None, device=None):
        super().__init__()
        self.dim, self.base = dim, float(base)
        self.register_buffer("inv_freq", self._inv_freq(device), persistent=False)
        self.interleaved, self.scale_base = interleaved, scale_base
        scale = self._scale(device) if scale_base is not None else None
        self.register_buffer("scale", scale, persistent=False)
        self._seq_len_cached = 0
        self._cos_cached = self._sin_cached = self._cos_k_cached = self._sin_k_cached = None

    def _inv_freq(self, device=None):
        steps = torch.arange(0, self.dim, 2, device=device, dtype=torch.float32)
        return 1.0 / (self.base ** (steps / self.dim))

    def _scale(self, device=None):
        steps = torch.arange(0, self.dim, 2, device=device, dtype=torch.float32)
        return (steps + 0.4 * self.dim) / (1.4 * self.dim)

    def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
        stale = (
            seqlen > self._seq_len_cached or self._cos_cached is None
            or self._cos_cached.device != device or self._cos_cached.dtype != dtype
            or (self.training and self._cos_cached.is_inference())
        )  # fmt: skip
        if not stale:
            return
        self._seq_len_cached = seqlen
        t = torch.arange(seqlen, device=device, dtype=torch.float32)
        inv_freq = self.inv_freq if self.inv_freq.dtype == torch.float32 else self._inv_freq(device)
        freqs = torch.outer(t, inv_freq.to(device))  # fp32: positions are large
        if self.scale is None:
            self._cos_cached, self._sin_cached = (
                torch.cos(freqs).to(dtype),
                torch.sin(freqs).to(dtype),
            )
            return
        scale = self.scale if self.scale.dtype == torch.float32 else self._scale(device)
        power = (
            torch.arange(seqlen, dtype=torch.float32, device=device) - seqlen // 2
        ) / self.scale_base
        scale = scale.to(device) ** power[:, None]
        self._cos_cached = (torch.cos(freqs) * scale).to(dtype)
        self._sin_cached = (torch.sin(freqs) * scale).to(dtype)
        self._cos_k_cached = (torch.cos(freqs) / scale).to(dtype)
        self._sin_k_cached = (torch.sin(freqs) / scale).to(dtype)

    def forward(self, qkv, kv=None, seqlen_offset=0, max_seqlen=None, num_heads_q=None):
        seqlen = qkv.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=qkv.device, dtype=qkv.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=qkv.device, dtype=qkv.dtype)
        xpos = self.scale is not None
        cos_k = self._cos_k_cached if xpos else None
        sin_k = self._sin_k_cached if xpos else None
        if kv is None:
            return apply_rotary_emb_qkv_(
                qkv, self._cos_cached, self._sin_cached, cos_k, sin_k,
                interleaved=self.interleaved, seqlen_offsets=seqlen_offset,
                num_heads_q=num_heads_q,
            )  # fmt: skip
        q = apply_rotary_emb(qkv, self._cos_cached, self._sin_cached, self.interleaved,
                             inplace=True, seqlen_offsets=seqlen_offset)  # fmt: skip
        kv = apply_rotary_emb_kv_(
            kv, self._cos_cached if not xpos else cos_k, self._sin_cached if not xpos else sin_k,
            interleaved=self.interleaved, seqlen_offsets=seqlen_offset,
        )  # fmt: skip
        return q, kv
