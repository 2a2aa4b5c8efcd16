"""vLLM serving small random models on fusedattn, token for token against vLLM's own CPU
attention (fp32, greedy): the same tokens, log-probabilities within 1e-4, and fusedattn's decode
and paged-prefill implementations counted as the ones that ran."""

import gc
import os

import pytest
import torch
from dispatch_probe import count_dispatches
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from vllm import LLM, SamplingParams
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.core.sched.scheduler import Scheduler

import fusedattn
from fusedattn.fp8 import quantize
from fusedattn.integrations import vllm as fused_vllm

LOGPROB_TOL = 1e-4
VOCAB = 512
# Head dim 64 everywhere (vLLM's CPU attention takes 32 and up); two layers.
SMALL = dict(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=1024)  # fmt: skip
# fmt: off
MODELS = {
    # GQA, 4 query heads over 2 KV heads
    "llama": (LlamaForCausalLM, LlamaConfig(**SMALL, num_key_value_heads=2, head_dim=64)),
    # a sliding window of 16 keys (vLLM's w: the query's own position and the 15 before it)
    "mistral": (MistralForCausalLM, MistralConfig(**SMALL, num_key_value_heads=2, head_dim=64,
                                                  sliding_window=16)),
    # MQA with the attention projections' bias
    "qwen2": (Qwen2ForCausalLM, Qwen2Config(**SMALL, num_key_value_heads=1)),
    # logit softcapping and a sliding window on every other layer
    "gemma2": (Gemma2ForCausalLM, Gemma2Config(**SMALL, num_key_value_heads=2, head_dim=64,
                                               sliding_window=16, attn_logit_softcapping=5.0,
                                               query_pre_attn_scalar=64)),
    # ALiBi slopes
    "bloom": (BloomForCausalLM, BloomConfig(vocab_size=VOCAB, hidden_size=256, n_layer=2,
                                            n_head=4)),
}
# fmt: on


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """model_dir(name): a folder holding the small random model (seeded, saved once)."""
    saved = {}

    def get(name):
        if name not in saved:
            cls, config = MODELS[name]
            torch.manual_seed(0)
            model = cls(config)
            with torch.no_grad():  # larger weights than the init's: logits far from uniform
                for p in model.parameters():
                    p.mul_(3.0)
            saved[name] = str(tmp_path_factory.mktemp(name))
            model.save_pretrained(saved[name])
        return saved[name]

    return get


def prompts(lengths, seed=0, prefix=()):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": [*prefix, *torch.randint(1, VOCAB, (n,), generator=g).tolist()]}
            for n in lengths]  # fmt: skip


def serve(model, prompt_list, *, fused, backend="auto", max_tokens=8, rounds=1,
          rounded_kv=None, **engine):  # fmt: skip
    """Greedy generation by one engine, on fusedattn (fused=True) or vLLM's CPU attention;
    `rounds` calls of generate on the same engine (a later round can hit the prefix cache).
    rounded_kv (vLLM's attention only): an fp8 type the new keys and values are rounded
    through (fusedattn.fp8.quantize, scale 1) before vLLM stores them in its fp32 cache.
    Returns (outputs of each round, fusedattn's dispatch counts, preemptions)."""
    os.environ[fused_vllm.BACKEND_ENV] = backend
    fused_vllm.enable() if fused else fused_vllm.disable()
    preempted = []
    original = Scheduler._preempt_request
    cpu_update = _cpu_impl().do_kv_cache_update

    def counting(self, request, *args, **kwargs):
        preempted.append(request.request_id)
        return original(self, request, *args, **kwargs)

    def rounding(self, layer, key, value, *args):
        key, value = (quantize(x, 1.0, rounded_kv).to(x.dtype) for x in (key, value))
        return cpu_update(self, layer, key, value, *args)

    engine = dict(dict(max_model_len=512, block_size=32, seed=0), **engine)
    Scheduler._preempt_request = counting
    if rounded_kv is not None:
        _cpu_impl().do_kv_cache_update = rounding
    llm = None
    try:
        llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                  **engine)  # fmt: skip
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=3,
                                detokenize=False, ignore_eos=True)  # fmt: skip
        with count_dispatches() as counts:
            outputs = [llm.generate(prompt_list, params, use_tqdm=False) for _ in range(rounds)]
        impl_types = {type(layer.impl) for layer in _attention_layers(llm)}
    finally:
        Scheduler._preempt_request = original
        _cpu_impl().do_kv_cache_update = cpu_update
        fused_vllm.disable()
        del llm
        gc.collect()
    assert impl_types == ({fused_vllm.FusedAttentionImpl} if fused else
                          {_cpu_impl()}), impl_types  # fmt: skip
    return outputs, counts, preempted


def _attention_layers(llm):
    from vllm.model_executor.layers.attention import Attention

    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    return [m for m in model.modules() if isinstance(m, Attention)]


def _cpu_impl():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    return CPUAttentionBackendImpl


def assert_same_generation(ours, theirs):
    """Same tokens; every log-probability both report within LOGPROB_TOL."""
    for round_ours, round_theirs in zip(ours, theirs, strict=True):
        for a, b in zip(round_ours, round_theirs, strict=True):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, a.request_id
            worst = max(abs(la[t].logprob - lb[t].logprob)
                        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs,
                                          strict=True)
                        for t in la.keys() & lb.keys())  # fmt: skip
            assert worst <= LOGPROB_TOL, (a.request_id, worst)


def fused_attention_calls(counts, backend=None):
    """(decode calls, paged-prefill calls); only those two ops ran, and only on `backend`
    where one is named."""
    ran = {key for key, n in counts.items() if n}
    assert {op for op, _ in ran} <= {"attention_with_kvcache", "varlen_attention"}, ran
    if backend is not None:
        assert {name for _, name in ran} == {backend}, ran
    return (sum(n for (op, _), n in counts.items() if op == "attention_with_kvcache"),
            sum(n for (op, _), n in counts.items() if op == "varlen_attention"))  # fmt: skip


@pytest.mark.parametrize("name", list(MODELS))
def test_a_mixed_batch_matches_vllm(model_dir, name):
    """Prompts of 3 to 70 tokens in one batch (the window of 16 is crossed), 8 new tokens
    each: the steps mix prefills and decodes."""
    batch = prompts([3, 17, 40, 70, 9])
    ours, counts, _ = serve(model_dir(name), batch, fused=True)
    theirs, _, _ = serve(model_dir(name), batch, fused=False)
    assert_same_generation(ours, theirs)
    decodes, prefills = fused_attention_calls(counts)
    # 2 layers: one prefill step, then 7 decode steps
    assert prefills >= 2 and decodes >= 2 * 7, counts


def test_a_prefix_cache_hit_matches_vllm(model_dir):
    """A second round of prompts that share a 64-token prefix (two blocks of 32) with the
    first: the engine reuses those blocks and the paged prefill reads them as context."""
    shared = prompts([64], seed=1)[0]["prompt_token_ids"]
    batch = prompts([5, 30], seed=2, prefix=shared)
    ours, counts, _ = serve(model_dir("llama"), batch, fused=True, rounds=2,
                            enable_prefix_caching=True)  # fmt: skip
    theirs, _, _ = serve(model_dir("llama"), batch, fused=False, rounds=2,
                         enable_prefix_caching=True)  # fmt: skip
    assert all((out.num_cached_tokens or 0) >= 64 for out in ours[1]), [
        out.num_cached_tokens for out in ours[1]]  # fmt: skip
    assert_same_generation(ours, theirs)
    fused_attention_calls(counts)


def test_chunked_prefill_matches_vllm(model_dir):
    """A 200-token prompt with at most 64 tokens a step: its prefill runs in chunks, each
    over the keys the earlier chunks cached (and beside another request's decode steps)."""
    batch = prompts([200, 7], seed=3)
    seen = []
    original = fusedattn.varlen_attention

    def spying(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, **kwargs):
        seen.append((int(cu_seqlens_q[-1]), int(cu_seqlens_k[-1])))
        return original(q, k, v, cu_seqlens_q, cu_seqlens_k, *args, **kwargs)

    fusedattn.varlen_attention = spying
    try:
        ours, _, _ = serve(model_dir("llama"), batch, fused=True, enable_chunked_prefill=True,
                           max_num_batched_tokens=64, max_num_seqs=4)  # fmt: skip
    finally:
        fusedattn.varlen_attention = original
    theirs, _, _ = serve(model_dir("llama"), batch, fused=False, enable_chunked_prefill=True,
                         max_num_batched_tokens=64, max_num_seqs=4)  # fmt: skip
    assert_same_generation(ours, theirs)
    # a chunk after the first: its queries attend to more keys than they are
    assert any(keys > queries and queries > 1 for queries, keys in seen), seen


def test_preemption_and_recomputation_match_vllm(model_dir):
    """A KV cache of 8 blocks of 32 for four requests that grow to 100 tokens (4 blocks)
    each: the scheduler preempts some and recomputes them later (prefill from scratch)."""
    batch = prompts([60, 61, 62, 63], seed=4)
    engine = dict(num_gpu_blocks_override=8, max_model_len=128, max_num_batched_tokens=512)
    ours, counts, preempted = serve(model_dir("llama"), batch, fused=True, max_tokens=40,
                                    **engine)  # fmt: skip
    theirs, _, _ = serve(model_dir("llama"), batch, fused=False, max_tokens=40, **engine)
    assert preempted, "the cache budget did not force a preemption"
    assert_same_generation(ours, theirs)
    fused_attention_calls(counts)


@pytest.mark.parametrize("invariant", [False, True], ids=["plain", "batch-invariant"])
def test_the_triton_kernels_serve_it(model_dir, invariant):
    """The Triton decode and paged-prefill kernels (the interpreter on the CPU: short
    prompts, few tokens) at block size 32, on the Triton vLLM's CPU build installs (3.9: its
    interpreter's C++ load and store refused the int masks a scalar comparison splats to, and
    the engine failed to start in the backend's rehearsal, issue #82; fusedattn's kernels now
    run on 3.6 - 3.9), with fusedattn's batch-invariant switch off and on. (vLLM's own
    VLLM_BATCH_INVARIANT=1 swaps aten's matmul and mean for vLLM's Triton kernels, which its
    CPU build cannot run.)"""
    import triton

    batch = prompts([5, 12], seed=5)
    with fusedattn.batch_invariant(invariant):
        ours, counts, _ = serve(model_dir("llama"), batch, fused=True, backend="triton",
                                max_tokens=3)  # fmt: skip
    theirs, _, _ = serve(model_dir("llama"), batch, fused=False, max_tokens=3)
    assert_same_generation(ours, theirs)
    decodes, prefills = fused_attention_calls(counts, "triton")
    assert decodes >= 2 * 2 and prefills >= 2, (counts, triton.__version__)


@pytest.mark.parametrize("cache_dtype, fp8", [("fp8", torch.float8_e4m3fn),
                                               ("fp8_e5m2", torch.float8_e5m2)])  # fmt: skip
def test_an_fp8_cache_matches_vllm_over_the_rounded_values(model_dir, cache_dtype, fp8):
    """kv_cache_dtype fp8: fusedattn stores x / scale (scale 1) in the fp8 type, one byte an
    element, and attends over the stored values; vLLM's fp32 attention over keys and values
    rounded the same way gives the same tokens, log-probabilities within 1e-4. (vLLM's own
    CPU fp8 attention is not this yardstick: its tokens differ from both from the first.)"""
    batch = prompts([9, 33], seed=6)
    ours, counts, _ = serve(model_dir("llama"), batch, fused=True, kv_cache_dtype=cache_dtype)
    theirs, _, _ = serve(model_dir("llama"), batch, fused=False, rounded_kv=fp8)
    assert_same_generation(ours, theirs)
    fused_attention_calls(counts)


def test_the_plugin_changes_nothing_unless_asked(monkeypatch):
    monkeypatch.delenv(fused_vllm.SELECT_ENV, raising=False)
    fused_vllm.register()
    assert not AttentionBackendEnum.CPU_ATTN.is_overridden()
    assert AttentionBackendEnum.CUSTOM.get_path() == fused_vllm.CLASS_PATH
    monkeypatch.setenv(fused_vllm.SELECT_ENV, "1")
    fused_vllm.register()
    assert AttentionBackendEnum.CPU_ATTN.get_path() == fused_vllm.CLASS_PATH
    fused_vllm.disable()
    assert not AttentionBackendEnum.CPU_ATTN.is_overridden()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(attn_type="encoder_only"), "attn_type='encoder_only'"),
        (dict(kv_cache_dtype="int8_per_token_head"), "kv_cache_dtype='int8_per_token_head'"),
        (dict(use_alibi_sqrt=True), "use_alibi_sqrt=True"),
    ],
)
def test_what_it_cannot_serve_is_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        fused_vllm.FusedAttentionImpl(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2,
                                      **kwargs)  # fmt: skip


def test_an_unknown_fusedattn_backend_is_refused(monkeypatch):
    monkeypatch.setenv(fused_vllm.BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match="FUSEDATTN_VLLM_BACKEND='fast'"):
        fused_vllm.FusedAttentionImpl(num_heads=4, head_size=64, scale=0.125)


def test_an_option_the_backend_lacks_is_refused_when_the_engine_starts(model_dir):
    """Gemma 2's softcap on fusedattn's torch backend (SDPA has no softcap): the engine does
    not start, and says which layer and why, before any request."""
    with pytest.raises(Exception) as failure:  # vLLM may wrap it: the chain is read below
        serve(model_dir("gemma2"), prompts([3]), fused=True, backend="torch")
    chain, exc = [], failure.value
    while exc is not None:
        chain.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    said = "\n".join(chain)
    assert "fusedattn's vLLM backend cannot serve" in said and "softcap" in said, said


def _batch_metadata(causal, query_lens, seq_lens, block_table):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    n = int(starts[-1])
    return CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=len(query_lens),
        num_actual_tokens=n, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=block_table, slot_mapping=torch.zeros(n, dtype=torch.int32),
        causal=causal,
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_non_causal_batch_lets_each_query_see_every_key_of_its_request(backend):
    """vLLM's CommonAttentionMetadata.causal = False (a drafter, an encoder-style layer on the
    decoder path): each query sees all of its request's keys, in the decode and the prefill
    part of the batch, against float64. The builder ignored the flag and ran causal (vLLM's
    own test_non_causal_backend_correctness: 67 % of the elements off); a per-request flag
    tensor is refused by name."""
    torch.manual_seed(0)
    H, Hkv, D, page = 4, 2, 64, 16
    impl = fused_vllm.FusedAttentionImpl(H, D, D**-0.5, num_kv_heads=Hkv)
    impl.backend = backend
    builder = object.__new__(fused_vllm.FusedAttentionMetadataBuilder)
    kv_cache = torch.randn(8, Hkv, page, 2 * D)  # vLLM's (blocks, Hkv, block_size, 2 D)
    table = torch.tensor([[5, 1], [2, 7]], dtype=torch.int32)
    query_lens, seq_lens = [1, 7], [20, 30]  # a decode over 20 keys, 7 queries over 30
    query = torch.randn(sum(query_lens), H * D)
    layer = type("Scales", (), dict(_k_scale=torch.ones(()), _v_scale=torch.ones(())))

    def run(causal):
        meta = builder.build(0, _batch_metadata(causal, query_lens, seq_lens, table))
        output = torch.full_like(query, float("nan"))
        return impl.forward(layer, query, query, query, kv_cache, meta, output)

    got, causal_out = run(False), run(True)
    row = 0
    for b, (nq, nk) in enumerate(zip(query_lens, seq_lens, strict=True)):
        slots = [(int(table[b, p // page]), p % page) for p in range(nk)]
        keys = torch.stack([kv_cache[i, :, j, :D] for i, j in slots], 1).double()
        values = torch.stack([kv_cache[i, :, j, D:] for i, j in slots], 1).double()
        q = query[row : row + nq].view(nq, H, D).transpose(0, 1).double()
        kv = lambda t: t.repeat_interleave(H // Hkv, 0)  # noqa: E731
        want = torch.softmax(q @ kv(keys).transpose(1, 2) * D**-0.5, -1) @ kv(values)
        mine = got[row : row + nq].view(nq, H, D).transpose(0, 1).double()
        torch.testing.assert_close(mine, want, rtol=1e-4, atol=1e-4)
        row += nq
    assert not torch.allclose(causal_out[1:], got[1:], atol=1e-3)  # the flag changed something
    with pytest.raises(ValueError, match="one causal flag per batch"):
        builder.build(0, _batch_metadata(torch.tensor([True, False]), query_lens, seq_lens,
                                         table))  # fmt: skip
    assert fused_vllm.FusedAttentionBackend.supports_non_causal()


def test_vllm_batch_invariant_turns_the_switch_on_and_a_request_keeps_its_bits(monkeypatch):
    """VLLM_BATCH_INVARIANT=1: building the backend turns fusedattn.batch_invariant on; the
    torch backend is refused by name; a request's attention (its decode step, its prefill
    chunk) is the same bits alone and batched with other requests of other lengths."""
    from fusedattn import invariance

    assert fused_vllm.FusedAttentionBackend.supports_batch_invariance()
    monkeypatch.setenv(fused_vllm.INVARIANT_ENV, "1")
    monkeypatch.setenv(fused_vllm.BACKEND_ENV, "torch")
    with pytest.raises(
        ValueError, match="VLLM_BATCH_INVARIANT=1 with FUSEDATTN_VLLM_BACKEND=torch"
    ):
        fused_vllm.FusedAttentionImpl(num_heads=4, head_size=64, scale=0.125)
    monkeypatch.setenv(fused_vllm.BACKEND_ENV, "auto")
    try:
        torch.manual_seed(0)
        H, Hkv, D, page = 4, 2, 32, 16
        impl = fused_vllm.FusedAttentionImpl(H, D, D**-0.5, num_kv_heads=Hkv)
        assert invariance.enabled()
        builder = object.__new__(fused_vllm.FusedAttentionMetadataBuilder)
        kv_cache = torch.randn(12, Hkv, page, 2 * D)
        layer = type("Scales", (), dict(_k_scale=torch.ones(()), _v_scale=torch.ones(())))
        rows = torch.randn(9, H * D)  # request A: one decode token, then 5 prefill tokens

        def run(query_lens, seq_lens, table, query):
            meta = builder.build(0, _batch_metadata(True, query_lens, seq_lens, table))
            return impl.forward(layer, query, query, query, kv_cache, meta,
                                torch.empty_like(query))  # fmt: skip

        a_table = torch.tensor([[3, 8, 1]], dtype=torch.int32)
        alone_decode = run([1], [40], a_table, rows[:1])
        alone_prefill = run([5], [45], a_table, rows[1:6])
        others = torch.tensor([[0, 2, 4], [5, 6, 7]], dtype=torch.int32)
        mixed = run([1, 1, 5, 3], [40, 17, 45, 21], torch.cat([a_table, others[:1], a_table,
                                                               others[1:]]),
                    torch.cat([rows[:1], rows[6:7], rows[1:6], rows[6:9]]))  # fmt: skip
        assert torch.equal(mixed[:1], alone_decode)
        assert torch.equal(mixed[2:7], alone_prefill)
    finally:
        fusedattn.batch_invariant(False)
