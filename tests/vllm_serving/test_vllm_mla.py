"""vLLM's CPU build serving a tiny random DeepSeek-V2 (MLA, kv_lora_rank 512, rope 64, dense
MLP layers, fp32) on fusedattn's MLA backend (fusedattn.integrations.vllm_mla) against vLLM's
own CPU_MLA in the same process: the same greedy tokens, log-probabilities within the dense
suite's tolerance, fusedattn's MLA decode and prefill counted as what ran and CPU_MLA's never;
the backend's pieces alone (the cache update skipping padding, a context chunk's lse, batch
invariance of a request's decode)."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from dispatch_probe import count_dispatches
from test_vllm_backend import LOGPROB_TOL, VOCAB, assert_same_generation, prompts
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
from vllm import LLM, SamplingParams

import fusedattn
from fusedattn.integrations import vllm as fused_vllm
from fusedattn.integrations import vllm_mla

CONFIG = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None,
              qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=2,
              n_routed_experts=4, moe_intermediate_size=64, num_experts_per_tok=2,
              max_position_embeddings=1024)  # fmt: skip


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = DeepseekV2ForCausalLM(DeepseekV2Config(**CONFIG))
    with torch.no_grad():  # weights larger than the init's: logits far from uniform
        for p in model.parameters():
            p.mul_(3.0)
    path = str(tmp_path_factory.mktemp("deepseek_v2"))
    model.save_pretrained(path)
    return path


def serve_mla(model, prompt_list, *, fused, backend="auto", max_tokens=6):
    """Greedy generation by one engine on fusedattn's MLA backend or vLLM's CPU_MLA; the MLA
    layers' impl classes and fusedattn's dispatch counts."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    os.environ[fused_vllm.BACKEND_ENV] = backend
    fused_vllm.enable() if fused else fused_vllm.disable()
    calls = []
    original = CPUMLAImpl.forward_mqa

    def counting(self, *args, **kwargs):
        calls.append(type(self).__name__)
        return original(self, *args, **kwargs)

    CPUMLAImpl.forward_mqa = counting
    llm = None
    try:
        # the baseline is CPU_MLA by name: on a CPU with AMX tiles vLLM prefers AMX_MLA,
        # which takes bf16 weights only (this model is float32); fusedattn's run keeps vLLM's
        # own choice (FUSEDATTN_VLLM points both at fusedattn's backend)
        baseline = {} if fused else {"attention_backend": "CPU_MLA"}
        llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                  max_model_len=512, seed=0, **baseline)  # fmt: skip
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3,
                                detokenize=False, ignore_eos=True)  # fmt: skip
        with count_dispatches() as counts:
            outputs = llm.generate(prompt_list, params, use_tqdm=False)
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        impls = {type(m.impl) for m in runner.model.modules() if hasattr(m, "impl")
                 and type(m).__name__ == "MLAAttention"}  # fmt: skip
    finally:
        CPUMLAImpl.forward_mqa = original
        fused_vllm.disable()
        del llm
        gc.collect()
    return [outputs], counts, impls, calls


def test_a_deepseek_model_on_fusedattns_mla_matches_vllms_cpu_mla(deepseek_dir):
    """FUSEDATTN_VLLM=1: every MLA layer is fusedattn's (decode: mla_attention_with_kvcache,
    prefill: varlen_attention at head dims 96 / 32), vLLM's CPU_MLA decode never runs; the
    tokens are CPU_MLA's and the log-probabilities within the dense suite's tolerance."""
    batch = prompts([3, 17, 40], seed=7)
    ours, counts, impls, calls = serve_mla(deepseek_dir, batch, fused=True)
    theirs, _, their_impls, their_calls = serve_mla(deepseek_dir, batch, fused=False)
    assert impls == {vllm_mla.FusedMLAImpl}, impls
    assert calls == [], "vLLM's CPU_MLA decode ran beside fusedattn's"
    assert their_calls and all(name == "CPUMLAImpl" for name in their_calls)
    assert their_impls and vllm_mla.FusedMLAImpl not in their_impls
    assert_same_generation(ours, theirs)
    ran = {op for (op, _), n in counts.items() if n}
    assert ran == {"mla_attention_with_kvcache", "varlen_attention"}, counts
    assert LOGPROB_TOL <= 1e-4


def test_the_triton_kernels_serve_a_deepseek_model(deepseek_dir):
    """The Triton latent kernel (the interpreter: short prompts, few tokens)."""
    batch = prompts([5, 9], seed=8)
    ours, counts, _, _ = serve_mla(deepseek_dir, batch, fused=True, backend="triton",
                                   max_tokens=3)  # fmt: skip
    theirs, _, _, _ = serve_mla(deepseek_dir, batch, fused=False, max_tokens=3)
    assert_same_generation(ours, theirs)
    assert counts[("mla_attention_with_kvcache", "triton")] >= 2 * 2, counts


def _impl(monkeypatch, backend="auto", kv_cache_dtype="auto"):
    monkeypatch.setenv(fused_vllm.BACKEND_ENV, backend)
    impl = object.__new__(vllm_mla.FusedMLAImpl)  # the pieces alone, without vLLM's config
    impl.kv_lora_rank, impl.scale, impl.backend = 64, 80**-0.5, backend
    impl.fp8_dtype = vllm_mla.FP8_CACHE_DTYPES.get(kv_cache_dtype)
    return impl


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_the_cache_update_skips_padding_slots(monkeypatch, cache_dtype):
    impl = _impl(monkeypatch, kv_cache_dtype=cache_dtype)
    dtype = torch.uint8 if cache_dtype == "fp8" else torch.float32
    cache = torch.zeros(4, 8, 80, dtype=dtype)
    kv_c, k_pe = torch.randn(3, 64), torch.randn(3, 1, 16)
    slots = torch.tensor([5, -1, 17])
    impl.do_kv_cache_update(kv_c, k_pe, cache, slots, cache_dtype, torch.tensor(0.5))
    flat = cache.view(-1, 80)
    rows = torch.cat([kv_c, k_pe[:, 0]], -1)
    if cache_dtype == "fp8":
        rows = fusedattn.fp8.quantize(rows, torch.tensor(0.5), torch.float8_e4m3fn).view(
            torch.uint8
        )
    assert torch.equal(flat[5], rows[0]) and torch.equal(flat[17], rows[2])
    assert int((flat != 0).any(-1).sum()) == 2  # the padding slot wrote nothing


def test_a_context_chunk_returns_the_lse_vllm_merges(monkeypatch):
    """run_prefill_context_chunk: non-causal over the chunk's keys, (out, lse (Hq, total_q))."""
    monkeypatch.setenv(fused_vllm.BACKEND_ENV, "reference")
    prefill = object.__new__(vllm_mla.FusedMLAPrefillBackend)
    prefill.scale = 0.1
    chunk = type("Chunk", (), dict(query_start_loc=torch.tensor([0, 3, 5]), max_query_len=3,
                                   cu_seq_lens=torch.tensor([0, 7, 11]), max_seq_len=7))  # fmt: skip
    q, k, v = torch.randn(5, 4, 96), torch.randn(11, 4, 96), torch.randn(11, 4, 32)
    out, lse = prefill.run_prefill_context_chunk(chunk, q, k, v)
    want, want_lse = fusedattn.reference.varlen_attention(
        q.double(), k.double(), v.double(), torch.tensor([0, 3, 5], dtype=torch.int32),
        torch.tensor([0, 7, 11], dtype=torch.int32), 3, 7, scale=0.1, return_lse=True,
    )  # fmt: skip
    assert out.shape == (5, 4, 32) and lse.shape == (4, 5)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse.double(), rtol=1e-5, atol=1e-5)


def test_a_requests_mla_decode_keeps_its_bits_in_a_mixed_batch(monkeypatch):
    """Under fusedattn.batch_invariant (the Triton kernel): a request's decode step through
    forward_mqa is the same bits alone and among requests of other lengths."""
    impl = _impl(monkeypatch, backend="triton")
    torch.manual_seed(0)
    cache = torch.randn(12, 16, 80)
    q_nope, q_pe = torch.randn(3, 4, 64), torch.randn(3, 4, 16)

    def step(rows, seq_lens, table):
        decode = type("Decode", (), dict(seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                                         block_table=torch.tensor(table, dtype=torch.int32)))  # fmt: skip
        meta = type("Meta", (), dict(decode=decode))
        return impl.forward_mqa((q_nope[rows], q_pe[rows]), cache, meta, None)[0]

    with fusedattn.batch_invariant():
        alone = step([0], [40], [[3, 8, 1]])
        mixed = step([1, 0, 2], [17, 40, 33], [[0, 2, 4], [3, 8, 1], [5, 6, 7]])
    assert torch.equal(mixed[1:2], alone)
