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
(see `fusedattn.nn_interfaces`): fusedattn's kernels run in train and in eval.
"""

from __future__ import annotations

from ..masks import NO_WINDOW, Window, shift_float_mask, visible_keys
from ..nn_interfaces import MultiheadAttentionInterface
from ..ops import attention
from ..reference.attention import attention_scores
from ..reference.softmax import safe_softmax


class MultiheadAttention(MultiheadAttentionInterface):
    """Drop-in `nn.MultiheadAttention` whose attention runs in `fusedattn.attention`.

    `backend` (keyword-only) picks the kernel backend, as in `fusedattn.attention`.
    """

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
