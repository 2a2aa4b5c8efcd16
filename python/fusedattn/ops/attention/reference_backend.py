"""The reference backend of `fusedattn.attention` and `fusedattn.varlen_attention`: the naive
O(T²) twins of fusedattn.reference, called with the public arguments that give back the
call's window."""

from __future__ import annotations

from ... import reference
from ...checks import check_descale_values
from ...masks import Window


def public_window_args(window: Window) -> dict:
    """The public keywords that give back `window`."""
    return dict(
        is_causal=False,
        window_size=(window.left, window.right),
        causal_alignment="bottom_right" if window.bottom_right else "top_left",
    )


def attention(
    q, k, v, attn_mask, dropout_p, scale, enable_gqa, key_padding_mask, window, softcap,
    alibi_slopes, sinks, return_lse, score_mod=None, **fp8,
):  # fmt: skip
    """reference.attention (fp8: the descales and out_dtype among fp8, values checked;
    score_mod: a fusedattn.score_mod.ScoreMod, its function on every score)."""
    if fp8:
        check_descale_values(**{n: fp8[n] for n in ("q_descale", "k_descale", "v_descale")})
    return reference.attention(
        q, k, v, attn_mask, dropout_p, scale=scale, enable_gqa=enable_gqa,
        key_padding_mask=key_padding_mask, softcap=softcap, alibi_slopes=alibi_slopes,
        sinks=sinks, return_lse=return_lse, score_mod=_fn(score_mod),
        **public_window_args(window), **fp8,
    )  # fmt: skip


def _fn(score_mod):
    return None if score_mod is None else score_mod.fn


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window,
                      score_mod=None, **kw):  # fmt: skip
    """reference.varlen_attention (block_table among kw: a paged cache; fp8: the descales and
    out_dtype among kw)."""
    return reference.varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        enable_gqa=q.shape[1] != k.shape[-2], score_mod=_fn(score_mod),
        **public_window_args(window), **kw,
    )  # fmt: skip
