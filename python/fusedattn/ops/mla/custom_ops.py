"""mla_attention_with_kvcache as two torch.library custom ops with fake implementations, so
that torch.compile(fullgraph=True) records a step whole and CUDA graphs capture it, as
KV-cache decoding's (decode/custom_ops.py): `fusedattn::mla_append` writes the new latent rows
into the cache in place and declares it (mutates_args: kv_cache); `fusedattn::mla_attention`
reads the cache. The value checks (a host read) run inside their real implementations. No
`from __future__ import annotations`: torch.library reads the annotations as types.
"""

import torch

from ...checks import check_kvcache_values
from ...fp8 import is_mla_ds
from ...mla_checks import check_slot_values
from ...reference.mla import append_latent
from ..core import backends
from ..shared.decode_launch import append


def append_impl(kv_cache, kv_c, k_pe, seqlens, block_table, kv_descale, check_values) -> None:
    """The values (when asked), then the append: on a GPU with Triton one launch of the decode
    kernels' append (the latent and rope columns as the K and V parts of one cache row), else
    torch's indexed writes (reference.mla.append_latent)."""
    if check_values:
        check_kvcache_values(seqlens, None, block_table, kv_cache, kv_c.shape[1],
                             descales=dict(kv_descale=kv_descale))  # fmt: skip
    if not (kv_cache.is_cuda and backends.TRITON_INSTALLED) or is_mla_ds(kv_cache):
        append_latent(kv_cache, kv_c, k_pe, seqlens, block_table, kv_descale)
        return
    Dl = kv_c.shape[-1]
    rope = k_pe if k_pe is not None else kv_c[..., :0]
    append(kv_cache[..., :Dl], kv_cache[..., Dl:], kv_c[:, :, None], rope[:, :, None], seqlens,
           block_table, kv_descale, kv_descale)  # fmt: skip


@torch.library.custom_op("fusedattn::mla_append", mutates_args=("kv_cache",))
def mla_append(
    kv_cache: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor | None,
    seqlens: torch.Tensor,
    block_table: torch.Tensor | None,
    kv_descale: torch.Tensor | None,
    check_values: bool,
) -> None:
    append_impl(kv_cache, kv_c, k_pe, seqlens, block_table, kv_descale, check_values)


@mla_append.register_fake
def _(kv_cache, kv_c, k_pe, seqlens, block_table, kv_descale, check_values):
    return None


def attention_impl(q, q_pe, kv_cache, seqlens_k, block_table, sinks, kv_descale, indices, Dv,
                   Dr, scale, is_causal, num_splits, return_lse, check_values, backend):  # fmt: skip
    """(out (B, Tq, Hq, Dv) contiguous, lse (B, Hq, Tq), or an empty one without return_lse) of
    the named backend; indices: a sparse call's slots (reference.mla.sparse_slots's)."""
    if check_values:
        check_kvcache_values(seqlens_k, None, block_table, kv_cache, 0,
                             descales=dict(kv_descale=kv_descale))  # fmt: skip
        if indices is not None:
            check_slot_values(indices, seqlens_k, block_table, kv_cache)
    sparse = {} if indices is None else dict(indices=indices)
    result = backends._REGISTRY["mla_attention_with_kvcache"][backend].run(
        q=q, q_pe=q_pe, kv_cache=kv_cache, seqlens_k=seqlens_k, block_table=block_table,
        Dv=Dv, Dr=Dr, scale=scale, is_causal=is_causal, sinks=sinks, num_splits=num_splits,
        return_lse=return_lse, kv_descale=kv_descale, **sparse,
    )  # fmt: skip
    out, lse = result if return_lse else (result, None)
    if lse is None:
        lse = q.new_empty(0, dtype=torch.float32)
    return out.contiguous(), lse


@torch.library.custom_op("fusedattn::mla_attention", mutates_args=())
def mla_attention(
    q: torch.Tensor,
    q_pe: torch.Tensor | None,
    kv_cache: torch.Tensor,
    seqlens_k: torch.Tensor,
    block_table: torch.Tensor | None,
    sinks: torch.Tensor | None,
    kv_descale: torch.Tensor | None,
    indices: torch.Tensor | None,
    Dv: int,
    Dr: int,
    scale: float | None,
    is_causal: bool,
    num_splits: int,
    return_lse: bool,
    check_values: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return attention_impl(q, q_pe, kv_cache, seqlens_k, block_table, sinks, kv_descale, indices,
                          Dv, Dr, scale, is_causal, num_splits, return_lse, check_values, backend)  # fmt: skip


@mla_attention.register_fake
def _(q, q_pe, kv_cache, seqlens_k, block_table, sinks, kv_descale, indices, Dv, Dr, scale,
      is_causal, num_splits, return_lse, check_values, backend):  # fmt: skip
    B, Tq, Hq = q.shape[:3]
    out = q.new_empty(B, Tq, Hq, Dv)
    lse = q.new_empty((B, Hq, Tq) if return_lse else (0,), dtype=torch.float32)
    return out, lse
