"""vLLM serving on fusedattn's paged kernels: an attention backend for vLLM's v1 engine.

    pip install "fusedattn[vllm]"          # where vLLM (CUDA or CPU build) is installed
    vllm serve MODEL --attention-backend CUSTOM           # a GPU: vLLM's own switch
    FUSEDATTN_VLLM=1 python -c "from vllm import LLM; ..."  # the CPU (see below)

How it is found: fusedattn's `vllm.general_plugins` entry point (`register` below) runs in
every vLLM process and points vLLM's `CUSTOM` backend name at `FusedAttentionBackend`, which
does nothing until a user asks for it. vLLM's CPU platform never looks at the requested name
(it always answers with its own `CPU_ATTN`), so there `FUSEDATTN_VLLM=1` makes the plugin
point `CPU_ATTN` at fusedattn too. With neither, vLLM runs exactly as without fusedattn.
`FUSEDATTN_VLLM_BACKEND` chooses fusedattn's backend for every call (`auto`, the default;
`triton`, `torch`, `reference`).

What a step runs (vLLM puts the decodes first in the batch, `reorder_batch_threshold = 1`):
- the new keys and values are written into the cache at `slot_mapping` (slots < 0 are
  padding and are skipped); into an fp8 cache as x / descale, saturating (fusedattn.fp8);
- decode requests (one new token): `attention_with_kvcache` over the paged cache, the
  split-key decode kernel;
- everything else — prefills, chunked prefill, prefix-cache hits, a request resumed after
  preemption — `varlen_attention(..., block_table=...)`, the paged prefill: the queries are
  the last keys of their sequence (bottom-right causal alignment), the pages read in place;
- a batch whose metadata is non-causal (`CommonAttentionMetadata.causal = False`: drafters,
  encoder-style layers on the decoder path) runs both with is_causal=False, each query seeing
  every key of its request (the backend declares `supports_non_causal`).
vLLM's KV cache, a (num_blocks, Hkv, block_size, 2 * head_size) tensor per layer in any
physical order vLLM lays out, is read through strided views: keys the first head_size of
each token's row, values the second (the layout of vLLM's Triton backend); no per-step copy.

Taken from vLLM's layer: GQA/MQA, sliding window (vLLM's `sliding_window = w` is
flash-attention's (w - 1, 0)), softcap, ALiBi slopes, sinks (GPT-OSS), the scale, fp8 caches
(`kv_cache_dtype="fp8"`, "fp8_e4m3", "fp8_e5m2") with the layer's per-tensor k/v scales as
descales. Refused when the engine starts (a ValueError naming the reason): encoder or
cross-attention layers, an fp8 query (`--calculate-kv-scales` query quantization), other
quantized caches (int8/int4/nvfp4 per token-head, turboquant), fused output quantization.

`VLLM_BATCH_INVARIANT=1` (vLLM's batch-invariant mode) turns on fusedattn.batch_invariant for
the process when the backend is built: a request's attention then gives the same bits whatever
else is batched with it, however its prompt was chunked (docs/batch_invariance.md). Refused
when the engine starts: FUSEDATTN_VLLM_BACKEND torch or cuda (not batch invariant), and a
device where the Triton kernels cannot run (a CPU without TRITON_INTERPRET=1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

import fusedattn
from fusedattn import invariance
from fusedattn.fp8 import quantize
from fusedattn.ops.core import backends

from . import vllm_mla
from .vllm_common import (
    BACKEND_ENV,
    FP8_CACHE_DTYPES,
    INVARIANT_ENV,
    SELECT_ENV,
    chosen_backend,
    invariance_requested,
)

# Under vLLM's logger: its configuration (handlers, VLLM_LOGGING_LEVEL) reaches only "vllm.*"
logger = init_logger("vllm.plugins.fusedattn")
CLASS_PATH = f"{__name__}.FusedAttentionBackend"


def register() -> None:
    """The `vllm.general_plugins` entry point: `CUSTOM` names fusedattn, `FUSEDATTN_MLA` and the
    CUSTOM MLA prefill slot its MLA backends (vllm_mla.py); with FUSEDATTN_VLLM=1 the
    platform's default backends do too (vLLM's CPU platform)."""
    register_backend(AttentionBackendEnum.CUSTOM, CLASS_PATH)
    vllm_mla.register()
    if os.environ.get(SELECT_ENV, "0") not in ("", "0"):
        enable()


def enable() -> None:
    """Serve every attention layer that vLLM's platform would give its default backend on
    fusedattn: on the CPU, `CPU_ATTN`; elsewhere `--attention-backend CUSTOM` is the switch."""
    register_backend(AttentionBackendEnum.CUSTOM, CLASS_PATH)
    vllm_mla.enable()
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, CLASS_PATH)
    _forget_selections()


def disable() -> None:
    """Undo `enable()` for engines created afterwards (`CUSTOM` stays registered)."""
    AttentionBackendEnum.CPU_ATTN.clear_override()
    vllm_mla.disable()
    _forget_selections()


def _forget_selections() -> None:
    # vLLM caches the class its platform picked per layer configuration (a functools.cache
    # in vllm.v1.attention.selector); a new choice holds only for engines built after this.
    from vllm.v1.attention import selector

    selector._cached_get_attn_backend.cache_clear()


class FusedAttentionBackend(AttentionBackend):
    """vLLM's view of fusedattn: what it takes, and the builder and impl that serve it."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16",
                                                      *FP8_CACHE_DTYPES]  # fmt: skip

    @staticmethod
    def get_name() -> str:
        # The CPU platform asks for CPU_ATTN by name; under that name this class serves it.
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[FusedAttentionImpl]:
        return FusedAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[FusedAttentionMetadataBuilder]:
        return FusedAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]  # the paged kernels take any page size from 1

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # any head size fusedattn takes (its checks refuse the rest, named)

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        # VLLM_BATCH_INVARIANT=1 turns fusedattn.batch_invariant on (FusedAttentionImpl)
        return True

    @classmethod
    def supports_non_causal(cls) -> bool:
        # A batch whose metadata says causal=False (drafters, encoders served through the
        # decoder path) runs non-causal: every query of a request sees all of its keys.
        return True


@dataclass
class FusedAttentionMetadata:
    """One step's batch: decode requests first (query length 1), then the rest."""

    num_actual_tokens: int  # without the padding vLLM adds for its graphs
    num_decodes: int
    num_decode_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # (B + 1,) int32
    seq_lens: torch.Tensor  # (B,) int32: cached keys of each request after this step's rows
    block_table: torch.Tensor  # (B, max_pages) int32
    slot_mapping: torch.Tensor  # (num_tokens,): the cache row of each new token, < 0 padding
    causal: bool  # CommonAttentionMetadata.causal: False = each query sees all its keys
    # The prefills' packed-batch metadata (requests num_decodes..B-1), for varlen_attention.
    prefill_cu_seqlens_q: torch.Tensor | None
    prefill_cu_seqlens_k: torch.Tensor | None


class FusedAttentionMetadataBuilder(AttentionMetadataBuilder[FusedAttentionMetadata]):
    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:  # fmt: skip
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1)  # decodes at the front of the batch
        from vllm.model_executor.layers.attention import Attention

        dtype = vllm_config.model_config.dtype
        for name, layer in get_layers_from_vllm_config(vllm_config, Attention, layer_names).items():
            if isinstance(layer.impl, FusedAttentionImpl):
                layer.impl.rehearse(name, kv_cache_spec.block_size, dtype, device)
        logger.info("fusedattn's vLLM backend serves %d attention layers (fusedattn backend=%s)",
                    len(layer_names), chosen_backend())  # fmt: skip

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> FusedAttentionMetadata:  # fmt: skip
        meta = common_attn_metadata
        if isinstance(meta.causal, torch.Tensor):
            raise ValueError(
                "fusedattn's vLLM backend takes one causal flag per batch; this batch has one "
                "per request (CommonAttentionMetadata.causal is a tensor)"
            )
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            meta, decode_threshold=1
        )
        cu_q = cu_k = None
        if num_prefills:
            starts = meta.query_start_loc[num_decodes:]
            cu_q = (starts - starts[0]).to(torch.int32)
            lens = meta.seq_lens[num_decodes : meta.num_reqs]
            cu_k = torch.zeros(num_prefills + 1, dtype=torch.int32, device=lens.device)
            torch.cumsum(lens, 0, out=cu_k[1:])
        return FusedAttentionMetadata(
            num_actual_tokens=meta.num_actual_tokens,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            query_start_loc=meta.query_start_loc,
            seq_lens=meta.seq_lens,
            block_table=meta.block_table_tensor,
            slot_mapping=meta.slot_mapping,
            causal=bool(meta.causal),
            prefill_cu_seqlens_q=cu_q,
            prefill_cu_seqlens_k=cu_k,
        )


class FusedAttentionImpl(AttentionImpl[FusedAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **unsupported,
    ) -> None:
        refuse = [f"{name}={value!r}" for name, value in unsupported.items()
                  if value not in (None, False, -1)]  # fmt: skip
        if attn_type != AttentionType.DECODER:
            refuse.append(f"attn_type={attn_type!r} (decoder self-attention only)")
        if kv_cache_dtype not in ("auto", "float16", "bfloat16", *FP8_CACHE_DTYPES):
            refuse.append(f"kv_cache_dtype={kv_cache_dtype!r} (auto, float16, bfloat16 and "
                          f"{', '.join(FP8_CACHE_DTYPES)} are read)")  # fmt: skip
        backend = chosen_backend()
        if invariance_requested():
            if backend in ("torch", "cuda"):
                refuse.append(f"{INVARIANT_ENV}=1 with {BACKEND_ENV}={backend} (that backend is "
                              "not batch invariant; triton or auto is)")  # fmt: skip
            else:
                fusedattn.batch_invariant(True)
        if refuse:
            raise ValueError("fusedattn's vLLM backend cannot serve this layer: "
                             + "; ".join(refuse))  # fmt: skip
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.alibi_slopes = (None if alibi_slopes is None
                             else torch.tensor(alibi_slopes, dtype=torch.float32))  # fmt: skip
        self.window_size = None if sliding_window is None else (sliding_window - 1, 0)
        self.softcap = float(logits_soft_cap or 0.0)
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8_dtype = FP8_CACHE_DTYPES.get(kv_cache_dtype)
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        self.backend = backend

    def rehearse(self, name: str, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:  # fmt: skip
        """A decode step and a paged prefill of this layer's configuration on two tokens of a
        one-page cache, when the engine starts: whatever fusedattn refuses (a head size, an
        option the chosen backend lacks; batch invariance where the Triton kernels cannot run)
        fails there, named, and not at the first request."""
        triton_refusals = backends.device_refusals("triton", torch.device(device))
        if invariance.enabled() and triton_refusals:
            raise ValueError(f"fusedattn's vLLM backend cannot serve {name}: {INVARIANT_ENV}=1 "
                             f"needs the Triton kernels: {'; '.join(triton_refusals)}")  # fmt: skip
        cache_dtype = self.fp8_dtype or dtype
        page = torch.zeros(1, block_size, self.num_kv_heads, 2 * self.head_size, device=device)
        kv_cache = page.to(cache_dtype).transpose(1, 2)  # vLLM's (blocks, Hkv, size, 2 D)
        query = torch.zeros(2, self.num_heads, self.head_size, dtype=dtype, device=device)
        output = torch.empty_like(query)
        int32 = dict(dtype=torch.int32, device=device)
        one = torch.ones((), device=device)
        layer = type("Scales", (), dict(_k_scale=one, _v_scale=one))
        meta = FusedAttentionMetadata(
            num_actual_tokens=2, num_decodes=1, num_decode_tokens=1, max_query_len=1,
            max_seq_len=1, query_start_loc=torch.tensor([0, 1, 2], **int32),
            seq_lens=torch.tensor([1, 1], **int32), block_table=torch.zeros(2, 1, **int32),
            slot_mapping=torch.zeros(2, **int32), causal=True,
            prefill_cu_seqlens_q=torch.tensor([0, 1], **int32),
            prefill_cu_seqlens_k=torch.tensor([0, 1], **int32),
        )  # fmt: skip
        try:
            self.forward(layer, query, query, query, kv_cache, meta, output)
        except (ValueError, TypeError, NotImplementedError) as exc:
            raise ValueError(f"fusedattn's vLLM backend cannot serve {name}: {exc}") from exc

    def _caches(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's cache (num_blocks, Hkv, block_size, 2 * D) as the paged (num_blocks,
        block_size, Hkv, D) key and value views fusedattn reads (strides, no copy)."""
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        if self.fp8_dtype is not None and key_cache.dtype != self.fp8_dtype:
            key_cache, value_cache = (
                key_cache.view(self.fp8_dtype),
                value_cache.view(self.fp8_dtype),
            )
        return key_cache, value_cache

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:  # fmt: skip
        if self.kv_sharing_target_layer_name is not None:
            return  # the layer reads another layer's cache, written there
        key_cache, value_cache = self._caches(kv_cache)
        n = slot_mapping.shape[0]
        slots = slot_mapping.to(torch.long)
        keep = slots >= 0  # vLLM pads with -1
        if not bool(keep.all()):
            slots, key, value = slots[keep], key[:n][keep], value[:n][keep]
        else:
            key, value = key[:n], value[:n]
        for cache, rows, descale in ((key_cache, key, layer._k_scale),
                                     (value_cache, value, layer._v_scale)):  # fmt: skip
            block_size = cache.shape[1]
            if self.fp8_dtype is not None:
                rows = quantize(rows, descale.to(rows.device, torch.float32), self.fp8_dtype)
            # The page and row of each slot: the views are strided, so index them as 2-D.
            cache[slots // block_size, slots % block_size] = rows.to(cache.dtype)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: FusedAttentionMetadata | None,
                output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        if output_scale is not None or output_block_scale is not None:
            raise ValueError("fusedattn's vLLM backend does not fuse output quantization")
        if attn_metadata is None:  # vLLM's profiling run: no cache yet
            return output.fill_(0)
        meta = attn_metadata
        n = meta.num_actual_tokens
        q = query[:n].view(n, self.num_heads, self.head_size)
        out = output[:n].view(n, self.num_heads, -1)
        key_cache, value_cache = self._caches(kv_cache)
        common = dict(
            scale=self.scale, window_size=self.window_size, softcap=self.softcap,
            alibi_slopes=self._alibi_slopes_on(q.device), sinks=self.sinks,
            backend=self.backend,
        )  # fmt: skip
        if self.fp8_dtype is not None:
            common.update(k_descale=layer._k_scale.float(), v_descale=layer._v_scale.float())
        nd, ndt = meta.num_decodes, meta.num_decode_tokens
        if nd:
            out[:ndt] = fusedattn.attention_with_kvcache(
                q[:ndt].unsqueeze(1), key_cache, value_cache,
                cache_seqlens=meta.seq_lens[:nd], block_table=meta.block_table[:nd],
                is_causal=meta.causal, **common,
            ).squeeze(1)  # fmt: skip
        if ndt < n:
            out[ndt:] = fusedattn.varlen_attention(
                q[ndt:], key_cache, value_cache, meta.prefill_cu_seqlens_q,
                meta.prefill_cu_seqlens_k, meta.max_query_len, meta.max_seq_len,
                is_causal=meta.causal, enable_gqa=True, causal_alignment="bottom_right",
                block_table=meta.block_table[nd : meta.query_start_loc.shape[0] - 1], **common,
            )  # fmt: skip
        return output

    def _alibi_slopes_on(self, device: torch.device) -> torch.Tensor | None:
        """The slopes (made on the CPU from vLLM's list) moved to the device once."""
        if self.alibi_slopes is not None and self.alibi_slopes.device != device:
            self.alibi_slopes = self.alibi_slopes.to(device)
        return self.alibi_slopes
