"""fusedattn's vLLM sparse MLA backend (DeepSeek Sparse Attention, vllm_mla_sparse.py), piece by
piece on vLLM's CPU build: vLLM refuses sparse attention on a CPU ("Sparse Attention is not
supported on CPU"), so no engine serves it here; the engine path needs a GPU.

- the registration: FUSEDATTN_MLA_SPARSE names the backend, an MLA and sparse one, declared
  for bf16 and fp8_ds_mla caches;
- the metadata: vLLM's own SparseMLACommonMetadata (our subclass) carries what forward_mqa reads;
- the slot conversion against vLLM's formula (triton_convert_req_index_to_global_index's
  docstring; the kernel itself does not run on vLLM's CPU build);
- the cache update, bf16 rows and 656-byte fp8_ds_mla rows, padding slots skipped;
- forward_mqa on vLLM-shaped tensors (the paged 576-wide cache, the layer's top-k buffer of
  request positions, shuffled block tables) against float64 over exactly the listed keys, on
  the reference backend and the Triton kernel (the interpreter).
"""

from __future__ import annotations

import pytest
import torch
from dispatch_probe import count_dispatches
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from fusedattn.fp8 import dequantize_mla_ds, quantize_mla_ds
from fusedattn.integrations import vllm as fused_vllm
from fusedattn.integrations import vllm_mla, vllm_mla_sparse

L, P = 512, 64  # DeepSeek-V3.2's latent and rope widths


def test_the_backend_is_registered_by_name_as_a_sparse_mla_backend():
    fused_vllm.register()
    backend = AttentionBackendEnum[vllm_mla.SPARSE_NAME].get_class()
    assert backend is vllm_mla_sparse.FusedMLASparseBackend
    assert backend.get_name() == "FUSEDATTN_MLA_SPARSE"
    assert backend.is_mla() and backend.is_sparse()
    assert {"bfloat16", "fp8_ds_mla"} <= set(backend.supported_kv_cache_dtypes)
    assert backend.get_builder_cls().metadata_cls is vllm_mla_sparse.FusedMLASparseMetadata
    refusal = backend.supports_combination(576, torch.bfloat16, "fp8_e5m2", 64, True, False, True,
                                           False, None)  # fmt: skip
    assert refusal and "fp8_ds_mla" in refusal
    assert backend.supports_combination(576, torch.bfloat16, "fp8_ds_mla", 64, True, False, True,
                                        False, None) is None  # fmt: skip


def brute_slots(req_id, block_table, positions, block_size):
    """vLLM's formula, one entry at a time."""
    out = torch.full_like(positions, -1)
    for t in range(positions.shape[0]):
        for i in range(positions.shape[1]):
            p = int(positions[t, i])
            if p >= 0 and p // block_size < block_table.shape[1]:
                block = int(block_table[int(req_id[t]), p // block_size])
                out[t, i] = block * block_size + p % block_size
    return out


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_the_slot_conversion_is_vllms_formula(block_size):
    g = torch.Generator().manual_seed(block_size)
    table = torch.randperm(40, generator=g)[:12].view(3, 4).to(torch.int32)
    req_id = torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32)
    positions = torch.randint(-1, 5 * block_size, (5, 9), generator=g, dtype=torch.int32)
    slots, valid = vllm_mla_sparse.global_slots(req_id, table, positions, block_size)
    want = brute_slots(req_id, table, positions, block_size)
    assert slots.dtype == torch.int32 and torch.equal(slots, want)
    assert torch.equal(valid, (want >= 0).sum(-1, dtype=torch.int32))
    assert (positions >= 4 * block_size).any()  # a position past the table: -1, as vLLM's


@pytest.mark.parametrize("ds_format", [False, True], ids=["bf16", "fp8_ds_mla"])
def test_the_cache_update_writes_rows_and_skips_padding(ds_format):
    g = torch.Generator().manual_seed(1)
    kv_c, k_pe = torch.randn(3, L, generator=g), torch.randn(3, 1, P, generator=g)
    slots = torch.tensor([5, -1, 17])
    if ds_format:
        cache = torch.zeros(4, 8, 656, dtype=torch.uint8)
        want = quantize_mla_ds(torch.cat([kv_c, k_pe[:, 0]], -1))
    else:
        cache = torch.zeros(4, 8, L + P, dtype=torch.bfloat16)
        want = torch.cat([kv_c, k_pe[:, 0]], -1).bfloat16()
    impl = object.__new__(vllm_mla_sparse.FusedMLASparseImpl)
    impl.do_kv_cache_update(kv_c, k_pe, cache, slots, "fp8_ds_mla" if ds_format else "auto",
                            torch.tensor(1.0))  # fmt: skip
    flat = cache.view(-1, cache.shape[-1])
    assert torch.equal(flat[5], want[0]) and torch.equal(flat[17], want[2])
    assert int((flat != 0).any(-1).sum()) == 2  # the padding slot wrote nothing


def metadata(req_id, block_table, block_size):
    """vLLM's own metadata class (our subclass), with the fields forward_mqa reads."""
    tokens = req_id.shape[0]
    return vllm_mla_sparse.FusedMLASparseMetadata(
        num_reqs=block_table.shape[0], max_query_len=tokens, max_seq_len=0,
        num_actual_tokens=tokens, query_start_loc=torch.zeros(1, dtype=torch.int32),
        slot_mapping=torch.zeros(tokens, dtype=torch.long), block_table=block_table,
        req_id_per_token=req_id, block_size=block_size, num_decode_tokens=tokens,
    )  # fmt: skip


def expected(q_nope, q_pe, cache_rows, slots, scale):
    """float64 over exactly each token's listed rows (the cache's rows as float values)."""
    out = torch.zeros(q_nope.shape[0], q_nope.shape[1], L, dtype=torch.float64)
    q = torch.cat([q_nope, q_pe], -1).double()
    for t in range(q.shape[0]):
        listed = sorted({int(s) for s in slots[t] if s >= 0})
        if listed:
            keys = cache_rows[listed].double()
            p = torch.softmax(q[t] @ keys.T * scale, -1)
            out[t] = p @ keys[:, :L]
    return out


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("ds_format", [False, True], ids=["fp32", "fp8_ds_mla"])
def test_forward_mqa_attends_to_exactly_the_listed_keys(monkeypatch, backend, ds_format):
    """Three requests (two decodes, a three-token prefill run as MQA) over a 16-row paged
    cache with shuffled block tables; each token's top-k positions (request positions, some
    -1, some repeated) from the layer's buffer; NaN in every unlisted row."""
    monkeypatch.setenv(fused_vllm.BACKEND_ENV, backend)
    g = torch.Generator().manual_seed(2)
    block_size, heads, topk = 16, 4, 7
    rows = torch.randn(12 * block_size, L + P, generator=g)
    if ds_format:
        cache = quantize_mla_ds(rows).view(12, block_size, 656)
        values = dequantize_mla_ds(cache.view(-1, 656))
    else:
        cache = rows.clone().view(12, block_size, L + P)
        values = rows
    table = torch.randperm(12, generator=g)[:9].view(3, 3).to(torch.int32)
    lengths = [40, 7, 33]  # each request's keys so far
    req_id = torch.tensor([0, 1, 2, 2, 2], dtype=torch.int32)
    buffer = torch.full((8, topk), -1, dtype=torch.int32)  # the layer's top-k buffer
    for t, r in enumerate(req_id.tolist()):
        chosen = torch.randint(0, lengths[r], (topk - 2,), generator=g, dtype=torch.int32)
        buffer[t, : topk - 2] = chosen
        buffer[t, topk - 2] = chosen[0]  # a duplicate counts once
    slots = brute_slots(req_id, table, buffer[:5], block_size)
    # an unlisted row must never be read: NaN in a 32-bit row; in a 656-byte row every byte
    # 0xFF (NaN as e4m3 values, as float32 scales and as bfloat16 rope values)
    flat = cache.view(-1, cache.shape[-1])
    unlisted = torch.ones(flat.shape[0], dtype=torch.bool)
    unlisted[slots[slots >= 0].long()] = False
    flat[unlisted] = 0xFF if ds_format else float("nan")
    impl = object.__new__(vllm_mla_sparse.FusedMLASparseImpl)
    impl.kv_lora_rank, impl.scale, impl.backend = L, (L + P) ** -0.5, backend
    impl.topk_indices_buffer = buffer
    q_nope = torch.randn(5, heads, L, generator=g)
    q_pe = torch.randn(5, heads, P, generator=g)
    with torch.no_grad(), count_dispatches() as counts:
        out, lse = impl.forward_mqa((q_nope, q_pe), cache, metadata(req_id, table, block_size),
                                    None)  # fmt: skip
    assert counts[("mla_attention_with_kvcache", backend)] == 1, counts
    assert lse is None and out.shape == (5, heads, L)
    want = expected(q_nope, q_pe, values, slots, impl.scale)
    torch.testing.assert_close(out.double(), want, rtol=2e-4, atol=2e-4)


def test_a_token_with_no_listed_key_gives_zeros(monkeypatch):
    monkeypatch.setenv(fused_vllm.BACKEND_ENV, "reference")
    impl = object.__new__(vllm_mla_sparse.FusedMLASparseImpl)
    impl.kv_lora_rank, impl.scale, impl.backend = L, 0.05, "reference"
    impl.topk_indices_buffer = torch.full((2, 4), -1, dtype=torch.int32)
    cache = torch.randn(2, 16, L + P)
    table = torch.tensor([[1, 0]], dtype=torch.int32)
    req_id = torch.zeros(2, dtype=torch.int32)
    with torch.no_grad():
        out, _ = impl.forward_mqa(torch.randn(2, 3, L + P), cache, metadata(req_id, table, 16),
                                  None)  # fmt: skip
    assert torch.equal(out, torch.zeros_like(out))


def test_options_the_backend_lacks_are_refused_by_name():
    with pytest.raises(ValueError, match=r"sliding_window.*kv_cache_dtype='fp8_e5m2'"):
        vllm_mla_sparse.FusedMLASparseImpl(16, 576, 0.1, 1, None, 128, "fp8_e5m2", None,
                                           "decoder", None)  # fmt: skip
