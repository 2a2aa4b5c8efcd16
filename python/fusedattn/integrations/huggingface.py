"""Hugging Face transformers models on fusedattn's attention (`pip install fusedattn[hf]`).

    import fusedattn.integrations.huggingface as fa_hf
    fa_hf.register()                                   # once per process
    model = AutoModel.from_config(config, attn_implementation="fusedattn")
    # or: model.set_attn_implementation("fusedattn")

`register` adds an attention function to transformers' `AttentionInterface` and a mask
builder to `AttentionMaskInterface`. What transformers hands the attention function maps onto
fusedattn's arguments:

- the mask: SDPA's conventions (bool True = may attend, or an additive float mask; None with
  the module's is_causal for plain causal, placed bottom-right as in flash-attention);
- `sliding_window` (Mistral, Qwen2, Gemma 2, GPT-OSS): HF's window keeps keys
  j > i - sliding_window, i.e. `window_size=(sliding_window - 1, 0)`. Where HF's mask is that
  sliding-window causal pattern alone (no padding), the mask builder returns None and the
  kernels skip the tiles outside the window instead of reading a dense mask;
- `softcap` (Gemma 2's attn_logit_softcapping) -> `softcap`;
- `s_aux` (GPT-OSS's learned attention sinks) -> `sinks`;
- `cu_seq_lens_q/k`, `max_length_q/k` (packed sequences, as from
  `DataCollatorWithFlattening(return_flash_attn_kwargs=True)`) -> `varlen_attention`;
- a generation step (one new token per sequence, no gradient, a bool mask or none) -> the
  split-key decode kernels of `attention_with_kvcache`, over HF's dynamic or static cache
  read in place; each sequence's keys run from its first visible position to its last, so a
  static cache's unused slots are never read;
- `k_descale`, `v_descale` (put there by fusedattn's fp8 caches, huggingface_fp8.py: the keys
  and values come as the fp8 storage) -> read as fp8 by the decode kernels; every other call
  dequantizes them first.

Any other keyword with a value raises a ValueError naming it, so that nothing the model asks
for is silently dropped.
"""

from __future__ import annotations

import functools

import torch

from .. import fp8, invariance
from ..ops import attention, varlen_attention
from ..ops.core import backends
from ..ops.decode.api import decode_with_key_mask

NAME = "fusedattn"
REGISTERED: set[str] = set()  # the attn_implementation names register() gave fusedattn

# Keywords transformers passes whose information is already in q, k, v and the mask.
ALREADY_APPLIED = frozenset(
    {"position_ids", "cache_position", "use_cache", "output_router_logits", "layer_idx"}
)


def _is_sliding_window_causal(mask_function) -> bool:
    """True when an HF mask function is exactly its sliding-window causal pattern
    (and_masks(sliding_window_overlay(w), causal_mask_function)), read off the closure.
    Anything else (chunked attention, packed sequences, custom patterns) is not, and keeps
    its dense mask."""
    cells = getattr(mask_function, "__closure__", None) or ()
    parts = [c.cell_contents for c in cells if isinstance(c.cell_contents, tuple)]
    if len(parts) != 1 or len(parts[0]) != 2:
        return False
    names = sorted(getattr(f, "__qualname__", "") for f in parts[0])
    return names == ["causal_mask_function", "sliding_window_overlay.<locals>.inner_mask"]


def build_mask(*args, mask_function=None, local_size=None, **kwargs):
    """transformers' SDPA mask builder, except for a sliding-window causal pattern: there the
    window is left to the kernels (the attention call gets `sliding_window`), so with no
    padding the mask is None and no dense (Tq, Tk) mask is built or read."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if mask_function is None:
        mask_function = causal_mask_function
    skip_allowed = kwargs.get("allow_is_causal_skip", True)
    if local_size is not None and skip_allowed and _is_sliding_window_causal(mask_function):
        skipped = sdpa_mask(*args, mask_function=causal_mask_function, local_size=None, **kwargs)
        if skipped is None:
            return None
    return sdpa_mask(*args, mask_function=mask_function, local_size=local_size, **kwargs)


def _check_keywords(kwargs: dict) -> None:
    unknown = sorted(
        name
        for name, value in kwargs.items()
        if name not in ALREADY_APPLIED and value is not None and value is not False
    )
    if unknown:
        raise ValueError(
            f"fusedattn's attention does not understand {', '.join(unknown)} (passed by the "
            "model); refusing rather than ignoring it. Use attn_implementation='eager' for "
            "this model, or open an issue."
        )


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | torch.Tensor | None = None,
    max_length_k: int | torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    backend: str = "auto",
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D) ->
    (out (B, Tq, Hq, Dv), None). Attention weights are not returned (as with "sdpa").

    indices (B, Tq, topk) int32 (DeepSeek-V3.2's DSA: the keys its indexer picked per query):
    each query sees only its listed keys, within what the mask (or causality) lets it see, as
    the model's eager path masks them. Run as a bool mask of the listed keys (B, 1, Tq, Tk),
    O(Tq x Tk): the non-absorbed per-head q, k, v this hook is handed have no gather kernel
    (fusedattn.mla_attention_with_kvcache(indices=) is the latent-cache form)."""
    _check_keywords(kwargs)
    if indices is not None:
        attention_mask = _selected_keys(indices, attention_mask, query, key, module, is_causal)
    descales = None
    if k_descale is not None or v_descale is not None or fp8.is_fp8(key):
        descales = _fp8_cache(query, key, value, k_descale, v_descale)
    # As transformers' SDPA path: the module (or the call) says whether it is a decoder.
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    variants = dict(softcap=float(softcap or 0.0), sinks=s_aux, scale=scaling, backend=backend)
    window = None
    if sliding_window is not None and causal:
        window = (int(sliding_window) - 1, 0)
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        if descales is not None:
            key = fp8.dequantize_heads(key, descales[0], query.dtype)
            value = fp8.dequantize_heads(value, descales[1], query.dtype)
        return _packed(query, key, value, cu_seq_lens_q, cu_seq_lens_k, max_length_q,
                       max_length_k, dropout, causal, window, variants)  # fmt: skip
    Tq = query.shape[2]
    if attention_mask is None and causal and 1 < Tq < key.shape[2]:
        # transformers leaves out the mask of a causal call with more keys than queries in one
        # case: the prefill of an empty static cache (its sdpa_mask relies on SDPA's top-left
        # is_causal), the prompt in slots 0..Tq-1 and max_cache_len - Tq unfilled slots after
        # it. Those slots are never attended: cut them off, as transformers' sdpa path does
        # (the prompt then sits bottom-right and top-left at once).
        key, value = key[:, :, :Tq], value[:, :, :Tq]
        if position_bias is not None:
            position_bias = position_bias[..., :Tq]
    mask_holds_pattern = attention_mask is not None
    if position_bias is not None:  # a learned bias (T5-style) joins the mask
        attention_mask = position_bias if attention_mask is None else (
            position_bias.masked_fill(~attention_mask, float("-inf"))
            if attention_mask.dtype == torch.bool
            else position_bias + attention_mask
        )  # fmt: skip
    if _is_decode_step(query, key, value, attention_mask, dropout, s_aux, backend) or (
        _invariant_prefill(query, key, value, attention_mask, dropout, s_aux, causal, window,
                           position_bias)
    ):  # fmt: skip
        return _decode_step(query, key, value, attention_mask, causal, window, variants,
                            descales)  # fmt: skip
    if descales is not None:  # the fp8 storage of a cache, read dequantized by this path
        key = fp8.dequantize_heads(key, descales[0], query.dtype)
        value = fp8.dequantize_heads(value, descales[1], query.dtype)
    if mask_holds_pattern:
        # HF's mask holds the whole pattern (causal, window, padding), placed as HF placed it;
        # a position bias alone is no pattern (causality stays, as in transformers' sdpa path).
        causal, window = False, None
    out = attention(
        query, key, value, attention_mask, dropout_p=dropout, is_causal=causal,
        enable_gqa=query.shape[1] != key.shape[1], window_size=window,
        causal_alignment="bottom_right", key_padding_mask=_padded_keys(attention_mask, key),
        **variants,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def _selected_keys(indices, attention_mask, query, key, module, is_causal) -> torch.Tensor:
    """The call's mask narrowed to each query's listed keys (bool, or a float mask with -inf
    at the unlisted ones); without a mask, the listed keys within causality when causal."""
    B, _, Tq, _ = query.shape
    Tk = key.shape[2]
    if indices.dim() != 3 or tuple(indices.shape[:2]) != (B, Tq):
        raise ValueError(f"indices must be (B, Tq, topk) = ({B}, {Tq}, topk), got "
                         f"{tuple(indices.shape)}")  # fmt: skip
    # an unused entry (-1, or past the keys) lands in a spare column, never on a real key
    at = torch.where((indices >= 0) & (indices < Tk), indices.long(), Tk)[:, None]
    listed = torch.zeros(B, 1, Tq, Tk + 1, dtype=torch.bool, device=query.device)
    listed = listed.scatter(-1, at, True)[..., :Tk]
    if attention_mask is None:
        causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        if causal:  # bottom-right, as the call without a mask would be
            rows = torch.arange(Tq, device=query.device)[:, None] + (Tk - Tq)
            listed &= torch.arange(Tk, device=query.device)[None, :] <= rows
        return listed
    if attention_mask.dtype == torch.bool:
        return attention_mask & listed
    return attention_mask.masked_fill(~listed, float("-inf"))


def _padded_keys(attention_mask, key) -> torch.Tensor | None:
    """The keys no query of a sequence sees in HF's bool (B, 1, Tq, Tk) mask (its padding), as
    a key_padding_mask: a padded token's key and value then never reach the output, NaN or
    inf included, on every backend (a dense mask alone excludes by adding -inf, and NaN + -inf
    is NaN), and the kernels skip its tiles. One pass over the mask, on the device."""
    if attention_mask is None or attention_mask.dtype != torch.bool or attention_mask.dim() != 4:
        return None
    if attention_mask.shape[-1] != key.shape[2]:
        return None
    seen = attention_mask.any(dim=2).any(dim=1)  # (B or 1, Tk)
    return (~seen).expand(key.shape[0], key.shape[2])


def _fp8_cache(query, key, value, k_descale, v_descale):
    """The descales of an fp8 cache's storage, checked: both caches fp8 with both descales."""
    if not (fp8.is_fp8(key) and fp8.is_fp8(value)) or k_descale is None or v_descale is None:
        raise ValueError(
            "k_descale and v_descale come with fp8 keys and values (fusedattn's fp8 caches "
            f"pass all four), got key {key.dtype}, value {value.dtype}, k_descale "
            f"{'given' if k_descale is not None else 'None'}, v_descale "
            f"{'given' if v_descale is not None else 'None'}"
        )
    if fp8.is_fp8(query):
        raise ValueError(
            f"the query must be bf16, fp16 or fp32 over an fp8 cache, got {query.dtype}"
        )
    return k_descale, v_descale


def _is_decode_step(query, key, value, attention_mask, dropout, s_aux, backend) -> bool:
    """One new token per sequence, nothing to differentiate, a bool mask (or none), and a
    decode kernel to run it: the step goes to attention_with_kvcache. `auto` takes it on a GPU
    (the Triton decode kernel); on a CPU, and for backend="torch", the dense path's single
    SDPA call is faster than the torch decode backend's gather and masks (CPU generate of a
    tiny Llama: 160 against 291 tokens/s)."""
    if query.shape[2] != 1 or dropout:
        return False
    tensors = (query, key, value, s_aux)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return False
    if not _mask_per_key(attention_mask, key):
        return False
    name = backends.resolve_backend_name(backend)
    if name == "auto":
        return query.is_cuda
    return name != "torch" and name in backends._REGISTRY["attention_with_kvcache"]


def _invariant_prefill(
    query, key, value, attention_mask, dropout, s_aux, causal, window, position_bias
) -> bool:
    """Under fusedattn.batch_invariant, a causal prefill (or any step) of an inference call
    runs the decode kernel too, its key tiles counted from each sequence's first visible key
    (the padding mask's last row): a left-padded prompt then gets the bits of the same
    prompt alone, and prefill and decode share one kernel body. Not with a sliding window
    (the mask's last row is the last query's window only), a position bias or dropout."""
    if not invariance._enabled or not causal or window is not None or dropout:
        return False
    if position_bias is not None or query.shape[2] > key.shape[2]:
        return False
    tensors = (query, key, value, s_aux)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return False
    return _mask_per_key(attention_mask, key)


def _mask_per_key(attention_mask, key) -> bool:
    """No mask, or a bool (B, H, Tq, S) one per cache slot: what the decode kernel reads a
    sequence's visible keys from (a float mask, or one of another length, is not)."""
    return attention_mask is None or (
        attention_mask.dtype == torch.bool and attention_mask.dim() == 4
        and attention_mask.shape[-1] == key.shape[2]
    )  # fmt: skip


def _decode_step(query, key, value, attention_mask, causal, window, variants, descales):
    """A generation step over the whole KV cache HF hands over (dynamic: the keys so far;
    static: max_cache_len slots): the mask's one query row says which positions the token
    sees (left padding, unfilled static slots, a window), so the kernels read each sequence's
    keys from its first visible position to its last and no further: the static cache's
    unused slots are never read. HF's (B, Hkv, S, D) cache is read in place through
    .transpose(1, 2)."""
    visible = None
    if attention_mask is not None:
        # the last query row of head 0; HF's (B, 1, 1, S) decode mask is that row already,
        # and passing it whole costs no view (a padded step's host time, bench_host.py)
        B, H, Tq, S = attention_mask.shape
        if H == 1 and Tq == 1 and query.shape[0] == B and attention_mask.stride(-1) == 1:
            visible = attention_mask  # (B, 1, 1, S), as HF hands it: read in place
        else:
            visible = attention_mask.select(1, 0).select(1, -1).expand(query.shape[0], S)
        # The row is the whole pattern, sliding window included, and a sliding layer's static
        # cache may hold its slots out of position order: no positional rule on top of it.
        window = None
    k_descale, v_descale = (None, None) if descales is None else descales
    out = decode_with_key_mask(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), visible,
        is_causal=causal, window_size=window, k_descale=k_descale, v_descale=v_descale,
        **variants,
    )  # fmt: skip
    return out.contiguous(), None


def _packed(query, key, value, cu_q, cu_k, max_q, max_k, dropout, causal, window, variants):
    """Packed sequences (batch 1, sequences back to back) through varlen_attention."""
    if cu_q is None or cu_k is None or max_q is None or max_k is None:
        raise ValueError(
            "packed sequences need cu_seq_lens_q, cu_seq_lens_k, max_length_q and max_length_k"
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed sequences come as a batch of 1, got {query.shape[0]}")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (total, H, D) views
    out = varlen_attention(
        q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k),
        dropout_p=dropout, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1],
        window_size=window, causal_alignment="bottom_right", **variants,
    )  # fmt: skip
    return out.unsqueeze(0), None


def register(name: str = NAME, *, backend: str = "auto") -> str:
    """Make `attn_implementation=name` available to every transformers model, running
    fusedattn's `backend`; returns name."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(name, functools.partial(attention_forward, backend=backend))
    AttentionMaskInterface.register(name, build_mask)
    REGISTERED.add(name)
    return name
