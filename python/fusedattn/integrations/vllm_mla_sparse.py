"""vLLM's sparse MLA layers (DeepSeek-V3.2's DeepSeek Sparse Attention, GLM-5) on fusedattn: a
sparse MLA attention backend for vLLM's v1 engine on vLLM 0.32's SparseMLACommonImpl,
registered by the same plugin entry point as the dense backends (vllm.register).

    vllm serve deepseek-ai/DeepSeek-V3.2 --attention-backend FUSEDATTN_MLA_SPARSE \\
        [--kv-cache-dtype fp8_ds_mla]                                 # a GPU

The model's lightning indexer (vLLM's, unchanged) writes each token's top-k keys, as positions
within its request, into the layer's topk_indices_buffer. A step here:
- the new latent rows go into the (num_blocks, block_size, 576) cache at slot_mapping (slots
  < 0 are padding, skipped), into an fp8_ds_mla cache as DeepSeek's 656-byte rows
  (fusedattn.fp8.quantize_mla_ds: 512 e4m3 values, 4 float32 scales, 64 bf16 rope values);
- every token's top-k positions become cache slots through its request's block table
  (`global_slots`: block_table[req, p // block_size] * block_size + p % block_size, -1 kept
  -1 and a position past the table -1, as vLLM's triton_convert_req_index_to_global_index);
- each token (decode, or prefill run as MQA) is one query of `mla_attention_with_kvcache(...,
  indices=)` over exactly the slots listed for it: the Triton kernel's sparse mode reads the
  gathered rows, 656-byte rows dequantized in registers.
The prefill's dense and masked-MHA paths stay SparseMLACommonImpl's (forward_mha, on the MLA
prefill backend fusedattn registers in vllm_mla.py).

vLLM's CPU build refuses sparse attention ("Sparse Attention is not supported on CPU"), so the
engine path runs on a GPU only; tests/vllm_serving/test_vllm_mla_sparse.py checks the pieces
on the CPU (the metadata's token-to-request map, the slot conversion against vLLM's formula,
the cache update in both formats, forward_mqa on vLLM-shaped tensors against float64).
Refused when the engine builds the layer (a ValueError naming it): ALiBi, sliding windows,
softcap, shared KV layers, HiSparse (a host-offloaded cache), decode context parallelism,
cache dtypes other than auto / float16 / bfloat16 / fp8_ds_mla.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.model_executor.layers.attention.sparse_mla_attention import (
    SparseMLACommonImpl,
    SparseMLACommonMetadata,
    SparseMLACommonMetadataBuilder,
)
from vllm.v1.attention.backend import AttentionBackend

import fusedattn
from fusedattn.fp8 import MLA_DS_BYTES, quantize_mla_ds

from .vllm_mla import SPARSE_NAME, LatentBackendTraits, layer_refusals, new_rows

CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8_ds_mla")


def global_slots(req_id: torch.Tensor, block_table: torch.Tensor, positions: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Each token's top-k positions within its request (positions (tokens, topk) int32, -1
    unused) as slots of the paged cache: block_table[req_id[t], p // block_size] * block_size
    + p % block_size; -1 where p < 0 or p // block_size is past the table's width. Returns
    (slots (tokens, topk) int32, valid (tokens,) int32: the listed entries a row has). On the
    device, no sync; one gather of (tokens, topk) entries of the block table."""
    pos = positions.long()
    page = torch.div(pos, block_size, rounding_mode="floor")
    listed = (pos >= 0) & (page < block_table.shape[1])
    rows = req_id.long()[:, None].expand_as(page)
    blocks = block_table[rows, page.clamp(0, block_table.shape[1] - 1)].long()
    slots = torch.where(listed, blocks * block_size + pos % block_size, -1)
    return slots.to(torch.int32), listed.sum(-1, dtype=torch.int32)


def write_rows(kv_c_normed, k_pe, kv_cache, slot_mapping, ds_format: bool) -> None:
    """The new tokens' latent and rope parts into their cache rows (slots < 0: padding,
    skipped): as they are, or as 656-byte fp8_ds_mla rows."""
    if kv_cache.numel() == 0:
        return
    slots, rows = new_rows(kv_c_normed, k_pe, slot_mapping)
    if ds_format:
        kv_cache.view(torch.uint8).view(-1, MLA_DS_BYTES)[slots] = quantize_mla_ds(rows)
    else:
        kv_cache.view(-1, rows.shape[-1])[slots] = rows.to(kv_cache.dtype)


class FusedMLASparseBackend(LatentBackendTraits, AttentionBackend):
    """vLLM's view of fusedattn's sparse MLA decode: what it takes, its metadata builder
    (SparseMLACommonMetadataBuilder) and the impl."""

    supported_kv_cache_dtypes: ClassVar[list[str]] = list(CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return SPARSE_NAME

    @staticmethod
    def get_builder_cls() -> type[FusedMLASparseMetadataBuilder]:
        return FusedMLASparseMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[FusedMLASparseImpl]:
        return FusedMLASparseImpl

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [576]  # 512 latent + 64 rope: the fp8_ds_mla rows' dims, and DeepSeek-V3.2's

    @classmethod
    def is_mla(cls) -> bool:
        return True

    @classmethod
    def is_sparse(cls) -> bool:
        return True

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla,
                             has_sink, use_sparse, use_mm_prefix, device_capability):  # fmt: skip
        if kv_cache_dtype not in (None, *CACHE_DTYPES):
            return f"fusedattn's sparse MLA reads {', '.join(CACHE_DTYPES)} caches"
        return None


@dataclass
class FusedMLASparseMetadata(SparseMLACommonMetadata):
    pass


class FusedMLASparseMetadataBuilder(SparseMLACommonMetadataBuilder[FusedMLASparseMetadata]):
    """vLLM's sparse metadata (the token-to-request map, the block table, the decode/prefill
    split). No full CUDA graphs (vLLM's default, NEVER): the cache update's padding skip is a
    boolean index, a sync where a step has padding; piecewise graphs run around attention."""

    metadata_cls = FusedMLASparseMetadata

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # every token is one query of the sparse kernel: speculative tokens count as decodes
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)


class FusedMLASparseImpl(SparseMLACommonImpl[FusedMLASparseMetadata]):
    """forward_mqa (each token over its top-k slots) and the cache update on fusedattn."""

    can_return_lse_for_decode: bool = False  # no decode context parallelism yet

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
                 **mla_args):  # fmt: skip
        from vllm.config import get_current_vllm_config_or_none

        refuse, backend = layer_refusals(alibi_slopes, sliding_window, logits_soft_cap,
                                         kv_sharing_target_layer_name, kv_cache_dtype,
                                         CACHE_DTYPES)  # fmt: skip
        config = get_current_vllm_config_or_none()
        if config is not None and config.attention_config.hisparse_config is not None:
            refuse.append("hisparse_config (a host-offloaded cache)")
        if config is not None and config.parallel_config.decode_context_parallel_size > 1:
            refuse.append("decode_context_parallel_size > 1")
        if refuse:
            raise ValueError("fusedattn's vLLM sparse MLA backend cannot serve this layer: "
                             + "; ".join(refuse))  # fmt: skip
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                         kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, **mla_args)  # fmt: skip
        self.supports_quant_query_input = False  # the query stays 16-bit over any cache
        self.backend = backend

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        """q (tokens, N, L + P) or the pair (q_nope, q_pe); the cache (num_blocks, block_size,
        576), or 656-byte uint8 rows -> ((tokens, N, L), None): token t attends to the slots
        its top-k positions name in its request's pages, no other key."""
        parts = q if isinstance(q, tuple) else (q,)
        tokens = parts[0].shape[0]
        positions = self.topk_indices_buffer[:tokens]
        slots, _ = global_slots(attn_metadata.req_id_per_token[:tokens],
                                attn_metadata.block_table, positions,
                                attn_metadata.block_size)  # fmt: skip
        return self.attend(parts, kv_c_and_k_pe_cache, slots), None

    def attend(self, parts, cache, slots):
        """parts: (q,) or (q_nope, q_pe), (tokens, N, D) each; slots (tokens, topk) int32 cache
        rows (-1 unused) -> (tokens, N, kv_lora_rank): each token one query of the sparse MLA
        decode (the cache's own page numbering: the block table only says "paged")."""
        tokens, heads = parts[0].shape[:2]
        query = tuple(p.reshape(tokens, 1, heads, p.shape[-1]) for p in parts)
        if cache.dtype != torch.uint8 and cache.element_size() == 1:
            cache = cache.view(torch.uint8)  # fp8_ds_mla rows held as another 1-byte type
        table = torch.zeros(tokens, 1, dtype=torch.int32, device=slots.device)
        out = fusedattn.mla_attention_with_kvcache(
            query if len(query) == 2 else query[0], cache, cache_seqlens=table[:, 0],
            block_table=table, head_dim_v=self.kv_lora_rank, scale=self.scale,
            indices=slots.view(tokens, 1, -1), backend=self.backend,
        )  # fmt: skip
        return out.view(tokens, heads, self.kv_lora_rank)

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype,
                           k_scale) -> None:  # fmt: skip
        write_rows(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype == "fp8_ds_mla")
