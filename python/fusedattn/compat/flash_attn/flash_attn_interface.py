"""flash-attention 2's attention functions on fusedattn's kernels (`flash_attn.flash_attn_interface`).

Signatures, argument names, defaults, layouts (sequence before heads) and return values are
flash-attention 2's: causal masks and windows are aligned bottom-right, GQA/MQA is implied by
fewer K/V heads, `return_attn_probs=True` returns (out, softmax_lse, S_dmask) with S_dmask an
empty tensor as flash-attention returns it without dropout (the dropout pattern itself, asked
with dropout_p > 0, is refused: fusedattn's kernels never materialise it), a row that sees no
key has lse +inf (flash-attention's value; fusedattn's own API says -inf), `max_seqlen_*` may
be an int or a 0-dim tensor (read to the host; under torch.compile(fullgraph=True) pass an
int: every function here then traces whole), `deterministic` is accepted (every fusedattn
backward is), and `flash_attn_with_kvcache` runs without autograd under grad mode, as
flash-attention's does.
Implemented beyond fusedattn's own API: the packed (`*_qkvpacked_func`, `*_kvpacked_func`)
forms, a paged cache in `flash_attn_varlen_func` (block_table), and in
`flash_attn_with_kvcache` rotary embedding of q and the new k (rotary_cos / rotary_sin,
rotary_interleaved) and `cache_batch_idx`. What fusedattn cannot honour raises a ValueError
naming it: cache_batch_idx together with a block_table. Rotary embedding with cache_leftpad
rotates at the cache slots (cache_seqlens[b] + i, the left padding counted), as flash-attention
does. fp32 inputs, which flash-attention refuses, are accepted.

FP8 as flash-attention 3 takes it: `q_descale`, `k_descale`, `v_descale` (keyword-only here,
float32 (B, Hkv) or one value) with q, k, v in float8_e4m3fn (the output bfloat16), or with
an fp8 KV cache in `flash_attn_with_kvcache` and a paged `flash_attn_varlen_func`.

`BACKEND` ("auto" by default, or FUSEDATTN_BACKEND) picks fusedattn's backend for every call.
"""

from __future__ import annotations

import functools
import numbers

import torch

from ...ops import attention, attention_with_kvcache, varlen_attention
from .layers.rotary import apply_rotary_emb

BACKEND = "auto"

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


# ---- flash-attention's error types -------------------------------------------------------------

_RUNTIME_TWINS: dict[type, type] = {}


def _runtime_twin(cls: type) -> type:
    """cls with RuntimeError among its bases: flash-attention raises RuntimeError for bad input
    (its TORCH_CHECKs), fusedattn ValueError/TypeError; compat's errors are both, so code that
    catches either still catches them."""
    twin = _RUNTIME_TWINS.get(cls)
    if twin is None:
        twin = type(cls.__name__, (cls, RuntimeError), {"__module__": __name__})
        _RUNTIME_TWINS[cls] = twin
    return twin


def _flash_errors(fn):
    """fn with its ValueError/TypeError raised as the same error that is also a RuntimeError
    (same message, the original as its cause)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError) as e:
            if isinstance(e, RuntimeError):
                raise
            raise _runtime_twin(type(e))(*e.args) from e

    return wrapper


class _ForwardOnly(torch.autograd.Function):
    """The output of an inference-only call made while autograd records (flash-attention runs
    its forward then too): the forward's values, and a backward that raises saying why."""

    @staticmethod
    def forward(ctx, what, out, *inputs):
        ctx.what = what
        return out.view_as(out)

    @staticmethod
    def backward(ctx, *grads):
        raise _runtime_twin(ValueError)(
            f"{ctx.what} has no backward (fusedattn, like flash-attention, reads a paged cache "
            "for inference only): compute gradients through a call without block_table"
        )


def _window_side(w) -> bool:
    """An int, or an integer tensor of one element (flash-attention's tests pass
    `torch.randint(0, seqlen_k, (2,))`, whose items are 0-dim tensors)."""
    if isinstance(w, torch.Tensor):
        return w.numel() == 1 and not w.is_floating_point() and w.dtype != torch.bool
    return isinstance(w, numbers.Integral) and not isinstance(w, bool)


def _window(window_size) -> tuple[int, int] | None:
    """flash-attention's window_size (-1 = unbounded) as fusedattn's (None = no window): a
    pair of ints, or of integer tensors, or an integer tensor of two elements, as
    flash-attention takes it (tensor sides are read to the host, as flash-attention's own
    `int(window_size[0])` does)."""
    pair = window_size
    if isinstance(pair, torch.Tensor):
        pair = tuple(pair.reshape(-1)) if pair.numel() == 2 and pair.dim() <= 1 else None
    ok = isinstance(pair, tuple | list) and len(pair) == 2 and all(map(_window_side, pair))
    if not ok:
        raise TypeError(
            "window_size must be a pair (left, right) of ints or of integer tensors (-1 = "
            f"unbounded), or an integer tensor of two elements, got {window_size!r}"
        )
    left, right = (int(w) for w in pair)
    return None if (left, right) == (-1, -1) else (left, right)


def _check_args(dropout_p, softmax_scale, causal) -> None:
    """The arguments whose names differ from fusedattn's (softmax_scale for scale, causal for
    is_causal), checked under flash-attention's names; the rest fusedattn's checks name."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float, got {dropout_p!r}")
    if softmax_scale is not None and (
        isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real)
    ):
        raise TypeError(f"softmax_scale must be a float or None, got {softmax_scale!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")


def _int(value, name: str) -> int:
    """An int, or a 0-dim integer tensor as transformers passes max_length_q/k (read to the
    host: a sync, as flash-attention's own call does)."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.is_floating_point():
            raise TypeError(f"{name} must be an int or a 0-dim integer tensor, got {value!r}")
        return int(value)
    return value


def _flash_lse(lse: torch.Tensor) -> torch.Tensor:
    """fusedattn's lse in flash-attention's convention: +inf for a row that sees no key."""
    return lse.masked_fill(lse == float("-inf"), float("inf"))


def _check_probs(dropout_p, return_attn_probs) -> None:
    if dropout_p > 0.0 and return_attn_probs:
        raise ValueError(
            "return_attn_probs=True with dropout_p > 0: flash-attention then returns the "
            "dropout pattern (S_dmask), which fusedattn's kernels do not materialise; pass "
            "dropout_p=0.0 to get (out, softmax_lse, S_dmask) with an empty S_dmask"
        )


def _result(result, q, return_attn_probs, transpose: bool):
    """out, or (out, softmax_lse, S_dmask) as flash-attention returns them without dropout
    (S_dmask an empty tensor)."""
    out, lse = result if return_attn_probs else (result, None)
    out = out.transpose(1, 2) if transpose else out
    return (out, _flash_lse(lse), q.new_empty(0)) if return_attn_probs else out


@_flash_errors
def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """q (B, Tq, Hq, D), k (B, Tk, Hkv, D), v (B, Tk, Hkv, Dv) -> out (B, Tq, Hq, Dv)
    [, softmax_lse (B, Hq, Tq), S_dmask]; see the module docstring. fp8 q, k, v with
    flash-attention 3's descales (the output bfloat16)."""
    _check_args(dropout_p, softmax_scale, causal)
    _check_probs(dropout_p, return_attn_probs)
    result = attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p,
        is_causal=causal, scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2],
        window_size=_window(window_size), softcap=softcap, alibi_slopes=alibi_slopes,
        causal_alignment="bottom_right", return_lse=return_attn_probs, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale, backend=BACKEND,
    )  # fmt: skip
    return _result(result, q, return_attn_probs, transpose=True)


@_flash_errors
def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv (B, T, 3, H, D) -> flash_attn_func on its three parts (gradients flow into qkv)."""
    q, k, v = qkv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)  # fmt: skip


@_flash_errors
def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q (B, Tq, Hq, D), kv (B, Tk, 2, Hkv, D) -> flash_attn_func(q, k, v)."""
    k, v = kv.unbind(2)
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)  # fmt: skip


@_flash_errors
def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """Packed q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv) with int32
    cu_seqlens (B + 1,) -> out (total_q, Hq, Dv) [, softmax_lse (Hq, total_q), S_dmask]. With
    block_table (B, max_pages) int32, k and v are a paged cache (num_pages, page_size, Hkv,
    D[v]) and sequence b's keys its first cu_seqlens_k[b + 1] - cu_seqlens_k[b] positions
    (chunked prefill; inference only)."""
    _check_args(dropout_p, softmax_scale, causal)
    _check_probs(dropout_p, return_attn_probs)
    heads_k = k.shape[-2]
    call = functools.partial(
        varlen_attention, q, k, v, cu_seqlens_q, cu_seqlens_k, _int(max_seqlen_q, "max_seqlen_q"),
        _int(max_seqlen_k, "max_seqlen_k"), dropout_p, is_causal=causal, scale=softmax_scale,
        enable_gqa=q.shape[1] != heads_k, window_size=_window(window_size), softcap=softcap,
        alibi_slopes=alibi_slopes, causal_alignment="bottom_right",
        return_lse=return_attn_probs, block_table=block_table, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale, backend=BACKEND,
    )  # fmt: skip
    inputs = (q, k, v, alibi_slopes)
    if (
        block_table is not None
        and torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in inputs)
    ):  # flash-attention runs this forward; only a backward through it fails
        with torch.no_grad():
            result = call()
        out = result[0] if return_attn_probs else result
        out = _ForwardOnly.apply("flash_attn_varlen_func with a block_table", out,
                                 *(t for t in inputs if t is not None))  # fmt: skip
        result = (out, result[1]) if return_attn_probs else out
    else:
        result = call()
    return _result(result, q, return_attn_probs, transpose=False)


@_flash_errors
def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv (total, 3, H, D) with one set of cu_seqlens for queries and keys."""
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale,
        causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip


@_flash_errors
def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q (total_q, Hq, D), kv (total_k, 2, Hkv, D)."""
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
        return_attn_probs,
    )  # fmt: skip


@_flash_errors
def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """fusedattn.attention_with_kvcache under flash-attention's name and argument order, run
    without autograd (as flash-attention's, which has no backward). cache_seqlens=None means
    every slot of the cache holds a key (flash-attention's default). rotary_cos/rotary_sin
    (seqlen_ro, rotary_dim / 2): the new k is rotated at positions cache_seqlens[b] + i, and q
    too when causal or windowed, else every query at cache_seqlens[b] (flash-attention's
    rule; with cache_leftpad too: positions are cache slots); cache_batch_idx (B,) int32:
    sequence b is row cache_batch_idx[b] of a contiguous cache (read and appended in place,
    as a page of the whole row)."""
    _check_args(0.0, softmax_scale, causal)
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("appending k and v needs cache_seqlens (where to write them)")
        pages = 1 if block_table is None else block_table.shape[1]
        cache_seqlens = k_cache.shape[1] * pages
    if cache_batch_idx is not None:
        if block_table is not None:
            raise ValueError("cache_batch_idx with a block_table: index the block table instead")
        if not isinstance(cache_batch_idx, torch.Tensor) or cache_batch_idx.dim() != 1:
            raise ValueError("cache_batch_idx must be a (B,) int32 tensor")
        # each sequence's cache row as one page of the row's length: read and written in place
        block_table = cache_batch_idx.to(torch.int32)[:, None]
    if rotary_cos is not None or rotary_sin is not None:
        q, k = _rotate(q, k, rotary_cos, rotary_sin, cache_seqlens, rotary_interleaved,
                       causal or _window(window_size) is not None)  # fmt: skip
    with torch.no_grad():
        result = attention_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
            cache_leftpad=cache_leftpad, scale=softmax_scale, is_causal=causal,
            window_size=_window(window_size), softcap=softcap, alibi_slopes=alibi_slopes,
            num_splits=num_splits, return_lse=return_softmax_lse, q_descale=q_descale,
            k_descale=k_descale, v_descale=v_descale, backend=BACKEND,
        )  # fmt: skip
    if return_softmax_lse:
        return result[0], _flash_lse(result[1])
    return result


def _rotate(q, k, cos, sin, cache_seqlens, interleaved, positional):
    if cos is None or sin is None:
        raise ValueError("rotary embedding needs both rotary_cos and rotary_sin")
    if k is None:
        raise ValueError(
            "rotary_cos/rotary_sin apply to the new k: pass k and v (as flash-attention)"
        )
    # Positions are cache slots, left padding included: flash-attention's kernel reads the
    # rotary tables at cache_seqlens[b] + i whatever cache_leftpad is (its tests rotate the
    # reference at seqlen_offsets=cache_seqlens with a left-padded cache).
    offsets = cache_seqlens
    if not isinstance(offsets, torch.Tensor):
        offsets = torch.full((q.shape[0],), int(offsets), dtype=torch.int32, device=q.device)
    k = apply_rotary_emb(k, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    if positional:
        q = apply_rotary_emb(q, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    else:  # every query at position cache_seqlens[b]: rotate them as one row of B*Tq heads
        B, Tq, H, D = q.shape
        flat = q.reshape(B, 1, Tq * H, D)
        q = apply_rotary_emb(flat, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
        q = q.reshape(B, Tq, H, D)
    return q, k
