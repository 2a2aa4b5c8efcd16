"""vLLM's MLA layers (DeepSeek-V2/V3, Kimi K2, GLM) on fusedattn: an MLA attention backend and
an MLA prefill backend for vLLM's v1 engine, registered by the same plugin entry point as the
dense backend (fusedattn.integrations.vllm.register).

    vllm serve DEEPSEEK_MODEL --attention-backend FUSEDATTN_MLA \\
        --attention-config '{"mla_prefill_backend": "CUSTOM"}'     # a GPU
    FUSEDATTN_VLLM=1 python -c "from vllm import LLM; ..."          # vLLM's CPU build

What a step runs (vLLM's MLA scaffolding, MLACommonImpl, orchestrates it):
- the new latent rows (kv_c_normed, k_pe) are written into the (num_blocks, block_size, 576)
  cache at slot_mapping (slots < 0 are padding and are skipped); into an fp8 cache as x /
  k_scale, saturating (fusedattn.fp8);
- decode tokens (the absorbed queries, 512 + 64 wide): `mla_attention_with_kvcache` over the
  paged latent cache (the Triton latent kernel on a GPU), a uniform block of q_len > 1 per
  request as Tq queries bottom-right;
- prefill tokens (the non-absorbed q, k of 192 and v of 128): `varlen_attention`, causal for
  the new tokens and with its lse for each earlier context chunk, which vLLM merges.
On vLLM's CPU platform, FUSEDATTN_VLLM=1 points CPU_MLA and AMX_MLA at the MLA backend and
the CPU MLA prefill backends (CPU, ZEN_CPU) at the prefill backend, so no MLA layer runs on
vLLM's own attention. FUSEDATTN_VLLM_BACKEND picks fusedattn's backend as for the dense layers.
Refused when the engine starts (a ValueError naming it): ALiBi, sliding windows, softcap,
encoder layers, shared KV layers, cache dtypes other than auto / float16 / bfloat16 / fp8 /
fp8_e4m3 / fp8_e5m2 (fp8_ds_mla: the sparse backend, FUSEDATTN_MLA_SPARSE in vllm_mla_sparse.py).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonImpl,
    MLACommonMetadata,
)
from vllm.platforms import current_platform
from vllm.v1.attention.backend import AttentionType, MultipleOf
from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend
from vllm.v1.attention.backends.mla.prefill.registry import (
    MLAPrefillBackendEnum,
    register_mla_prefill_backend,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

import fusedattn
from fusedattn.fp8 import quantize

from .vllm_common import FP8_CACHE_DTYPES, chosen_backend, invariance_requested

NAME = "FUSEDATTN_MLA"
CLASS_PATH = f"{__name__}.FusedMLABackend"
PREFILL_PATH = f"{__name__}.FusedMLAPrefillBackend"
# DeepSeek sparse attention's backend (vllm_mla_sparse.py, imported by vLLM when selected)
SPARSE_NAME = "FUSEDATTN_MLA_SPARSE"
SPARSE_PATH = f"{__package__}.vllm_mla_sparse.FusedMLASparseBackend"
CACHE_DTYPES = ("auto", "float16", "bfloat16", *FP8_CACHE_DTYPES)


def register() -> None:
    """`FUSEDATTN_MLA` and `FUSEDATTN_MLA_SPARSE` (backend names of their own) and the CUSTOM
    MLA prefill slot name fusedattn; does nothing else until asked (enable)."""
    for name, path in ((NAME, CLASS_PATH), (SPARSE_NAME, SPARSE_PATH)):
        if name in AttentionBackendEnum.__members__:
            register_backend(AttentionBackendEnum[name], path)
        else:
            register_backend(name, path)
    register_mla_prefill_backend(MLAPrefillBackendEnum.CUSTOM, PREFILL_PATH)


def enable() -> None:
    """Serve vLLM's MLA layers on fusedattn where its platform would run its own: on the CPU,
    CPU_MLA and AMX_MLA, and the CPU MLA prefill backends."""
    register()
    if current_platform.is_cpu():
        for name in ("CPU_MLA", "AMX_MLA"):
            register_backend(AttentionBackendEnum[name], CLASS_PATH)
        for name in ("CPU", "ZEN_CPU"):
            register_mla_prefill_backend(MLAPrefillBackendEnum[name], PREFILL_PATH)


def disable() -> None:
    """Undo enable() for engines built afterwards."""
    for name in ("CPU_MLA", "AMX_MLA"):
        AttentionBackendEnum[name].clear_override()
    for name in ("CPU", "ZEN_CPU"):
        MLAPrefillBackendEnum[name].clear_override()
    from vllm.v1.attention.backends.mla.prefill import selector

    selector._auto_select_mla_prefill_backend.cache_clear()


class LatentBackendTraits:
    """What fusedattn's two MLA backends (this dense one, vllm_mla_sparse's) declare alike."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]  # any page size from 1

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return True

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return True  # keys split at fixed positions (entries) under fusedattn.batch_invariant

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return True  # wherever Triton runs (the CUDA C++ backend has no MLA kernel)


def layer_refusals(alibi_slopes, sliding_window, logits_soft_cap, kv_sharing_target_layer_name,
                   kv_cache_dtype, cache_dtypes) -> tuple[list[str], str]:  # fmt: skip
    """(what an MLA layer asks that fusedattn's MLA backends do not serve, the fusedattn
    backend the calls take); vLLM's batch-invariant mode turns fusedattn's switch on."""
    refuse = [name for name, value in (("alibi_slopes", alibi_slopes),
                                       ("sliding_window", sliding_window),
                                       ("logits_soft_cap", logits_soft_cap),
                                       ("kv_sharing_target_layer_name",
                                        kv_sharing_target_layer_name)) if value]  # fmt: skip
    if kv_cache_dtype not in cache_dtypes:
        refuse.append(f"kv_cache_dtype={kv_cache_dtype!r} (reads {', '.join(cache_dtypes)})")
    backend = chosen_backend()
    if invariance_requested():
        if backend in ("torch", "cuda"):
            refuse.append(f"VLLM_BATCH_INVARIANT=1 with FUSEDATTN_VLLM_BACKEND={backend}")
        else:
            fusedattn.batch_invariant(True)
    return refuse, backend


class FusedMLABackend(LatentBackendTraits, MLACommonBackend):
    """vLLM's view of fusedattn's MLA decode: what it takes, and the impl that serves it (the
    metadata builder is vLLM's MLACommonMetadataBuilder)."""

    supported_kv_cache_dtypes: ClassVar[list[str]] = list(CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return NAME

    @staticmethod
    def get_impl_cls() -> type[FusedMLAImpl]:
        return FusedMLAImpl

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any latent + rope width the kernels take (their checks name the rest)


class FusedMLAImpl(MLACommonImpl[MLACommonMetadata]):
    """forward_mqa (decode over the latent cache) and the cache update on fusedattn; the
    non-absorbed prefill is MLACommonImpl's forward_mha over the prefill backend below."""

    can_return_lse_for_decode: bool = False  # no decode context parallelism yet

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
                 **mla_args):  # fmt: skip
        refuse, backend = layer_refusals(alibi_slopes, sliding_window, logits_soft_cap,
                                         kv_sharing_target_layer_name, kv_cache_dtype,
                                         CACHE_DTYPES)  # fmt: skip
        if attn_type != AttentionType.DECODER:
            refuse.append(f"attn_type={attn_type!r} (decoder self-attention only)")
        if refuse:
            raise ValueError("fusedattn's vLLM MLA backend cannot serve this layer: "
                             + "; ".join(refuse))  # fmt: skip
        if current_platform.is_cpu():
            # MLACommonImpl.__init__ picks a GPU prefill kernel and raises on a CPU; vLLM's own
            # CPU backend sets the attributes the scaffolding reads without it: the same here
            from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

            CPUMLAImpl.__init__(self, num_heads, head_size, scale, num_kv_heads, None, None,
                                kv_cache_dtype, None, attn_type, None, **mla_args)  # fmt: skip
        else:
            super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                             sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                             kv_sharing_target_layer_name, **mla_args)  # fmt: skip
        self.supports_quant_query_input = False  # an fp8 cache is read with 16-bit queries
        self.fp8_dtype = FP8_CACHE_DTYPES.get(kv_cache_dtype)
        self.backend = backend

    def forward_mqa(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        """The absorbed decode: q (tokens, N, L + P) or the pair (q_nope, q_pe), the cache
        (num_blocks, block_size, L + P) -> ((tokens, N, L), None); a uniform block of Tq
        tokens per request runs as Tq queries bottom-right of its keys, causal unless the
        batch's metadata says otherwise (a non-causal draft block)."""
        decode = attn_metadata.decode
        seq_lens, table = decode.seq_lens, decode.block_table
        parts = q if isinstance(q, tuple) else (q,)
        tokens, heads = parts[0].shape[:2]
        B = seq_lens.shape[0]
        Tq, rest = divmod(tokens, B) if B else (1, 0)
        if rest:
            raise ValueError(f"fusedattn's MLA decode takes a uniform block of queries per "
                             f"request, got {tokens} rows over {B} requests")  # fmt: skip
        query = tuple(p.view(B, Tq, heads, p.shape[-1]) for p in parts)
        cache = kv_c_and_k_pe_cache
        descale = None
        if self.fp8_dtype is not None:
            if cache.dtype != self.fp8_dtype:
                cache = cache.view(self.fp8_dtype)
            descale = layer._k_scale.float().reshape(1)
        out = fusedattn.mla_attention_with_kvcache(
            query if len(query) == 2 else query[0], cache, cache_seqlens=seq_lens.int(),
            block_table=table.int(), head_dim_v=self.kv_lora_rank, scale=self.scale,
            is_causal=Tq > 1 and bool(getattr(attn_metadata, "causal", True)),
            kv_descale=descale, backend=self.backend,
        )  # fmt: skip
        return out.view(tokens, heads, self.kv_lora_rank), None

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype,
                           k_scale) -> None:  # fmt: skip
        """Each new token's latent and rope parts into its cache row (slots < 0: padding,
        skipped); an fp8 cache takes x / k_scale rounded and saturating."""
        if kv_cache.numel() == 0:
            return
        slots, rows = new_rows(kv_c_normed, k_pe, slot_mapping)
        flat = kv_cache.view(-1, rows.shape[-1])
        if self.fp8_dtype is not None:
            values = quantize(rows, k_scale.to(rows.device, torch.float32).reshape(1),
                              self.fp8_dtype)  # fmt: skip
            flat.view(torch.uint8)[slots] = values.view(torch.uint8)
        else:
            flat[slots] = rows.to(flat.dtype)


def new_rows(kv_c_normed, k_pe, slot_mapping) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots, rows): each new token's cache row (its latent then its rope part) and slot,
    padding slots (< 0) left out: `bool(keep.all())` is a sync on a GPU, as the boolean index
    where a slot is padding."""
    rows = torch.cat([kv_c_normed, k_pe.reshape(k_pe.shape[0], -1)], dim=-1)
    slots = slot_mapping.flatten().to(torch.long)
    keep = slots >= 0
    if not bool(keep.all()):
        return slots[keep], rows[: keep.shape[0]][keep]
    return slots, rows[: slots.shape[0]]


class FusedMLAPrefillBackend(MLAPrefillBackend):
    """vLLM's MLA prefill (the non-absorbed q, k, v) on `varlen_attention`: the new tokens
    causal, each earlier context chunk non-causal with the lse vLLM merges them by."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]

    @staticmethod
    def get_name() -> str:
        return "FUSEDATTN_MLA_PREFILL"

    def supports_out(self) -> bool:
        return False

    def _varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, return_lse):
        """(out (total_q, Hq, Dv), lse (Hq, total_q): the layout vLLM's merge reads)."""
        return fusedattn.varlen_attention(
            q, k, v, cu_q.int(), cu_k.int(), int(max_q), int(max_k), is_causal=causal,
            scale=self.scale, enable_gqa=q.shape[1] != k.shape[1],
            causal_alignment="bottom_right", return_lse=return_lse, backend=chosen_backend(),
        )  # fmt: skip

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse, out=None, output_scale=None):
        if output_scale is not None:
            raise ValueError("fusedattn's MLA prefill does not fuse output quantization")
        meta = self._prefill_metadata
        starts = meta.query_start_loc
        return self._varlen(q, k, v, starts, starts, meta.max_query_len, meta.max_query_len,
                            True, return_softmax_lse)  # fmt: skip

    def run_prefill_context_chunk(self, chunk, q, k, v, out=None):
        if out is not None:
            raise ValueError("fusedattn's MLA prefill writes no caller buffer (supports_out)")
        return self._varlen(q, k, v, chunk.query_start_loc, chunk.cu_seq_lens,
                            chunk.max_query_len, chunk.max_seq_len, False, True)  # fmt: skip
