"""torch's module interfaces shared by fusedattn's modules and their naive twins.

- `FusedModule`: what every module of fusedattn (fused, or naive in fusedattn.reference) does
  to sit where a torch module sat. torch's `nn.TransformerEncoderLayer` has an inference fast
  path that reads the layer's weights and calls torch's own fused kernel, bypassing the
  attention *and* the norm modules; it is skipped when any submodule has a forward hook, so
  each module attaches one no-op pre-hook: inside torch's layers fusedattn's kernels run in
  train and in eval, whichever modules were swapped. TorchScript cannot compile fusedattn's
  ops (keyword-only arguments, torch.library custom ops); `torch.jit.script` then fails deep
  inside the compiler, so `__prepare_scriptable__`, which `torch.jit.script` calls on every
  module first, says so plainly instead.
- `MultiheadAttentionInterface`: nn.MultiheadAttention's constructor, defaults, parameter
  names, initialisation, state_dict, input rules and mask conventions, with the attention
  step itself (`_attend`) left to the subclass.

Below fusedattn.reference and fusedattn.modules: it imports only torch and fusedattn.masks.
"""

from __future__ import annotations

import numbers
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear

from .checks import check_bool, check_tensor, normalize_shape
from .masks import causal_mask


def _keep_torch_fast_path_off(module, args):
    """No-op forward pre-hook; its presence disables torch's encoder-layer fast path."""
    return None


class FusedModule(nn.Module):
    """Mixin of fusedattn's modules, fused and naive: the fast-path hook and a clear
    TorchScript refusal."""

    def _register_fused_hooks(self) -> None:
        self.register_forward_pre_hook(_keep_torch_fast_path_off)

    def __prepare_scriptable__(self):
        raise TypeError(
            f"fusedattn.{type(self).__name__} is not scriptable with torch.jit.script (its ops "
            "are torch.library custom ops called with keyword-only arguments); use "
            "torch.compile instead (TorchScript, jit.trace included, is deprecated in torch 2.14)"
        )


def softmax_dim(module_dim, input: torch.Tensor) -> int:
    """nn.Softmax's dim: the module's, or its legacy implicit choice, with torch's warning."""
    if module_dim is not None:
        return module_dim
    warnings.warn(
        "Implicit dimension choice for softmax has been deprecated. "
        "Change the call to include dim=X as an argument.",
        stacklevel=3,
    )
    return 0 if input.dim() in (0, 1, 3) else 1


def norm_shape(normalized_shape):
    """A norm module's normalized_shape, checked as torch's modules use it (an int or a
    sequence of ints), so a float or a string is named at construction rather than failing
    inside torch.empty."""
    normalize_shape(normalized_shape)
    return normalized_shape


def canonical_attn_mask(attn_mask, batch, num_heads, tq, tk, dtype):
    """nn.MultiheadAttention's attn_mask -> fusedattn's.

    torch: bool True = NOT allowed, float added; (Tq, Tk) or (B*H, Tq, Tk). fusedattn: bool
    True = may attend, broadcastable to (B, H, Tq, Tk).
    """
    if attn_mask is not None:
        check_tensor("attn_mask", attn_mask)
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
        check_tensor("key_padding_mask", key_padding_mask)
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


class MultiheadAttentionInterface(FusedModule):
    """nn.MultiheadAttention's interface with the attention step left to `_attend`: the fused
    module (fusedattn.MultiheadAttention) and its naive twin
    (fusedattn.reference.modules.MultiheadAttention) are the two subclasses. `backend`
    (keyword-only) is the backend of fusedattn's ops that the subclass calls."""

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
        for name, value in (("embed_dim", embed_dim), ("num_heads", num_heads), ("kdim", kdim),
                            ("vdim", vdim)):  # fmt: skip
            if value is None and name in ("kdim", "vdim"):
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value <= 0:
                raise ValueError(f"{name} must be greater than 0, got {value}")
        if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real):
            raise TypeError(f"dropout must be a float, got {dropout!r}")
        if not 0.0 <= dropout <= 1.0:
            raise ValueError(f"dropout must be in [0, 1], got {dropout}")
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
    def from_torch(cls, mha: nn.MultiheadAttention, *, backend="auto"):
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
        check_bool("is_causal", is_causal)
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

    @staticmethod
    def _attend(self, q, k, v, attn_mask, key_padding_mask, is_causal, need_weights, average):
        """(B, H, T, head_dim) heads -> (attention output heads, weights or None)."""
        raise NotImplementedError

    @staticmethod
    def _append_key(attn_mask, key_padding_mask):
        """Extend the masks by one visible key (the bias_k / zero-attention slot)."""
        if attn_mask is not None:
            value = True if attn_mask.dtype == torch.bool else 0.0
            attn_mask = F.pad(attn_mask, (0, 1), value=value)
        if key_padding_mask is not None:
            key_padding_mask = F.pad(key_padding_mask, (0, 1), value=False)
        return attn_mask, key_padding_mask
