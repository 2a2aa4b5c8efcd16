"""attention_with_kvcache as two torch.library custom ops with fake implementations, so that
torch.compile(fullgraph=True) records a decode step whole and CUDA graphs capture it:

- `fusedattn::kvcache_append` writes the new keys and values into the caches in place and
  declares exactly that (mutates_args: k_cache, v_cache), so functionalization can follow the
  write and Inductor re-inplace it (an undeclared mutation made compiled decoding 6x slower
  until Inductor could, pytorch/pytorch#130740);
- `fusedattn::kvcache_attention` reads the caches and returns (out, lse), mutating nothing (the
  Hugging Face integration reads its own cache with it, having appended already).

The value checks (a host read of the lengths and the block table: .tolist()-like, which
dynamo cannot trace) run inside the ops' real implementations, never in the traced Python.
Eager calls skip the dispatcher and run the same steps directly (api.py; `tracing()`
picks, as for every fusedattn op). No `from __future__ import annotations` here: torch.library reads
the signatures' annotations as types.
"""

import torch

from ...checks import check_kvcache_values
from ...fp8 import output_dtype
from ...masks import Window
from ..core import backends
from ..shared.decode_launch import append


def append_impl(k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad,
                check_values: bool, k_descale=None, v_descale=None) -> None:  # fmt: skip
    """The values (when asked), then the append (shared/decode_launch.py: one Triton launch on
    a GPU; an fp8 cache quantized with its descales)."""
    if check_values:
        descales = None if k_descale is None else dict(k_descale=k_descale, v_descale=v_descale)
        check_kvcache_values(cache_seqlens, cache_leftpad, block_table, k_cache, k.shape[1],
                             descales=descales)  # fmt: skip
    append(k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale, v_descale)


@torch.library.custom_op("fusedattn::kvcache_append", mutates_args=("k_cache", "v_cache"))
def kvcache_append(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    check_values: bool,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> None:
    append_impl(k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, check_values,
                k_descale, v_descale)  # fmt: skip


@kvcache_append.register_fake
def _(k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, check_values,
      k_descale=None, v_descale=None):  # fmt: skip
    return None


def attention_impl(q, k_cache, v_cache, seqlens_k, block_table, cache_leftpad, key_mask,
                   alibi_slopes, sinks, scale, window_left, window_right, softcap, num_splits,
                   return_lse, check_values, backend, q_descale=None, k_descale=None,
                   v_descale=None):  # fmt: skip
    """(out (B, Tq, Hq, Dv) contiguous, lse (B, Hq, Tq) fp32, or an empty one without
    return_lse) of the named backend's implementation; the values first when asked (Tnew = 0:
    an append before this call has checked them already)."""
    if check_values:
        descales = None if k_descale is None else dict(q_descale=q_descale, k_descale=k_descale,
                                                       v_descale=v_descale)  # fmt: skip
        check_kvcache_values(seqlens_k, cache_leftpad, block_table, k_cache, 0,
                             descales=descales)  # fmt: skip
    # check_kvcache_args' window exactly (make_window, alibi=False: bottom-right iff bounded)
    window = Window(window_left, window_right, window_left >= 0 or window_right >= 0)
    result = backends._REGISTRY["attention_with_kvcache"][backend].run(
        q=q, k_cache=k_cache, v_cache=v_cache, seqlens_k=seqlens_k, block_table=block_table,
        cache_leftpad=cache_leftpad, key_mask=key_mask, scale=scale, window=window,
        softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, num_splits=num_splits,
        return_lse=return_lse, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
    )  # fmt: skip
    out, lse = result if return_lse else (result, None)
    if lse is None:
        lse = q.new_empty(0, dtype=torch.float32)
    return out.contiguous(), lse  # the fake's layout (torch's SDPA output is transposed)


@torch.library.custom_op("fusedattn::kvcache_attention", mutates_args=())
def kvcache_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seqlens_k: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_leftpad: torch.Tensor | None,
    key_mask: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    scale: float | None,
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int,
    return_lse: bool,
    check_values: bool,
    backend: str,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_impl(
        q, k_cache, v_cache, seqlens_k, block_table, cache_leftpad, key_mask, alibi_slopes,
        sinks, scale, window_left, window_right, softcap, num_splits, return_lse, check_values,
        backend, q_descale, k_descale, v_descale,
    )  # fmt: skip


@kvcache_attention.register_fake
def _(q, k_cache, v_cache, seqlens_k, block_table, cache_leftpad, key_mask, alibi_slopes, sinks,
      scale, window_left, window_right, softcap, num_splits, return_lse, check_values,
      backend, q_descale=None, k_descale=None, v_descale=None):  # fmt: skip
    B, Tq, Hq, _ = q.shape
    out = q.new_empty(B, Tq, Hq, v_cache.shape[-1], dtype=output_dtype(q, None))
    lse = q.new_empty((B, Hq, Tq) if return_lse else (0,), dtype=torch.float32)
    return out, lse


def record(q, k_cache, v_cache, k, v, seqlens, inputs: dict, check_values: bool, backend: str):
    """What attention_with_kvcache runs while torch.compile or jit.trace records: the append
    op (when k, v are given; it checks the values first when asked) and the attention op
    (checking them when no append did). `inputs`: the backend's keyword arguments."""
    if k is not None:
        torch.ops.fusedattn.kvcache_append(
            k_cache, v_cache, k, v, seqlens, inputs["block_table"], inputs["cache_leftpad"],
            check_values, inputs["k_descale"], inputs["v_descale"],
        )  # fmt: skip
        check_values = False
    window = inputs["window"]
    out, lse = torch.ops.fusedattn.kvcache_attention(
        q, k_cache, v_cache, inputs["seqlens_k"], inputs["block_table"], inputs["cache_leftpad"],
        inputs["key_mask"], inputs["alibi_slopes"], inputs["sinks"], inputs["scale"],
        window.left, window.right, inputs["softcap"], inputs["num_splits"],
        inputs["return_lse"], check_values, backend, inputs["q_descale"], inputs["k_descale"],
        inputs["v_descale"],
    )  # fmt: skip
    return (out, lse) if inputs["return_lse"] else out
