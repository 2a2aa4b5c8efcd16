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
Eager calls skip the dispatcher and run the same steps directly (ops/decode.py; `tracing()`
picks, as for every fusedattn op). No `from __future__ import annotations` here: torch.library reads
the signatures' annotations as types.
"""

from typing import Optional

import torch

from ..checks import check_kvcache_values
from ..masks import Window
from . import backends


def append_impl(k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad,
                check_values: bool) -> None:  # fmt: skip
    """The values (when asked), then the append (ops/decode.py: one Triton launch on a GPU)."""
    from .decode import append

    if check_values:
        check_kvcache_values(cache_seqlens, cache_leftpad, block_table, k_cache, k.shape[1])
    append(k_cache, v_cache, k, v, cache_seqlens, block_table)


@torch.library.custom_op("fusedattn::kvcache_append", mutates_args=("k_cache", "v_cache"))
def kvcache_append(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache_seqlens: torch.Tensor,
    block_table: Optional[torch.Tensor],
    cache_leftpad: Optional[torch.Tensor],
    check_values: bool,
) -> None:
    append_impl(k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, check_values)


@kvcache_append.register_fake
def _(k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, check_values):
    return None


def attention_impl(q, k_cache, v_cache, seqlens_k, block_table, cache_leftpad, key_mask,
                   alibi_slopes, sinks, scale, window_left, window_right, softcap, num_splits,
                   return_lse, check_values, backend):  # fmt: skip
    """(out (B, Tq, Hq, Dv) contiguous, lse (B, Hq, Tq) fp32, or an empty one without
    return_lse) of the named backend's implementation; the values first when asked (Tnew = 0:
    an append before this call has checked them already)."""
    if check_values:
        check_kvcache_values(seqlens_k, cache_leftpad, block_table, k_cache, 0)
    # check_kvcache_args' window exactly (make_window, alibi=False: bottom-right iff bounded)
    window = Window(window_left, window_right, window_left >= 0 or window_right >= 0)
    result = backends._REGISTRY["attention_with_kvcache"][backend].run(
        q=q, k_cache=k_cache, v_cache=v_cache, seqlens_k=seqlens_k, block_table=block_table,
        cache_leftpad=cache_leftpad, key_mask=key_mask, scale=scale, window=window,
        softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks, num_splits=num_splits,
        return_lse=return_lse,
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
    block_table: Optional[torch.Tensor],
    cache_leftpad: Optional[torch.Tensor],
    key_mask: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor],
    scale: Optional[float],
    window_left: int,
    window_right: int,
    softcap: float,
    num_splits: int,
    return_lse: bool,
    check_values: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_impl(
        q, k_cache, v_cache, seqlens_k, block_table, cache_leftpad, key_mask, alibi_slopes,
        sinks, scale, window_left, window_right, softcap, num_splits, return_lse, check_values,
        backend,
    )  # fmt: skip


@kvcache_attention.register_fake
def _(q, k_cache, v_cache, seqlens_k, block_table, cache_leftpad, key_mask, alibi_slopes, sinks,
      scale, window_left, window_right, softcap, num_splits, return_lse, check_values,
      backend):  # fmt: skip
    B, Tq, Hq, _ = q.shape
    out = q.new_empty(B, Tq, Hq, v_cache.shape[-1])
    lse = q.new_empty((B, Hq, Tq) if return_lse else (0,), dtype=torch.float32)
    return out, lse


def record(q, k_cache, v_cache, k, v, seqlens, inputs: dict, check_values: bool, backend: str):
    """What attention_with_kvcache runs while torch.compile or jit.trace records: the append
    op (when k, v are given; it checks the values first when asked) and the attention op
    (checking them when no append did). `inputs`: the backend's keyword arguments."""
    if k is not None:
        torch.ops.fusedattn.kvcache_append(
            k_cache, v_cache, k, v, seqlens, inputs["block_table"], inputs["cache_leftpad"],
            check_values,
        )  # fmt: skip
        check_values = False
    window = inputs["window"]
    out, lse = torch.ops.fusedattn.kvcache_attention(
        q, k_cache, v_cache, inputs["seqlens_k"], inputs["block_table"], inputs["cache_leftpad"],
        inputs["key_mask"], inputs["alibi_slopes"], inputs["sinks"], inputs["scale"],
        window.left, window.right, inputs["softcap"], inputs["num_splits"],
        inputs["return_lse"], check_values, backend,
    )  # fmt: skip
    return (out, lse) if inputs["return_lse"] else out


@torch.library.custom_op("fusedattn::paged_varlen_attention", mutates_args=())
def paged_varlen_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    block_table: torch.Tensor,
    alibi_slopes: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: Optional[float],
    window_left: int,
    window_right: int,
    bottom_right: bool,
    softcap: float,
    return_lse: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """varlen_attention over a paged cache (inference only): (out (total_q, Hq, Dv), lse
    (Hq, total_q) fp32 or empty) of the named backend; the reference and torch backends check
    the values inside, as in eager calls. bottom_right is the window's own (masks.make_window
    also keeps it for ALiBi without a window, so it is not derived from the bounds here)."""
    window = Window(window_left, window_right, bottom_right)
    result = backends._REGISTRY["varlen_attention"][backend].run(
        q=q, k=k_cache, v=v_cache, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=0.0, scale=scale,
        window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
        return_lse=return_lse, block_table=block_table,
    )  # fmt: skip
    out, lse = result if return_lse else (result, q.new_empty(0, dtype=torch.float32))
    return out.contiguous(), lse


@paged_varlen_attention.register_fake
def _(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, sinks,
      max_seqlen_q, max_seqlen_k, scale, window_left, window_right, bottom_right, softcap,
      return_lse, backend):  # fmt: skip
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    lse = q.new_empty((q.shape[1], q.shape[0]) if return_lse else (0,), dtype=torch.float32)
    return out, lse


def record_paged_varlen(inputs: dict, backend: str):
    """What varlen_attention with a block table runs while torch.compile records."""
    window = inputs["window"]
    out, lse = torch.ops.fusedattn.paged_varlen_attention(
        inputs["q"], inputs["k"], inputs["v"], inputs["cu_seqlens_q"], inputs["cu_seqlens_k"],
        inputs["block_table"], inputs["alibi_slopes"], inputs["sinks"], inputs["max_seqlen_q"],
        inputs["max_seqlen_k"], inputs["scale"], window.left, window.right, window.bottom_right,
        inputs["softcap"], inputs["return_lse"], backend,
    )  # fmt: skip
    return (out, lse) if inputs["return_lse"] else out
