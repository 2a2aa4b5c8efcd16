"""`fusedattn.attention` and `fusedattn.varlen_attention`: validation, backend dispatch, and
the reference / torch backends (the kernel backends live in flash_attention.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import reference
from ..checks import (
    check_attention_args,
    check_kvcache_values,
    check_varlen_args,
    check_varlen_values,
)
from ..masks import NO_WINDOW, Window, alibi_bias, merge_masks, shift_float_mask, visible_keys
from ..reference.attention import paged_key_count
from . import backends, decode_ops, flash_attention, plans
from .autocast import apply_autocast
from .rowwise import new_output, tracing

HALF = (torch.float16, torch.bfloat16)


def _public_window_args(window: Window) -> dict:
    """The public keywords that give back `window`."""
    return dict(
        is_causal=False,
        window_size=(window.left, window.right),
        causal_alignment="bottom_right" if window.bottom_right else "top_left",
    )


# ---- torch: F.scaled_dot_product_attention ----------------------------------------------------


def _torch_refusals(*, q, return_lse, softcap, alibi_slopes, sinks, **_inputs) -> list[str]:
    reasons = []
    if return_lse:
        reasons.append("torch's scaled_dot_product_attention does not return the log-sum-exp")
    if softcap > 0.0:
        reasons.append(
            "torch's scaled_dot_product_attention cannot apply softcap (a tanh of the scores)"
        )
    if q.dtype in HALF and alibi_slopes is not None:
        reasons.append(
            f"ALiBi reaches torch's scaled_dot_product_attention only as a mask in q's dtype "
            f"({q.dtype}), which rounds -slope·|i - j| (by up to 0.4% in bfloat16)"
        )
    if q.dtype in HALF and sinks is not None and sinks.dtype != q.dtype:
        reasons.append(
            f"sinks reach torch's scaled_dot_product_attention only as a mask column in q's "
            f"dtype ({q.dtype}), which would round the {sinks.dtype} sinks"
        )
    return reasons


def _torch_attention(
    q, k, v, attn_mask, dropout_p, scale, enable_gqa, key_padding_mask, window, softcap,
    alibi_slopes, sinks, return_lse,
):  # fmt: skip
    """F.scaled_dot_product_attention with our masks and variants folded into the one mask it
    takes: key padding and the positional window as a bool mask, ALiBi as a float bias, each
    sink as one more key of value 0 whose score is the sink (q·0 + sink: exact)."""
    B, Hq, Tq, _ = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if key_padding_mask is not None:  # a padded key never contributes, even a NaN there
        hidden = key_padding_mask[:, None, :, None]
        k, v = k.masked_fill(hidden, 0.0), v.masked_fill(hidden, 0.0)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.to(q.dtype)  # SDPA's dtype, converted before any broadcast
    # SDPA's own is_causal only for causal alone, with a positive scale: its CPU flash kernel
    # returns NaN for is_causal with scale <= 0 (seen with torch 2.14).
    is_causal = (
        window.is_top_left_causal
        and attn_mask is None
        and key_padding_mask is None
        and alibi_slopes is None
        and sinks is None
        and (scale is None or scale > 0)
    )
    mask = None
    if not is_causal:
        mask = merge_masks(attn_mask, key_padding_mask, False, Tq, Tk, q.device, window=window)
    if alibi_slopes is not None:
        bias = alibi_bias(alibi_slopes, Tq, Tk, bottom_right=window.bottom_right, dtype=q.dtype)
        if mask is None:
            mask = bias
        elif mask.dtype == torch.bool:
            mask = bias.masked_fill(~mask, float("-inf"))
        else:
            mask = mask + bias
    if sinks is not None:
        k = torch.cat([k, k.new_zeros(B, Hkv, 1, k.shape[-1])], dim=2)
        v = torch.cat([v, v.new_zeros(B, Hkv, 1, v.shape[-1])], dim=2)
        if mask is None:
            mask = q.new_zeros(Tq, Tk)
        elif mask.dtype == torch.bool:
            mask = q.new_zeros(mask.shape).masked_fill(~mask, float("-inf"))
        shape = torch.broadcast_shapes(mask.shape, (1, Hq, Tq, Tk))
        sink = sinks.to(q.dtype)[None, :, None, None].expand(shape[0], Hq, Tq, 1)
        mask = torch.cat([mask.expand(shape), sink], dim=-1)
    if mask is not None and mask.dim() < 2:  # SDPA needs (..., Tq, Tk)
        mask = mask.reshape((1,) * (2 - mask.dim()) + tuple(mask.shape))
    # Rows that see no key: SDPA's forward gives them 0, but its cuDNN backward returned NaN
    # gradients for them (H100, torch 2.11). When a backward can run, they attend to every key
    # instead and their output is zeroed, which makes every gradient through them exactly 0 (a
    # sink column keeps every row alive). One more pass over the mask, only then: inference
    # calls pay nothing.
    dead = None
    grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, attn_mask)
    )
    if mask is not None and sinks is None and grads:
        live = mask if mask.dtype == torch.bool else mask != float("-inf")
        dead = ~live.any(-1, keepdim=True)
        mask = mask | dead if mask.dtype == torch.bool else mask.masked_fill(dead, 0.0)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa,
    )  # fmt: skip
    return out if dead is None else out.masked_fill(dead, 0.0)


def _torch_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, window,
    return_lse, dropout_p, scale, softcap, sinks, block_table=None,
):  # fmt: skip
    """One SDPA call over the batch gathered to (B, H, max_seqlen, D) on the device, no host
    read of the lengths (torch.compile traces it; it ran one SDPA call per sequence after a
    .tolist()): each sequence's key range and positions (bottom-right per sequence where the
    window or ALiBi asks) in one (B, 1, Tq, Tk) mask, the output gathered back to the packed
    rows. Rows past a sequence gather any row and are masked or dropped. With block_table the
    keys and values are gathered from the paged cache the same way. Eager calls check the
    prefix sums, max_seqlen (and the block table) on the host first, as the reference does."""
    lens_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    lens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    if not tracing():
        total_k = None if block_table is not None else k.shape[0]
        check_varlen_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], total_k, max_seqlen_q,
                            max_seqlen_k)  # fmt: skip
        if block_table is not None:
            check_kvcache_values(lens_k, None, block_table, k, 0, paged_key_count)
    qd = _padded(q, cu_seqlens_q, max_seqlen_q)
    if block_table is None:
        kd, vd = _padded(k, cu_seqlens_k, max_seqlen_k), _padded(v, cu_seqlens_k, max_seqlen_k)
    else:
        kd, vd = _paged(k, block_table, max_seqlen_k), _paged(v, block_table, max_seqlen_k)
    i = torch.arange(max_seqlen_q, device=q.device)[None, :, None]
    j = torch.arange(max_seqlen_k, device=q.device)[None, None, :]
    p = i + (lens_k - lens_q)[:, None, None] if window.bottom_right else i  # query positions
    keep = j < lens_k[:, None, None]  # (B, Tq, Tk)
    if window.right >= 0:
        keep = keep & (j <= p + window.right)
    if window.left >= 0:
        keep = keep & (j >= p - window.left)
    mask = keep[:, None]
    if alibi_slopes is not None:
        slopes = alibi_slopes.reshape(-1 if alibi_slopes.dim() == 2 else 1, q.shape[1], 1, 1)
        bias = -slopes * (p - j).abs()[:, None].to(slopes.dtype)
        mask = bias.to(q.dtype).masked_fill(~mask, float("-inf"))
    out = _torch_attention(
        qd, kd, vd, mask, dropout_p, scale, q.shape[1] != k.shape[-2], None, NO_WINDOW, softcap,
        None, sinks, False,
    )  # fmt: skip
    rows = torch.arange(q.shape[0], device=q.device)
    seq = torch.searchsorted(cu_seqlens_q[1:].long(), rows, right=True)
    pos = rows - cu_seqlens_q.long()[seq]
    return out.transpose(1, 2)[seq, pos]  # (total_q, Hq, Dv)


def _paged(cache: torch.Tensor, block_table: torch.Tensor, T: int) -> torch.Tensor:
    """A paged cache's first T positions of each sequence as (B, Hkv, T, D) (positions past a
    sequence's pages read some page of the cache; the caller masks them)."""
    page_size = cache.shape[1]
    j = torch.arange(T, device=cache.device)
    column = (j // page_size).clamp(max=max(block_table.shape[1] - 1, 0))
    pages = block_table.long()[:, column].clamp(0, cache.shape[0] - 1)  # (B, T)
    return cache[pages, j % page_size].transpose(1, 2)


def _padded(x: torch.Tensor, cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """Packed (total, H, D) rows -> (B, H, T, D): sequence b's rows first, then any rows (the
    caller masks them)."""
    B = cu_seqlens.shape[0] - 1
    if x.shape[0] == 0:  # zeros, still connected to x for autograd
        return x.new_zeros(B, x.shape[1], T, x.shape[2]) + x.sum()
    index = (cu_seqlens[:-1].long()[:, None] + torch.arange(T, device=x.device)).clamp(
        max=x.shape[0] - 1
    )
    return x[index].transpose(1, 2)


# ---- reference: the naive twins --------------------------------------------------------------


def _reference_attention(
    q, k, v, attn_mask, dropout_p, scale, enable_gqa, key_padding_mask, window, softcap,
    alibi_slopes, sinks, return_lse,
):  # fmt: skip
    return reference.attention(
        q, k, v, attn_mask, dropout_p, scale=scale, enable_gqa=enable_gqa,
        key_padding_mask=key_padding_mask, softcap=softcap, alibi_slopes=alibi_slopes,
        sinks=sinks, return_lse=return_lse, **_public_window_args(window),
    )  # fmt: skip


def _reference_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window,
                      **kw):  # fmt: skip
    """reference.varlen_attention (block_table among kw: a paged cache)."""
    return reference.varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        enable_gqa=q.shape[1] != k.shape[-2], **_public_window_args(window), **kw,
    )  # fmt: skip


def _triton_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                   scale, window, softcap, alibi_slopes, sinks, return_lse, block_table=None):  # fmt: skip
    """The Triton varlen attention; over a paged cache the decode kernel's packed-query form
    (ops/decode.launch_decode): K/V read in place through the block table, never gathered."""
    if block_table is None:
        return flash_attention.run_triton_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, scale,
            window, softcap, alibi_slopes, sinks, return_lse,
        )  # fmt: skip
    from .decode import launch_decode

    if q.stride(-1) != 1:
        q = q.contiguous()
    out = new_output((q.shape[0], q.shape[1], v.shape[-1]), q.dtype, q.device)
    lse = new_output((q.shape[1], q.shape[0]), torch.float32, q.device)
    if out.numel():
        lengths = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        launch_decode(q, k, v, out, lse, lengths, block_table, None, None, cu_seqlens_q,
                      cu_seqlens_q.shape[0] - 1, max_seqlen_q, scale, window, softcap,
                      alibi_slopes, sinks, 0)  # fmt: skip
    return (out, lse) if return_lse else out


backends.register("attention", "reference", _reference_attention, backends.no_refusals)
backends.register("attention", "torch", _torch_attention, _torch_refusals)
backends.register(
    "attention", "triton", flash_attention.run_triton, flash_attention.triton_refusals
)
backends.register("attention", "cuda", flash_attention.run_cuda, flash_attention.cuda_refusals)
backends.register("varlen_attention", "reference", _reference_varlen, backends.no_refusals)
backends.register("varlen_attention", "torch", _torch_varlen, _torch_refusals)
backends.register("varlen_attention", "triton", _triton_varlen, flash_attention.triton_refusals)
backends.register(
    "varlen_attention", "cuda", flash_attention.run_cuda, flash_attention.cuda_varlen_refusals
)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    key_padding_mask: torch.Tensor | None = None,
    window_size: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    causal_alignment: str = "top_left",
    return_lse: bool = False,
    backend: str = "auto",
):
    """Masked multi-head scaled-dot-product attention, SDPA's layout and mask conventions.

    q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv); attn_mask bool (True = may
    attend) or float (added to the scores), broadcastable to (B, Hq, Tq, Tk);
    key_padding_mask bool (B, Tk), True = padding key.

    Positions: query i sits at key position p = i (causal_alignment="top_left", SDPA) or
    p = i + Tk - Tq ("bottom_right", flash-attention / KV-cache decoding); is_causal shows it
    keys j <= p; window_size=(left, right) keys p - left <= j <= p + right (-1 = unbounded).
    Scores: s = scale·q·k, softcap·tanh(s / softcap) if softcap > 0, then -slope·|p - j| for
    alibi_slopes ((Hq,) or (B, Hq) float32), then the float mask. sinks ((Hq,)) adds one
    logit per head to every row's normaliser. Returns out (B, Hq, Tq, Dv), and lse
    (B, Hq, Tq) float32 when return_lse=True. A query that sees no key gives 0 output,
    0 gradients and lse = -inf (the sink with sinks). A float mask's finite values are
    finite, however large: without sinks each row is shifted by its largest mask entry
    over the keys it can see (key padding, causal, window) before any backend runs (the same softmax; masks.shift_float_mask), so a row masked
    with -1e9 or finfo.min on every key gives the softmax of its scores.
    """
    plan_key = None
    if not tracing():  # an eager call of known metadata: its plan
        plan_key = _plan_key(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                             key_padding_mask, window_size, softcap, alibi_slopes, sinks,
                             causal_alignment, return_lse, backend)  # fmt: skip
        plan = PLANS.get(plan_key)
        if plan is not None:
            return plan(q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks)
    cast = apply_autocast("attention", dict(q=q, k=k, v=v, attn_mask=attn_mask))
    q, k, v, attn_mask = cast["q"], cast["k"], cast["v"], cast["attn_mask"]
    window = check_attention_args(
        q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
        causal_alignment=causal_alignment,
    )  # fmt: skip
    shift = None
    if attn_mask is not None and sinks is None:  # exact, and a large offset kept exact
        visible = visible_keys(key_padding_mask, window, q.shape[2], k.shape[2], q.device)
        attn_mask, shift = shift_float_mask(attn_mask, visible)
    inputs = dict(
        q=q, k=k, v=v, attn_mask=attn_mask, dropout_p=float(dropout_p), scale=scale,
        enable_gqa=enable_gqa, key_padding_mask=key_padding_mask, window=window,
        softcap=float(softcap), alibi_slopes=alibi_slopes, sinks=sinks, return_lse=return_lse,
    )  # fmt: skip
    impl = backends.select("attention", backend, q.device, inputs)
    if plan_key is not None:
        plan = AttentionPlan(impl, inputs)
        PLANS.remember(plan_key, plan)
        result = plan.run(inputs)
    else:
        result = impl.run(**inputs)
    if return_lse and shift is not None:
        out, lse = result
        return out, lse + shift.float()
    return result


PLANS = plans.Cache("attention")


def _plan_key(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask,
              window_size, softcap, alibi_slopes, sinks, causal_alignment, return_lse,
              backend):  # fmt: skip
    """fusedattn.attention's plan key (plans.py), or None for a call plans do not cover:
    under autocast, or with an argument of a kind they do not key (the full path takes it)."""
    try:
        if torch.is_autocast_enabled(q.device.type):
            return None
        return (
            plans.meta(q), plans.meta(k), plans.meta(v), plans.meta(attn_mask),
            plans.meta(key_padding_mask), plans.meta(alibi_slopes), plans.meta(sinks),
            dropout_p, is_causal, scale, enable_gqa,
            None if window_size is None else tuple(window_size), softcap, causal_alignment,
            return_lse, backend, *plans.process_state(q, backend),
            torch.backends.cuda.matmul.allow_tf32,
        )  # fmt: skip
    except (AttributeError, TypeError, RuntimeError):
        return None


class AttentionPlan:
    """fusedattn.attention's decisions for one key: the backend, its keyword arguments, the
    float-mask shift, and for the Triton kernels a TritonAttentionLaunch template (its launch
    arguments worked out once, its launchers bound at their first call, the backward's
    included: flash_attention._forward)."""

    def __init__(self, impl, inputs: dict):
        self.impl = impl
        self.window = inputs["window"]
        tensors = (inputs[n] for n in ("q", "k", "v", "attn_mask", "key_padding_mask",
                                       "alibi_slopes", "sinks"))  # fmt: skip
        self.autograd = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in tensors
        )
        self.shift = inputs["attn_mask"] is not None and inputs["sinks"] is None
        self.kwargs = {n: inputs[n] for n in ("dropout_p", "scale", "enable_gqa", "window",
                                              "softcap", "return_lse")}  # fmt: skip
        self.template = None
        if impl.run is flash_attention.run_triton:  # the module's own (not a wrapper of it)
            self.template = flash_attention.attention_template(
                inputs["q"], inputs["k"], inputs["v"], inputs["attn_mask"],
                inputs["key_padding_mask"], inputs["alibi_slopes"], inputs["sinks"],
                self.window, inputs["scale"], inputs["softcap"], inputs["dropout_p"],
            )  # fmt: skip

    def run(self, inputs: dict):
        """One call's inputs (after the shift) through the backend."""
        if self.template is not None:
            return self.impl.run(**inputs, template=self.template)
        return self.impl.run(**inputs)

    def __call__(self, q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks):
        shift = None
        if self.shift:
            visible = visible_keys(key_padding_mask, self.window, q.shape[2], k.shape[2], q.device)
            attn_mask, shift = shift_float_mask(attn_mask, visible)
        if self.template is not None:  # straight to the Triton forward, positionally
            kw = self.kwargs
            result = flash_attention._forward(
                q, k, v, attn_mask, key_padding_mask, None, None, 0, 0, kw["dropout_p"],
                kw["scale"], self.window, kw["softcap"], alibi_slopes, sinks, kw["return_lse"],
                "triton", self.template, self.autograd,
            )  # fmt: skip
        else:
            result = self.run(dict(q=q, k=k, v=v, attn_mask=attn_mask,
                                   key_padding_mask=key_padding_mask, alibi_slopes=alibi_slopes,
                                   sinks=sinks, **self.kwargs))  # fmt: skip
        if shift is not None and self.kwargs["return_lse"]:
            out, lse = result
            return out, lse + shift.float()
        return result


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    window_size: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    causal_alignment: str = "top_left",
    return_lse: bool = False,
    block_table: torch.Tensor | None = None,
    backend: str = "auto",
):
    """Attention over a packed batch of variable-length sequences, no padding computed.

    q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv); grouped-query attention
    (Hq a multiple of Hkv) with enable_gqa=True, as in `attention`; cu_seqlens_q/k int32
    (B + 1,) prefix sums: sequence b is rows cu[b]:cu[b + 1] (cu[0] = 0, cu[B] = total);
    max_seqlen_q/k bound every sequence's length. The kernels trust cu_seqlens and max_seqlen
    (reading them would cost a device sync): as in flash-attention, a cu_seqlens past the
    packed rows reads out of bounds, a max_seqlen below a length leaves rows unwritten; the
    reference and torch backends check both. Every option of `attention` (positions per sequence, windows,
    softcap, ALiBi, sinks, dropout) applies. Returns (total_q, Hq, Dv) [, lse (Hq, total_q)
    float32]. The reference backend runs one sequence at a time (reading cu_seqlens to the
    host), the torch backend one SDPA call over the batch padded on the device; the Triton
    kernels take the packed batch in one launch.

    Paged prefill (chunked prefill, prefix-cache hits, as flash-attention's
    `flash_attn_varlen_func(..., block_table=...)`): with block_table (B, max_pages) int32, k
    and v are a paged cache (num_pages, page_size, Hkv, D[v]) and sequence b's keys are its
    first cu_seqlens_k[b + 1] - cu_seqlens_k[b] cache positions (page p of sequence b is
    k[block_table[b, p]]; any page size from 1); its queries are the last of them, so
    is_causal, window_size and alibi_slopes need causal_alignment="bottom_right". Inference
    only (no dropout, refused where autograd would record). The Triton backend reads the
    pages in place (the split-key decode kernel with packed queries), the torch and reference
    backends gather them; values (prefix sums, key counts within the cache's capacity,
    block-table entries) are checked on the host there, as for attention_with_kvcache.
    """
    cast = apply_autocast("attention", dict(q=q, k=k, v=v))
    q, k, v = cast["q"], cast["k"], cast["v"]
    window = check_varlen_args(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, is_causal,
        scale, enable_gqa, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, causal_alignment=causal_alignment,
        block_table=block_table,
    )  # fmt: skip
    inputs = dict(
        q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k),
        dropout_p=float(dropout_p), scale=scale, window=window,
        softcap=float(softcap), alibi_slopes=alibi_slopes, sinks=sinks, return_lse=return_lse,
    )  # fmt: skip
    if block_table is not None:
        inputs["block_table"] = block_table
    impl = backends.select("varlen_attention", backend, q.device, inputs)
    if block_table is not None and tracing():  # the whole call as one op (decode_ops.py)
        return decode_ops.record_paged_varlen(inputs, impl.backend)
    return impl.run(**inputs)
