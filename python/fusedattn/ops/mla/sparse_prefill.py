"""`fusedattn.mla_sparse_attention`: DeepSeek sparse attention's prefill (FlashMLA's
`flash_mla_sparse_fwd` contract, forward only): each of Sq queries attends to the keys its
row of indices lists, over one latent KV buffer. It runs as the sparse decode does (one
sequence whose Sq queries each have their own keys: mla_attention_with_kvcache with a
contiguous cache and indices), so every backend, check and kernel is that call's.
"""

from __future__ import annotations

import torch

from ...checks import check_tensor, shape_str
from .api import mla_attention_with_kvcache


def mla_sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    *,
    scale: float | None = None,
    head_dim_v: int = 512,
    sinks: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
):
    """q (Sq, Hq, D) (DeepSeek: D = 576, the absorbed queries), kv (Skv, 1, D) or (Skv, D)
    one latent row per key, indices (Sq, 1, topk) or (Sq, topk) int32: the keys (rows of kv)
    query i attends to, -1 unused, a duplicate once; topk_length (Sq,) int32 each query's
    valid prefix. scale defaults to D ** -0.5; sinks (Hq,) as in `attention`. Returns out
    (Sq, Hq, head_dim_v) in q's dtype [, lse (Sq, Hq) float32, -inf for a query that lists no
    key (its sink with sinks)]. Inference only; an index past Skv raises where values are
    checked (the CPU always, a GPU with FUSEDATTN_CHECK_VALUES=1)."""
    check_tensor("q", q, dims=3, layout="(Sq, Hq, D)")
    check_tensor("kv", kv, layout="(Skv, 1, D) or (Skv, D)")
    check_tensor("indices", indices, layout="(Sq, 1, topk) or (Sq, topk) int32")
    Sq = q.shape[0]
    if kv.dim() == 2:
        kv = kv[:, None]
    if kv.dim() != 3 or kv.shape[1] != 1:
        raise ValueError(f"kv must be (Skv, 1, D) or (Skv, D) (one latent head), got "
                         f"{shape_str(kv.shape)}")  # fmt: skip
    if indices.dim() == 3:
        if indices.shape[1] != 1:
            raise ValueError(f"indices must be (Sq, 1, topk) (one KV head) or (Sq, topk), got "
                             f"{shape_str(indices.shape)}")  # fmt: skip
        indices = indices[:, 0]
    if indices.dim() != 2 or indices.shape[0] != Sq:
        raise ValueError(f"indices must be (Sq, topk) with Sq = {Sq}, got "
                         f"{shape_str(indices.shape)}")  # fmt: skip
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dims=1, layout=f"(Sq,) = ({Sq},) int32")
        if topk_length.dtype != torch.int32 or topk_length.shape[0] != Sq:
            raise ValueError(f"topk_length must be int32 of shape (Sq,) = ({Sq},), got "
                             f"{topk_length.dtype} {shape_str(topk_length.shape)}")  # fmt: skip
        if topk_length.device != indices.device:
            raise ValueError(f"topk_length must be on {indices.device}, got {topk_length.device}")
        listed = torch.arange(indices.shape[1], device=indices.device) < topk_length[:, None]
        indices = torch.where(listed, indices, -1)  # per query (the decode's is per sequence)
    lengths = torch.full((1,), kv.shape[0], dtype=torch.int32, device=q.device)
    result = mla_attention_with_kvcache(
        q[None], kv[None], cache_seqlens=lengths, head_dim_v=head_dim_v, scale=scale,
        sinks=sinks, indices=indices[None], return_lse=return_lse, backend=backend,
    )  # fmt: skip
    if not return_lse:
        return result[0]
    out, lse = result
    return out[0], lse[0].transpose(0, 1)
