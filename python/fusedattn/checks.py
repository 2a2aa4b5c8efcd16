"""Argument validation shared by every backend of every op.

Each public op validates here first, so bad input gets one clear `TypeError`/`ValueError`
naming the argument and the expected shape or dtype before any backend is chosen or any
kernel launched, and every backend (reference included) sees the same rules.
"""

from __future__ import annotations

import itertools
import numbers
from collections.abc import Sequence

import torch

from .cache_layout import kvcache_capacity
from .fp8 import FORWARD_DTYPE, is_fp8
from .masks import Window, make_window

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def shape_str(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def check_tensor(name: str, t, *, dims: int | None = None, layout: str = "") -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_nested:
        raise TypeError(
            f"{name} is a nested (jagged) tensor; fusedattn's ops take dense tensors (pack "
            "variable-length sequences for fusedattn.varlen_attention)"
        )
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D {layout}, got shape {shape_str(t.shape)}")


def check_float_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")


def check_same(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{name} must have the dtype of {ref_name} ({ref.dtype}), got {t.dtype}")
    if t.device != ref.device:
        raise ValueError(
            f"{name} must be on the device of {ref_name} ({ref.device}), got {t.device}"
        )


# ---- fp8 --------------------------------------------------------------------------------------

HALF_AND_FP32 = (torch.float16, torch.bfloat16, torch.float32)
FP8_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_descale(name: str, descale, B: int, Hkv: int, device: torch.device) -> None:
    """A descale: float32, one value (0-dim or (1,)) or (B, Hkv), on `device`."""
    check_tensor(name, descale)
    if descale.dtype != torch.float32:
        raise TypeError(f"{name} must be float32, got {descale.dtype}")
    if tuple(descale.shape) not in ((), (1,), (B, Hkv)):
        raise ValueError(
            f"{name} must be one value (0-dim or (1,)) or (B, Hkv) = ({B}, {Hkv}), got "
            f"{shape_str(descale.shape)}"
        )
    if descale.device != device:
        raise ValueError(f"{name} must be on {device}, got {descale.device}")


def check_descale_values(**descales) -> None:
    """Every descale positive and finite (a host read: the value checks' policy decides)."""
    for name, d in descales.items():
        if d is None:
            continue
        values = d.detach().to("cpu")
        bad = ~(torch.isfinite(values) & (values > 0))
        if bool(bad.any()):
            first = values.flatten()[bad.flatten()][0].item()
            raise ValueError(f"{name} must be positive and finite, got {first}")


def check_no_descales(reason: str, **descales) -> None:
    for name, d in descales.items():
        if d is not None:
            raise ValueError(f"{name} is given but {reason}: descales belong to fp8 tensors")


def check_fp8_attention(q, k, v, q_descale, k_descale, v_descale, out_dtype, *, B, Hkv,
                        paged=False) -> bool:  # fmt: skip
    """The fp8 rules of attention / varlen_attention; True when the call is fp8. Without
    fp8 inputs no descale and no out_dtype may be given. The forward takes q, k, v all in
    float8_e4m3fn; a paged cache (varlen_attention with a block table) may be fp8 (either
    fp8 type) under a bf16/fp16/fp32 q, or under an fp8 q."""
    fp8 = [n for n, t in (("q", q), ("k", k), ("v", v)) if is_fp8(t)]
    descales = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    if not fp8:
        check_no_descales("no input is fp8", **descales)
        if out_dtype is not None:
            raise ValueError(f"out_dtype is for fp8 inputs (it picks their output's dtype), got "
                             f"out_dtype={out_dtype} with q {q.dtype}")  # fmt: skip
        return False
    if paged:
        if not (is_fp8(k) and k.dtype == v.dtype):
            raise TypeError(f"a paged cache is fp8 in k and v (one fp8 type) or in neither, got "
                            f"k {k.dtype}, v {v.dtype}")  # fmt: skip
        if not is_fp8(q) and q.dtype not in HALF_AND_FP32:
            raise TypeError(f"q must be float16, bfloat16, float32 or fp8, got {q.dtype}")
    elif any(t.dtype != FORWARD_DTYPE for t in (q, k, v)):
        raise TypeError(
            "the fp8 attention takes q, k and v all in torch.float8_e4m3fn (the tensor cores' "
            f"format), got q {q.dtype}, k {k.dtype}, v {v.dtype}"
        )
    for name, t, d in (("q", q, q_descale), ("k", k, k_descale), ("v", v, v_descale)):
        if is_fp8(t):
            if d is None:
                raise ValueError(f"{name} is {t.dtype}: {name}_descale is required (a stored "
                                 f"element means stored x {name}_descale)")  # fmt: skip
            check_descale(f"{name}_descale", d, B, Hkv, q.device)
        elif d is not None:
            raise ValueError(f"{name}_descale is given but {name} is {t.dtype}, not fp8")
    if out_dtype is not None:
        if out_dtype not in FP8_OUT_DTYPES:
            raise TypeError(f"out_dtype must be one of {FP8_OUT_DTYPES} (not fp8), got "
                            f"{out_dtype}")  # fmt: skip
        if not is_fp8(q):
            raise ValueError(f"out_dtype is for an fp8 q; the output is q's {q.dtype}")
    check_inference_only("fp8 attention", dict(q=q, k=k, v=v))
    return True


def check_fp8_kvcache(q, k_cache, v_cache, q_descale, k_descale, v_descale, B, Hkv) -> None:
    """An fp8 KV cache: k_cache and v_cache of one fp8 type, each with its descale; q in
    float16, bfloat16 or float32, or in fp8 with q_descale."""
    if not (is_fp8(k_cache) and v_cache.dtype == k_cache.dtype):
        raise TypeError(f"k_cache and v_cache must be of one fp8 type (or neither fp8), got "
                        f"{k_cache.dtype} and {v_cache.dtype}")  # fmt: skip
    if v_cache.device != q.device or k_cache.device != q.device:
        raise ValueError(f"k_cache and v_cache must be on q's device {q.device}")
    for name, d in (("k_descale", k_descale), ("v_descale", v_descale)):
        if d is None:
            raise ValueError(f"the cache is {k_cache.dtype}: {name} is required (a stored "
                             f"element means stored x {name})")  # fmt: skip
        check_descale(name, d, B, Hkv, q.device)
    if is_fp8(q):
        if q_descale is None:
            raise ValueError(f"q is {q.dtype}: q_descale is required")
        check_descale("q_descale", q_descale, B, Hkv, q.device)
    else:
        if q.dtype not in HALF_AND_FP32:
            raise TypeError(f"q must be float16, bfloat16, float32 or fp8 over an fp8 cache, "
                            f"got {q.dtype}")  # fmt: skip
        check_no_descales(f"q is {q.dtype}", q_descale=q_descale)


def check_mask(name: str, mask, target_shape: Sequence[int], device: torch.device) -> None:
    """A bool or float mask that broadcasts to `target_shape` without changing it."""
    check_tensor(name, mask)
    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(f"{name} must be bool or floating point, got {mask.dtype}")
    if mask.device != device:
        raise ValueError(f"{name} must be on {device}, got {mask.device}")
    target = tuple(target_shape)
    ok = mask.dim() <= len(target)
    if ok:
        try:
            ok = tuple(torch.broadcast_shapes(mask.shape, target)) == target
        except RuntimeError:
            ok = False
    if not ok:
        raise ValueError(
            f"{name} of shape {shape_str(mask.shape)} does not broadcast to {shape_str(target)}"
        )


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_scale(scale) -> None:
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not (float(scale) == float(scale) and abs(float(scale)) != float("inf")):
        raise ValueError(f"scale must be finite, got {scale}")


def check_window_size(window_size) -> None:
    if window_size is None:
        return
    ok = (
        isinstance(window_size, tuple | list)
        and len(window_size) == 2
        and all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in window_size)
    )
    if not ok:
        raise TypeError(
            "window_size must be None or a pair of Python ints (left, right), -1 for an "
            f"unbounded side, e.g. (255, 0); got {window_size!r} (a pair of integer tensors, "
            "as flash-attention takes it, is accepted by fusedattn.compat.flash_attn; here "
            "pass tuple(int(w) for w in window_size))"
        )
    if any(w < -1 for w in window_size):
        raise ValueError(
            f"window_size sides must be >= 0, or -1 for unbounded, got {tuple(window_size)}"
        )


def check_attention_variants(
    window_size, softcap, alibi_slopes, sinks, causal_alignment, *, batch, heads, device
) -> None:
    """The keyword-only variants shared by fusedattn.attention and varlen_attention."""
    check_window_size(window_size)
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    if not (0.0 <= float(softcap) < float("inf")):
        raise ValueError(f"softcap must be finite and >= 0 (0 = off), got {softcap}")
    if alibi_slopes is not None:
        check_tensor("alibi_slopes", alibi_slopes)
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes must be float32, got {alibi_slopes.dtype}")
        if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
            raise ValueError(
                f"alibi_slopes must have shape (Hq,) = ({heads},) or (B, Hq) = ({batch}, "
                f"{heads}), got {shape_str(alibi_slopes.shape)}"
            )
        if alibi_slopes.device != device:
            raise ValueError(f"alibi_slopes must be on {device}, got {alibi_slopes.device}")
    if sinks is not None:
        check_tensor("sinks", sinks, dims=1, layout=f"(Hq,) = ({heads},)")
        check_float_dtype("sinks", sinks)
        if sinks.shape[0] != heads:
            raise ValueError(
                f"sinks must have shape (Hq,) = ({heads},), got {shape_str(sinks.shape)}"
            )
        if sinks.device != device:
            raise ValueError(f"sinks must be on {device}, got {sinks.device}")
    if causal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(
            f"causal_alignment must be 'top_left' or 'bottom_right', got {causal_alignment!r}"
        )


def check_dropout(dropout_p) -> None:
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")


def check_heads(Hq: int, Hkv: int, enable_gqa) -> None:
    check_bool("enable_gqa", enable_gqa)
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"q has {Hq} heads and k/v have {Hkv}: Hq must be a multiple of Hkv")
    if Hq != Hkv and not enable_gqa:
        raise ValueError(
            f"q has {Hq} heads and k/v have {Hkv}: pass enable_gqa=True for grouped-query attention"
        )


def check_attention_args(
    q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask,
    *, window_size=None, softcap=0.0, alibi_slopes=None, sinks=None,
    causal_alignment="top_left", return_lse=False, q_descale=None, k_descale=None,
    v_descale=None, out_dtype=None,
) -> Window:  # fmt: skip
    """Validate the arguments of `fusedattn.attention` (SDPA's layout and mask conventions);
    returns the call's normalised positional window."""
    check_tensor("q", q, dims=4, layout="(B, Hq, Tq, D)")
    check_tensor("k", k, dims=4, layout="(B, Hkv, Tk, D)")
    check_tensor("v", v, dims=4, layout="(B, Hkv, Tk, Dv)")
    B, Hq, Tq, D = q.shape
    Bk, Hkv, Tk, Dk = k.shape
    fp8 = check_fp8_attention(q, k, v, q_descale, k_descale, v_descale, out_dtype, B=B, Hkv=Hkv)
    if not fp8:
        check_float_dtype("q", q)
    check_same("k", k, "q", q)
    check_same("v", v, "q", q)
    Bv, Hv, Tv, _ = v.shape
    if Bk != B or Bv != B:
        raise ValueError(
            f"q, k and v must have the same batch size, got {B}, {Bk} and {Bv} "
            f"(q {shape_str(q.shape)}, k {shape_str(k.shape)}, v {shape_str(v.shape)})"
        )
    if Dk != D:
        raise ValueError(f"k must have q's head dim {D} in its last dimension, got {Dk}")
    if Hv != Hkv or Tv != Tk:
        raise ValueError(
            f"v must have k's heads and length (B, {Hkv}, {Tk}, Dv), got {shape_str(v.shape)}"
        )
    if D == 0 or v.shape[-1] == 0:
        raise ValueError("q, k and v must have a head dim of at least 1")
    check_heads(Hq, Hkv, enable_gqa)
    if attn_mask is not None:
        check_mask("attn_mask", attn_mask, (B, Hq, Tq, Tk), q.device)
    if key_padding_mask is not None:
        check_tensor("key_padding_mask", key_padding_mask, dims=2, layout="(B, Tk)")
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(
                f"key_padding_mask must be bool (True = padding key), got {key_padding_mask.dtype}"
            )
        if tuple(key_padding_mask.shape) != (B, Tk):
            raise ValueError(
                f"key_padding_mask must have shape (B, Tk) = ({B}, {Tk}), "
                f"got {shape_str(key_padding_mask.shape)}"
            )
        if key_padding_mask.device != q.device:
            raise ValueError(
                f"key_padding_mask must be on {q.device}, got {key_padding_mask.device}"
            )
    check_dropout(dropout_p)
    if fp8 and dropout_p > 0.0:
        raise ValueError("the fp8 attention is inference only: dropout_p must be 0")
    check_bool("is_causal", is_causal)
    check_bool("return_lse", return_lse)
    check_scale(scale)
    check_attention_variants(
        window_size, softcap, alibi_slopes, sinks, causal_alignment,
        batch=B, heads=Hq, device=q.device,
    )  # fmt: skip
    return make_window(
        is_causal, window_size, causal_alignment, Tq, Tk, alibi=alibi_slopes is not None
    )


def check_varlen_args(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, is_causal,
    scale, enable_gqa=False, *, window_size=None, softcap=0.0, alibi_slopes=None, sinks=None,
    causal_alignment="top_left", block_table=None, return_lse=False, q_descale=None,
    k_descale=None, v_descale=None, out_dtype=None,
) -> Window:  # fmt: skip
    """Validate `fusedattn.varlen_attention` (packed (total, H, D) sequences, or with
    block_table keys and values in a paged cache (num_pages, page_size, Hkv, D)); returns the
    normalised positional window. Reads no tensor values (no device sync): cu_seqlens and
    max_seqlen are trusted to describe the packing, as in flash-attention."""
    paged = block_table is not None
    check_tensor("q", q, dims=3, layout="(total_q, Hq, D)")
    if paged:
        check_tensor("k", k, dims=4, layout="(num_pages, page_size, Hkv, D) with a block_table")
        check_tensor("v", v, dims=4, layout="(num_pages, page_size, Hkv, Dv) with a block_table")
    else:
        check_tensor("k", k, dims=3, layout="(total_k, Hkv, D)")
        check_tensor("v", v, dims=3, layout="(total_k, Hkv, Dv)")
    _, Hq, D = q.shape
    *rows, Hkv, Dk = k.shape
    fp8 = any(is_fp8(t) for t in (q, k, v))
    if not fp8:
        check_float_dtype("q", q)
    if fp8 and paged:  # an fp8 paged cache may sit under a bf16/fp16/fp32 q
        check_same("v", v, "k", k)
    else:
        check_same("k", k, "q", q)
        check_same("v", v, "q", q)
    if Dk != D:
        raise ValueError(f"k must have q's head dim {D} in its last dimension, got {Dk}")
    if list(v.shape[:-1]) != [*rows, Hkv]:
        want = shape_str((*rows, Hkv, "Dv"))
        raise ValueError(f"v must have k's rows and heads {want}, got {shape_str(v.shape)}")
    if D == 0 or v.shape[-1] == 0:
        raise ValueError("q, k and v must have a head dim of at least 1")
    check_heads(Hq, Hkv, enable_gqa)  # SDPA's rule, as in fusedattn.attention
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, cu, dims=1, layout="(B + 1,) prefix sums")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {cu.dtype}")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on {q.device}, got {cu.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape or cu_seqlens_q.shape[0] < 1:
        raise ValueError(
            "cu_seqlens_q and cu_seqlens_k must both have B + 1 >= 1 entries, got "
            f"{shape_str(cu_seqlens_q.shape)} and {shape_str(cu_seqlens_k.shape)}"
        )
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m < 0:
            raise TypeError(f"{name} must be a non-negative int, got {m!r}")
    check_fp8_attention(q, k, v, q_descale, k_descale, v_descale, out_dtype,
                        B=cu_seqlens_q.shape[0] - 1, Hkv=Hkv, paged=paged)  # fmt: skip
    if fp8 and dropout_p:
        raise ValueError("the fp8 attention is inference only: dropout_p must be 0")
    check_dropout(dropout_p)
    check_bool("is_causal", is_causal)
    check_bool("return_lse", return_lse)
    check_scale(scale)
    check_attention_variants(
        window_size, softcap, alibi_slopes, sinks, causal_alignment,
        batch=cu_seqlens_q.shape[0] - 1, heads=Hq, device=q.device,
    )  # fmt: skip
    window = make_window(
        is_causal, window_size, causal_alignment, None, None, alibi=alibi_slopes is not None
    )
    if paged:
        _check_paged_prefill(q, k, v, cu_seqlens_q, block_table, dropout_p, window,
                             alibi_slopes, sinks)  # fmt: skip
    return window


def _check_paged_prefill(q, k, v, cu_seqlens_q, block_table, dropout_p, window, alibi_slopes,
                         sinks) -> None:  # fmt: skip
    """varlen_attention over a paged cache: inference only, as attention_with_kvcache, with
    the queries the last of each sequence's keys (bottom-right)."""
    B = cu_seqlens_q.shape[0] - 1
    check_tensor("block_table", block_table, dims=2, layout="(B, max_pages) int32")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32, got {block_table.dtype}")
    if block_table.shape[0] != B or block_table.device != q.device:
        raise ValueError(
            f"block_table must be (B, max_pages) = ({B}, ...) on {q.device}, got "
            f"{shape_str(block_table.shape)} on {block_table.device}"
        )
    for name, t in (("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"the paged {name} must have a unit last stride, got {t.stride()}")
    if dropout_p > 0.0:
        raise ValueError("varlen_attention with a block_table is inference only: no dropout")
    if (window.bounded or alibi_slopes is not None) and not window.bottom_right:
        raise ValueError(
            "varlen_attention with a block_table: each sequence's queries are its last keys "
            "(chunked prefill, a prefix-cache hit), so is_causal, window_size and alibi_slopes "
            "need causal_alignment='bottom_right'"
        )
    check_inference_only("varlen_attention with a block_table",
                         dict(q=q, k=k, v=v, sinks=sinks, alibi_slopes=alibi_slopes))  # fmt: skip


def check_inference_only(op: str, tensors: dict) -> None:
    """ValueError where autograd would record: grad mode on and an input that requires grad
    (under no_grad / inference_mode, parameters that require grad are fine)."""
    grads = [n for n, t in tensors.items() if t is not None and t.requires_grad]
    if torch.is_grad_enabled() and grads:
        raise ValueError(
            f"{op} is inference only and has no backward, but {', '.join(grads)} require grad "
            "with grad mode on: call it under torch.no_grad() or torch.inference_mode()"
        )


def normalize_shape(normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral) and not isinstance(normalized_shape, bool):
        return (int(normalized_shape),)
    if isinstance(normalized_shape, torch.Size | Sequence) and all(
        isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in normalized_shape
    ):
        return tuple(int(s) for s in normalized_shape)
    raise TypeError(
        f"normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}"
    )


def check_layer_norm_args(x, normalized_shape, weight, bias, eps) -> tuple[int, ...]:
    """Validate `fusedattn.layer_norm`; returns normalized_shape as a tuple."""
    check_tensor("x", x)
    check_float_dtype("x", x)
    shape = normalize_shape(normalized_shape)
    # zero-sized dims are allowed, as in F.layer_norm: the output is then empty
    if len(shape) == 0 or any(s < 0 for s in shape):
        raise ValueError(f"normalized_shape must be non-empty and non-negative, got {shape}")
    if x.dim() < len(shape) or tuple(x.shape[-len(shape) :]) != shape:
        raise ValueError(
            f"x of shape {shape_str(x.shape)} must end with normalized_shape {shape_str(shape)}"
        )
    for name, p in (("weight", weight), ("bias", bias)):
        if p is None:
            continue
        check_tensor(name, p)
        if tuple(p.shape) != shape:
            raise ValueError(
                f"{name} must have shape normalized_shape {shape_str(shape)}, "
                f"got {shape_str(p.shape)}"
            )
        if p.dtype not in (x.dtype, torch.float32):
            raise TypeError(f"{name} must be {x.dtype} (the dtype of x) or float32, got {p.dtype}")
        if p.device != x.device:
            raise ValueError(f"{name} must be on {x.device}, got {p.device}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not float(eps) >= 0.0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    return shape


def check_rms_norm_args(x, normalized_shape, weight, eps) -> tuple[tuple[int, ...], float]:
    """Validate `fusedattn.rms_norm`; returns (normalized_shape as a tuple, eps), eps=None
    meaning torch.finfo(x.dtype).eps as in F.rms_norm."""
    if eps is None:
        check_tensor("x", x)
        check_float_dtype("x", x)
        eps = torch.finfo(x.dtype).eps
    shape = check_layer_norm_args(x, normalized_shape, weight, None, eps)
    return shape, float(eps)


def check_linear_args(x, weight, bias) -> None:
    """Validate `fusedattn.linear` (F.linear's contract): x (..., in_features), weight
    (out_features, in_features), bias (out_features,) or None, one dtype and device."""
    check_tensor("x", x)
    check_float_dtype("x", x)
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension (..., in_features)")
    check_tensor("weight", weight, dims=2, layout="(out_features, in_features)")
    check_same("weight", weight, "x", x)
    if weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"x of shape {shape_str(x.shape)} must end with in_features = {weight.shape[1]} "
            f"(weight {shape_str(weight.shape)})"
        )
    if bias is not None:
        check_tensor("bias", bias, dims=1, layout="(out_features,)")
        check_same("bias", bias, "x", x)
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(
                f"bias must have out_features = {weight.shape[0]} elements, "
                f"got {shape_str(bias.shape)}"
            )


class DimensionError(IndexError, ValueError):
    """A dim out of range: torch's IndexError ("Dimension out of range ..."), and a ValueError
    as fusedattn's other argument errors (callers catching either keep working)."""


def check_softmax_args(x, dim, mask, scale, is_causal) -> int:
    """Validate `fusedattn.softmax`; returns `dim` made non-negative. torch's contract for the
    edges: a 0-d x takes dim 0 or -1 (its softmax is 1), and a dim out of range raises
    torch's IndexError (as DimensionError, a ValueError too)."""
    check_tensor("x", x)
    check_float_dtype("x", x)
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    n = max(x.dim(), 1)  # torch wraps a 0-d tensor's dims as a 1-d one's
    if not -n <= dim < n:
        raise DimensionError(
            f"Dimension out of range (expected to be in range of [{-n}, {n - 1}], but got "
            f"{dim}): dim {dim} is out of range for x with {x.dim()} dimensions"
        )
    dim = int(dim) % n
    if mask is not None:
        check_mask("mask", mask, x.shape, x.device)
    check_scale(scale)
    check_bool("is_causal", is_causal)
    if is_causal and (x.dim() < 2 or dim != x.dim() - 1):
        raise ValueError(
            "is_causal=True needs x of shape (..., Tq, Tk) and dim=-1 (the key dimension), "
            f"got x {shape_str(x.shape)} and dim={dim}"
        )
    return dim


def check_kvcache_args(
    q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, scale, is_causal,
    window_size, softcap, alibi_slopes, sinks, num_splits, return_lse=False, q_descale=None,
    k_descale=None, v_descale=None,
) -> tuple[Window, torch.Tensor]:  # fmt: skip
    """Validate `fusedattn.attention_with_kvcache` (flash-attention's layout: sequence before
    heads); returns the normalised positional window (bottom-right) and cache_seqlens as an
    int32 tensor. Reads no tensor values (no device sync)."""
    check_tensor("q", q, dims=4, layout="(B, Tq, Hq, D)")
    paged = block_table is not None
    cache_layout = "(num_pages, page_size, Hkv, D)" if paged else "(B, S, Hkv, D)"
    check_tensor("k_cache", k_cache, dims=4, layout=cache_layout)
    check_tensor("v_cache", v_cache, dims=4, layout=cache_layout.replace("D)", "Dv)"))
    B, _, Hq, D = q.shape
    rows, slots, Hkv, Dk = k_cache.shape
    fp8_cache = is_fp8(k_cache) or is_fp8(v_cache)
    if fp8_cache:
        check_fp8_kvcache(q, k_cache, v_cache, q_descale, k_descale, v_descale, B, Hkv)
    else:
        check_no_descales(f"the cache is {k_cache.dtype}", k_descale=k_descale,
                          v_descale=v_descale)  # fmt: skip
        if is_fp8(q):
            raise TypeError(f"q is {q.dtype}: an fp8 q reads an fp8 cache (k_cache is "
                            f"{k_cache.dtype})")  # fmt: skip
        check_no_descales(f"q is {q.dtype}", q_descale=q_descale)
        check_float_dtype("q", q)
        check_same("k_cache", k_cache, "q", q)
        check_same("v_cache", v_cache, "q", q)
    if Dk != D:
        raise ValueError(f"k_cache must have q's head dim {D} in its last dimension, got {Dk}")
    if tuple(v_cache.shape[:3]) != (rows, slots, Hkv):
        raise ValueError(
            f"v_cache must match k_cache's {shape_str(k_cache.shape[:3])} in its first three "
            f"dimensions, got {shape_str(v_cache.shape)}"
        )
    if D == 0 or v_cache.shape[-1] == 0:
        raise ValueError("q, k_cache and v_cache must have a head dim of at least 1")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(
                f"{name} must have a unit last stride (it is read and appended to in place; "
                f"got strides {tuple(t.stride())})"
            )
    check_heads(Hq, Hkv, True)  # grouped-query attention whenever Hq is a multiple of Hkv
    if paged:
        check_tensor("block_table", block_table, dims=2, layout="(B, max_pages) int32")
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be int32, got {block_table.dtype}")
        if block_table.shape[0] != B:
            raise ValueError(
                f"block_table must have one row per sequence (B = {B}), got "
                f"{shape_str(block_table.shape)}"
            )
        if block_table.device != q.device:
            raise ValueError(f"block_table must be on {q.device}, got {block_table.device}")
    elif rows < B:
        raise ValueError(
            f"k_cache holds {rows} sequences but q has B = {B} (a paged cache needs block_table)"
        )
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        if cache_seqlens < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got {cache_seqlens}")
        cache_seqlens = torch.full((B,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    for name, t in (("cache_seqlens", cache_seqlens), ("cache_leftpad", cache_leftpad)):
        if t is None and name == "cache_leftpad":
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be an int32 tensor of shape (B,) (or an int), got "
                            f"{type(t).__name__}")  # fmt: skip
        check_tensor(name, t, dims=1, layout=f"(B,) = ({B},) int32")
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
        if t.shape[0] != B:
            raise ValueError(f"{name} must have shape (B,) = ({B},), got {shape_str(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on {q.device}, got {t.device}")
    if (k is None) != (v is None):
        raise ValueError("k and v are appended together: pass both or neither")
    if k is not None:
        check_tensor("k", k, dims=4, layout="(B, Tnew, Hkv, D)")
        check_tensor("v", v, dims=4, layout="(B, Tnew, Hkv, Dv)")
        if fp8_cache:  # the new rows are quantized into the cache
            for name, t in (("k", k), ("v", v)):
                if t.dtype not in HALF_AND_FP32:
                    raise TypeError(f"{name} (written into an fp8 cache) must be float16, "
                                    f"bfloat16 or float32, got {t.dtype}")  # fmt: skip
                if t.device != q.device:
                    raise ValueError(f"{name} must be on {q.device}, got {t.device}")
        else:
            check_same("k", k, "q", q)
            check_same("v", v, "q", q)
        want_k = (B, k.shape[1], Hkv, D)
        want_v = (B, k.shape[1], Hkv, v_cache.shape[-1])
        if tuple(k.shape) != want_k or tuple(v.shape) != want_v:
            raise ValueError(
                f"k and v must have shapes {shape_str(want_k)} and {shape_str(want_v)}, got "
                f"{shape_str(k.shape)} and {shape_str(v.shape)}"
            )
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int (0 = chosen per call), got {num_splits!r}")
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0 = chosen per call), got {num_splits}")
    check_bool("is_causal", is_causal)
    check_bool("return_lse", return_lse)
    check_scale(scale)
    check_attention_variants(
        window_size, softcap, alibi_slopes, sinks, "bottom_right",
        batch=B, heads=Hq, device=q.device,
    )  # fmt: skip
    check_inference_only("attention_with_kvcache",
                         dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, sinks=sinks,
                              alibi_slopes=alibi_slopes))  # fmt: skip
    # bottom-right, and kept so even when Tq equals the key count (lengths differ per sequence)
    window = make_window(is_causal, window_size, "bottom_right", None, None, alibi=False)
    return window, cache_seqlens


def paged_key_count(b: int) -> str:
    """How a value error names sequence b's key count in a paged varlen call."""
    return f"cu_seqlens_k[{b + 1}] - cu_seqlens_k[{b}]"


def check_kvcache_values(cache_seqlens, cache_leftpad, block_table, k_cache, Tnew: int,
                         length_of=lambda b: f"cache_seqlens[{b}]", descales=None) -> None:  # fmt: skip
    """The values of attention_with_kvcache's lengths and block table, before anything is
    written: cache_seqlens[b] in [0, capacity - Tnew] (room for the new keys), cache_leftpad[b]
    in [0, cache_seqlens[b] + Tnew] (the first of the sequence's keys), and every block-table
    entry of the pages a sequence reads or writes in [0, num_pages). Reads them to the host:
    a device sync on a GPU (the CPU, the reference and torch backends always pay it; the
    Triton kernels on a GPU only with FUSEDATTN_CHECK_VALUES=1, they never leave the cache's
    bounds whatever the values). ValueError naming the first bad entry. descales: {name:
    tensor or None} of an fp8 call, each positive and finite."""
    if descales:
        check_descale_values(**descales)
    capacity = kvcache_capacity(k_cache, block_table)
    seqlens = cache_seqlens.detach().to("cpu", torch.int64)
    bad = ((seqlens < 0) | (seqlens > capacity - Tnew)).nonzero()
    if len(bad):
        b = int(bad[0, 0])
        room = f"room for the {Tnew} appended keys in " if Tnew else ""
        holds = f"a cache of {capacity} positions per sequence"
        if block_table is not None and int(seqlens[b]) > capacity - Tnew:
            holds = (f"block_table holds {block_table.shape[1]} pages of {k_cache.shape[1]}: "
                     f"{capacity} positions per sequence")  # fmt: skip
        raise ValueError(
            f"{length_of(b)} = {int(seqlens[b])} is outside [0, {capacity - Tnew}] ({room}"
            f"{holds}); nothing was written"
        )
    ends = seqlens + Tnew
    leftpad = torch.zeros_like(seqlens)
    if cache_leftpad is not None:
        leftpad = cache_leftpad.detach().to("cpu", torch.int64)
        bad = ((leftpad < 0) | (leftpad > ends)).nonzero()
        if len(bad):
            b = int(bad[0, 0])
            raise ValueError(
                f"cache_leftpad[{b}] = {int(leftpad[b])} is outside [0, cache_seqlens[{b}] + "
                f"Tnew] = [0, {int(ends[b])}]; nothing was written"
            )
    if block_table is None:
        return
    page_size, num_pages = k_cache.shape[1], k_cache.shape[0]
    table = block_table.detach().to("cpu", torch.int64)
    first = torch.minimum(leftpad, seqlens) // page_size  # the append writes from seqlens on
    last = (ends + page_size - 1) // page_size
    pages = torch.arange(table.shape[1], device="cpu")  # beside table, whatever the default device
    used = (pages >= first[:, None]) & (pages < last[:, None])
    bad = (used & ((table < 0) | (table >= num_pages))).nonzero()
    if len(bad):
        b, p = (int(i) for i in bad[0])
        raise ValueError(
            f"block_table[{b}, {p}] = {int(table[b, p])} is not a page of the cache [0, "
            f"{num_pages}) and sequence {b} uses page {p} (positions {p * page_size} .. "
            f"{(p + 1) * page_size - 1}); nothing was written"
        )


def check_varlen_values(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int | None,
                        max_seqlen_q: int, max_seqlen_k: int) -> tuple[list, list]:  # fmt: skip
    """The prefix sums and max_seqlen of a packed batch, read to the host (a device sync: the
    reference and the eager torch backend; the kernels trust them, as flash-attention's do):
    each rises from 0 to its packed rows (total_k None: keys in a paged cache, any total), and
    no sequence is longer than its max_seqlen. Returns (cu_seqlens_q, cu_seqlens_k) as
    lists."""
    bounds = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for name, cu, total, longest in (("q", bounds[0], total_q, max_seqlen_q),
                                     ("k", bounds[1], total_k, max_seqlen_k)):  # fmt: skip
        steps = [b - a for a, b in itertools.pairwise(cu)]
        total = cu[-1] if total is None else total
        if cu[0] != 0 or cu[-1] != total or min(steps, default=0) < 0:
            raise ValueError(
                f"cu_seqlens_{name} must rise from 0 to the {total} packed rows, got {cu}"
            )
        if max(steps, default=0) > longest:
            raise ValueError(
                f"max_seqlen_{name}={longest} is below a sequence of {max(steps)} rows"
            )
    return bounds
