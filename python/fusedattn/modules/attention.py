"""fusedattn.MultiheadAttention: nn.MultiheadAttention's interface on fusedattn.attention.

Same constructor, defaults, parameter names, initialisation, state_dict and return values as
`torch.nn.MultiheadAttention`; a torch checkpoint loads into it and back. Differences, all
documented behaviour rather than accidents:

- a query that sees no key (every key masked) gives 0 output and 0 attention weights, where
  torch's module gives NaN;
- `is_causal=True` may be given without `attn_mask` (torch requires the mask as a hint);
  with a mask, as in torch, `is_causal` asserts that the mask is causal and the kernel uses
  the causal structure;
- with `need_weights=True` the output still comes from the fused kernel; the weights are the
  softmax of the masked scores computed beside it, before dropout (torch returns them after
  dropout).

Inside torch's `nn.TransformerEncoderLayer` the module keeps torch's inference fast path off
(see `_torch_compat`): fusedattn's kernels run in train and in eval.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from ..masks import NO_WINDOW, Window, causal_mask, shift_float_mask, visible_keys
from ..ops import attention
from ..reference.attention import attention_scores
from ..reference.softmax import safe_softmax
from ._torch_compat import FusedModule


def canonical_attn_mask(attn_mask, batch, num_heads, tq, tk, dtype):
    """nn.MultiheadAttention's attn_mask -> fusedattn's.

    torch: bool True = NOT allowed, float added; (Tq, Tk) or (B*H, Tq, Tk). fusedattn: bool
    True = may attend, broadcastable to (B, H, Tq, Tk).
    """
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            expected = (tq, tk)
        elif attn_mask.dim() == 3:
            expected = (batch * num_heads, tq, tk)
        else:
            raise ValueError(f"attn_mask must be 2-D or 3-D, got {attn_mask.dim()}-D")
        if tuple(attn_mask.shape) != expected:
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} should be {expected} "
                "((Tq, Tk) or (batch * num_heads, Tq, Tk))"
            )
        if attn_mask.dim() == 3:
            attn_mask = attn_mask.view(batch, num_heads, tq, tk)
        attn_mask = ~attn_mask if attn_mask.dtype == torch.bool else attn_mask.to(dtype)
    return attn_mask


def canonical_padding(attn_mask, key_padding_mask, batch, tk, dtype):
    """nn.MultiheadAttention's key_padding_mask (B, Tk) -> fusedattn's (bool, True = padding).

    A float key padding mask is added to the scores, as in torch: it is folded into attn_mask
    (after any causal decision, so it is never dropped with a causal hint mask).
    """
    if key_padding_mask is not None:
        if tuple(key_padding_mask.shape) != (batch, tk):
            raise ValueError(
                f"key_padding_mask of shape {tuple(key_padding_mask.shape)} should be "
                f"(batch, Tk) = ({batch}, {tk})"
            )
        if key_padding_mask.dtype != torch.bool:
            pad = key_padding_mask.to(dtype)[:, None, None, :]
            if attn_mask is None:
                attn_mask = pad
            elif attn_mask.dtype == torch.bool:
                attn_mask = torch.where(attn_mask, pad, float("-inf"))
            else:
                attn_mask = attn_mask + pad
            key_padding_mask = None
    return attn_mask, key_padding_mask


def _check_inputs(query, key, value, embed_dim, kdim, vdim, batch_first):
    """nn.MultiheadAttention's shape rules, as clear errors before any projection."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.is_nested:
            raise ValueError(
                "fusedattn.MultiheadAttention does not take nested tensors; build "
                "nn.TransformerEncoder with enable_nested_tensor=False (swap_modules does)"
            )
    if query.dim() not in (2, 3):
        layout = "(B, T, E)" if batch_first else "(T, B, E)"
        raise ValueError(
            f"query must be 3-D {layout} or 2-D (T, E) unbatched, got {query.dim()}-D "
            f"{tuple(query.shape)}"
        )
    if key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(
            f"query, key and value must have the same number of dims, got {query.dim()}, "
            f"{key.dim()} and {value.dim()}"
        )
    for name, t, width in (("query", query, embed_dim), ("key", key, kdim), ("value", value, vdim)):
        if t.shape[-1] != width:
            raise ValueError(
                f"{name} must have {width} features in its last dim (the module's "
                f"{'embed_dim' if name == 'query' else name[0] + 'dim'}), got {tuple(t.shape)}"
            )
    batch_dim = 0 if batch_first else 1
    if query.dim() == 3 and not (
        query.shape[batch_dim] == key.shape[batch_dim] == value.shape[batch_dim]
    ):
        raise ValueError(
            f"query, key and value must have the same batch size, got shapes "
            f"{tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}"
        )
    seq_dim = 1 if query.dim() == 3 and batch_first else 0
    if key.shape[seq_dim] != value.shape[seq_dim]:
        raise ValueError(
            f"key and value must have the same length, got {tuple(key.shape)} and "
            f"{tuple(value.shape)}"
        )


class MultiheadAttention(FusedModule):
    """Drop-in `nn.MultiheadAttention` whose attention runs in `fusedattn.attention`.

    `backend` (keyword-only) picks the kernel backend, as in `fusedattn.attention`.
    """

    def __init__(
        self,
        embed_dim,
        num_heads,
        dropout=0.0,
        bias=True,
        add_bias_kv=False,
        add_zero_attn=False,
        kdim=None,
        vdim=None,
        batch_first=False,
        device=None,
        dtype=None,
        *,
        backend="auto",
    ) -> None:
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                f"embed_dim and num_heads must be greater than 0,"
                f" got embed_dim={embed_dim} and num_heads={num_heads} instead"
            )
        factory_kwargs = {"device": device, "dtype": dtype}
        super().__init__()
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        if self.head_dim * num_heads != self.embed_dim:
            raise ValueError(f"embed_dim {embed_dim} must be divisible by num_heads {num_heads}")
        self.backend = backend

        if not self._qkv_same_embed_dim:
            self.q_proj_weight = nn.Parameter(torch.empty((embed_dim, embed_dim), **factory_kwargs))
            self.k_proj_weight = nn.Parameter(torch.empty((embed_dim, self.kdim), **factory_kwargs))
            self.v_proj_weight = nn.Parameter(torch.empty((embed_dim, self.vdim), **factory_kwargs))
            self.register_parameter("in_proj_weight", None)
        else:
            self.in_proj_weight = nn.Parameter(
                torch.empty((3 * embed_dim, embed_dim), **factory_kwargs)
            )
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory_kwargs))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(
            embed_dim, embed_dim, bias=bias, **factory_kwargs
        )
        if add_bias_kv:
            self.bias_k = nn.Parameter(torch.empty((1, 1, embed_dim), **factory_kwargs))
            self.bias_v = nn.Parameter(torch.empty((1, 1, embed_dim), **factory_kwargs))
        else:
            self.bias_k = self.bias_v = None
        self.add_zero_attn = add_zero_attn
        self._reset_parameters()
        self._register_fused_hooks()

    def _reset_parameters(self) -> None:
        # nn.MultiheadAttention's initialisation, in the same order (same RNG draws).
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.bias_k is not None:
            nn.init.xavier_normal_(self.bias_k)
        if self.bias_v is not None:
            nn.init.xavier_normal_(self.bias_v)

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention, *, backend="auto") -> MultiheadAttention:
        """A fused copy of a torch (or reference) module: same config, weights, mode."""
        p = next(mha.parameters())
        new = cls(
            mha.embed_dim,
            mha.num_heads,
            dropout=mha.dropout,
            bias=mha.in_proj_bias is not None,
            add_bias_kv=mha.bias_k is not None,
            add_zero_attn=mha.add_zero_attn,
            kdim=mha.kdim,
            vdim=mha.vdim,
            batch_first=mha.batch_first,
            device=p.device,
            dtype=p.dtype,
            backend=backend,
        )
        new.load_state_dict(mha.state_dict())
        return new.train(mha.training)

    # ---- projections ---------------------------------------------------------------------

    def _project(self, query, key, value):
        """(B, T, E) inputs -> q, k, v of (B, T, E); one matmul for self-attention."""
        E = self.embed_dim
        b = self.in_proj_bias
        b_q, b_k, b_v = (None, None, None) if b is None else (b[:E], b[E : 2 * E], b[2 * E :])
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight
            if query is key and key is value:
                return F.linear(query, w, b).chunk(3, dim=-1)
            w_q, w_k, w_v = w[:E], w[E : 2 * E], w[2 * E :]
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        return F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)

    def _split_heads(self, x):
        """(B, T, E) -> (B, H, T, head_dim), a view (no copy)."""
        return x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    # ---- forward -------------------------------------------------------------------------

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=True,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
    ):
        _check_inputs(query, key, value, self.embed_dim, self.kdim, self.vdim, self.batch_first)
        batched = query.dim() == 3
        if not batched:  # (T, E): a batch of one
            query, key, value = (t.unsqueeze(0) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        B, Tq, _ = query.shape
        q, k, v = self._project(query, key, value)
        Tk = k.shape[1]
        attn_mask = canonical_attn_mask(attn_mask, B, self.num_heads, Tq, Tk, q.dtype)
        appended = self.bias_k is not None or self.add_zero_attn
        # The kernel uses the causal structure directly unless appended keys (bias_k, the zero
        # slot) break it; then, as torch does, the explicit mask is used. A given attn_mask is
        # torch's causal hint; a float key padding mask is folded in only after this choice.
        causal = is_causal and not appended
        if causal:
            attn_mask = None
        elif is_causal and attn_mask is None:
            attn_mask = causal_mask(Tq, Tk, device=q.device)
        attn_mask, key_padding_mask = canonical_padding(attn_mask, key_padding_mask, B, Tk, q.dtype)
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(B, 1, -1).to(k.dtype)], dim=1)
            v = torch.cat([v, self.bias_v.expand(B, 1, -1).to(v.dtype)], dim=1)
            attn_mask, key_padding_mask = self._append_key(attn_mask, key_padding_mask)
        q, k, v = self._split_heads(q), self._split_heads(k), self._split_heads(v)
        if self.add_zero_attn:
            zeros = k.new_zeros(B, self.num_heads, 1, self.head_dim)
            k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros], dim=2)
            attn_mask, key_padding_mask = self._append_key(attn_mask, key_padding_mask)
        out, weights = self._attend(
            q, k, v, attn_mask, key_padding_mask, causal, need_weights, average_attn_weights
        )
        out = self.out_proj(out.transpose(1, 2).flatten(2))
        if not batched:
            out = out.squeeze(0)
            weights = None if weights is None else weights.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    def _attend(self, q, k, v, attn_mask, key_padding_mask, is_causal, need_weights, average):
        """(B, H, T, head_dim) heads -> (attention output heads, weights or None)."""
        out = attention(
            q,
            k,
            v,
            attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal,
            key_padding_mask=key_padding_mask,
            backend=self.backend,
        )
        if not need_weights:
            return out, None
        mask = None
        if attn_mask is not None:  # shifted as the kernels saw it
            Tq, Tk = q.shape[2], k.shape[2]
            window = Window(-1, 0) if is_causal else NO_WINDOW
            visible = visible_keys(key_padding_mask, window, Tq, Tk, q.device)
            mask = shift_float_mask(attn_mask, visible)[0]
        scores = attention_scores(q, k, mask, is_causal, key_padding_mask=key_padding_mask)
        weights = safe_softmax(scores, dim=-1).to(out.dtype)
        return out, weights.mean(dim=1) if average else weights

    @staticmethod
    def _append_key(attn_mask, key_padding_mask):
        """Extend the masks by one visible key (the bias_k / zero-attention slot)."""
        if attn_mask is not None:
            value = True if attn_mask.dtype == torch.bool else 0.0
            attn_mask = F.pad(attn_mask, (0, 1), value=value)
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, 1), value=False)
        return attn_mask, key_padding_mask
