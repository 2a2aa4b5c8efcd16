"""transformers models on fusedattn's attention: randomly initialised BERT and GPT-2 built from
configs (no downloads) give the logits of their own SDPA path, and fusedattn really runs."""

import pytest
import torch
from dispatch_probe import count_dispatches

from fusedattn.testing import assert_close_kx

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("fusedattn.integrations.huggingface")
from fusedattn.ops.core import backends  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def registered():
    hf.register("fusedattn-torch", backend="torch")
    hf.register("fusedattn-reference", backend="reference")


def bert_config():
    return transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64,
    )  # fmt: skip


def gpt2_config():
    return transformers.GPT2Config(
        vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip


def build(cls, config, implementation, state=None):
    model = cls._from_config(config, attn_implementation=implementation).eval()
    if state is not None:
        model.load_state_dict(state)
    return model


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize(
    "cls,config",
    [("BertForMaskedLM", bert_config), ("GPT2LMHeadModel", gpt2_config)],
    ids=["bert", "gpt2"],
)
def test_logits_match_the_sdpa_path(cls, config, backend):
    cls = getattr(transformers, cls)
    torch.manual_seed(0)
    sdpa = build(cls, config(), "sdpa")
    ours = build(cls, config(), f"fusedattn-{backend}", sdpa.state_dict())
    truth = build(cls, config(), "sdpa", sdpa.state_dict()).double()
    ids = torch.randint(3, 100, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 8:] = 0  # right padding in the second sequence
    with count_dispatches() as counts:
        got = ours(input_ids=ids, attention_mask=mask).logits
    assert counts[("attention", backend)] == 2  # one per layer
    want = truth(input_ids=ids, attention_mask=mask).logits
    base = sdpa(input_ids=ids, attention_mask=mask).logits
    assert_close_kx(got, want, base, k=3.0)


def test_gpt2_greedy_generation_with_a_kv_cache_matches_sdpa():
    torch.manual_seed(0)
    sdpa = build(transformers.GPT2LMHeadModel, gpt2_config(), "sdpa")
    ours = build(transformers.GPT2LMHeadModel, gpt2_config(), "fusedattn-torch", sdpa.state_dict())
    prompt = torch.randint(3, 100, (2, 5))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with count_dispatches() as counts:
        got = ours.generate(prompt, **kw)
    assert torch.equal(got, sdpa.generate(prompt, **kw))
    # backend="torch" keeps the decoding steps on one SDPA call each (no cache gather)
    assert counts[("attention", "torch")] == 2 * 6  # prefill + 5 decoding steps, two layers
    assert counts[("attention_with_kvcache", "torch")] == 0


# ---- sliding window (Mistral), softcap (Gemma 2), sinks (GPT-OSS): against HF's eager path ----


def mistral_config():
    return transformers.MistralConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=5,
        max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


def gemma2_config():
    return transformers.Gemma2Config(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=5,
        attn_logit_softcapping=1.5, query_pre_attn_scalar=8, max_position_embeddings=64,
        initializer_range=0.5,  # scores large enough for the cap to bite
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


def gpt_oss_config():
    return transformers.GptOssConfig(
        vocab_size=100, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=5,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
        experts_implementation="eager",  # grouped_mm has no float64 (the truth model)
    )  # fmt: skip


def deepseek_v32_config():
    """DeepSeek-V3.2: MLA with DSA, the indexer handing each query's top-4 keys as indices=
    (fewer than the 12 tokens: the selection matters)."""
    return transformers.DeepseekV32Config(
        vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12,
        qk_nope_head_dim=16, n_group=1, topk_group=1, num_experts_per_tok=2,
        max_position_embeddings=64, index_topk=4, index_head_dim=16, index_n_heads=2,
        first_k_dense_replace=1, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        experts_implementation="eager",
    )  # fmt: skip


VARIANT_MODELS = [mistral_config, gemma2_config, gpt_oss_config, deepseek_v32_config]
CPU_BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.kernels)]


@pytest.fixture(scope="module", autouse=True)
def registered_triton():
    hf.register("fusedattn-triton", backend="triton")


def causal_lm(config, implementation, state=None):
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation=implementation
    )
    if state is not None:
        model.load_state_dict(state)
    return model.eval()


def eager_twin(config):
    torch.manual_seed(0)
    eager = causal_lm(config, "eager")
    with torch.no_grad():  # make the sinks matter (HF initialises them to a constant)
        for name, p in eager.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn_like(p))
    return eager


def padded_batch(T=12, side="left"):
    """Two sequences, the second padded by 3 on `side` (left, as for generation; right keeps
    every query row seeing a key, which HF's eager path needs in float64: its mask of
    finfo.min overflows to -inf there and gives NaN)."""
    ids = torch.randint(3, 100, (2, T))
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, slice(0, 3) if side == "left" else slice(T - 3, T)] = 0
    return ids, mask


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("config", VARIANT_MODELS, ids=lambda c: c.__name__[:-7])
@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_variant_models_logits_and_gradients_match_eager(config, backend, padded):
    """Logits and every parameter gradient of Mistral (sliding window), Gemma 2 (softcap +
    sliding window), GPT-OSS (sinks + sliding window) and DeepSeek-V3.2 (MLA with DSA's
    indices=, Dqk 24 != Dv 12) against HF's eager attention in float64, under the k× rule for
    models; the variants reach fusedattn's kernels."""
    eager = eager_twin(config())
    ours = causal_lm(config(), f"fusedattn-{backend}", eager.state_dict())
    truth = causal_lm(config(), "eager", eager.state_dict()).double()
    ids, mask = padded_batch(side="right")
    if not padded:
        mask = torch.ones_like(mask)
    labels = ids.masked_fill(mask == 0, -100)
    outs = {}
    for name, model in (("ours", ours), ("truth", truth), ("base", eager)):
        model.zero_grad()
        with count_dispatches() as counts:
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        outs[name] = out.logits, {n: p.grad for n, p in model.named_parameters()}, counts
    assert outs["ours"][2][("attention", backend)] == 2  # one per layer
    assert_close_kx(outs["ours"][0], outs["truth"][0], outs["base"][0], k=3.0)
    for name, grad in outs["ours"][1].items():
        if grad is None:  # no path to the loss (DeepSeek-V3.2's indexer picks keys by topk)
            assert outs["truth"][1][name] is None, name
            continue
        assert_close_kx(grad, outs["truth"][1][name], outs["base"][1][name], k=3.0, name=name)


@pytest.mark.parametrize("config", VARIANT_MODELS, ids=lambda c: c.__name__[:-7])
def test_variant_models_greedy_generation_matches_eager(config):
    eager = eager_twin(config())
    ours = causal_lm(config(), "fusedattn-reference", eager.state_dict())
    ids, mask = padded_batch(8)
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **kw), eager.generate(ids, **kw))


def test_sliding_window_reaches_the_kernels_as_a_window_not_a_dense_mask(monkeypatch):
    """Unpadded Mistral: HF's sliding-window mask is left to the kernels (window_size =
    (sliding_window - 1, 0), bottom-right, no attn_mask); with padding the dense mask holds
    the whole pattern."""
    calls = []
    real = hf.attention

    def spy(q, k, v, attn_mask=None, **kw):
        calls.append((attn_mask is None, kw.get("window_size"), kw.get("is_causal")))
        return real(q, k, v, attn_mask, **kw)

    monkeypatch.setattr(hf, "attention", spy)
    model = causal_lm(mistral_config(), "fusedattn-reference")
    ids, mask = padded_batch()
    model(input_ids=ids)
    assert calls == [(True, (4, 0), True)] * 2
    calls.clear()
    model(input_ids=ids, attention_mask=mask)
    assert calls == [(False, None, False)] * 2


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_packed_sequences_run_as_varlen_and_match_each_sequence_alone(backend):
    """cu_seq_lens_q/k and max_length_q/k (DataCollatorWithFlattening's flash-attention
    kwargs) run fusedattn.varlen_attention: the logits of three packed sequences equal those
    of each sequence run alone through HF's eager attention."""
    eager = eager_twin(gpt_oss_config())
    ours = causal_lm(gpt_oss_config(), f"fusedattn-{backend}", eager.state_dict())
    lengths = [5, 9, 3]
    seqs = [torch.randint(3, 100, (1, n)) for n in lengths]
    ids = torch.cat(seqs, dim=1)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, 5, 14, 17], dtype=torch.int32)
    kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9)
    with count_dispatches() as counts:
        got = ours(input_ids=ids, position_ids=position_ids, **kw).logits
    assert counts[("varlen_attention", backend)] == 2
    want = torch.cat([eager(input_ids=s).logits for s in seqs], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_unknown_keywords_are_refused_not_dropped():
    q = torch.randn(1, 2, 3, 8)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="does not understand head_mask"):
        hf.attention_forward(module, q, q, q, None, head_mask=torch.ones(2))
    with pytest.raises(ValueError, match="output_attentions"):
        hf.attention_forward(module, q, q, q, None, output_attentions=True)
    out, _ = hf.attention_forward(module, q, q, q, None, position_ids=torch.arange(3)[None],
                                  use_cache=True, head_mask=None)  # fmt: skip
    assert out.shape == (1, 3, 2, 8)


def test_sinks_and_softcap_change_the_result():
    """s_aux and softcap are applied (s_aux was silently dropped before)."""
    q = torch.randn(1, 2, 3, 8) * 3
    module = torch.nn.Module()
    plain, _ = hf.attention_forward(module, q, q, q, None, backend="reference")
    sinks, _ = hf.attention_forward(
        module, q, q, q, None, s_aux=torch.randn(2), backend="reference"
    )
    capped, _ = hf.attention_forward(module, q, q, q, None, softcap=1.0, backend="reference")
    assert not torch.allclose(plain, sinks) and not torch.allclose(plain, capped)


# ---- generation: decode steps through attention_with_kvcache ----------------------------------


def llama_config():
    return transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip


# DeepSeek-V3.2's indices reach fusedattn as a mask of the listed keys (its decode steps too):
# its generation is test_variant_models_greedy_generation_matches_eager's
DECODE_MODELS = [llama_config, *(c for c in VARIANT_MODELS if c is not deepseek_v32_config)]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("config", DECODE_MODELS, ids=lambda c: c.__name__[:-7])
def test_greedy_generation_decodes_through_the_kvcache_kernels(config, cache, backend):
    """Left-padded batch, greedy: the tokens of HF's eager attention, with every decode step
    of every layer in attention_with_kvcache (Llama; Mistral's window, Gemma 2's softcap and
    GPT-OSS's sinks, each with sliding-window layers). With the static cache each step reads
    the keys up to the current length only, never the whole max_cache_len buffer."""
    eager = eager_twin(config())
    ours = causal_lm(config(), f"fusedattn-{backend}", eager.state_dict())
    ids, mask = padded_batch(8)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    lengths = []
    impls = backends._REGISTRY["attention_with_kvcache"]
    real = impls[backend]

    def recording(**inputs):
        lengths.append(int(inputs["seqlens_k"].max()))
        return real.run(**inputs)

    impls[backend] = backends.Implementation(real.op, real.backend, recording, real.refusals)
    try:
        with count_dispatches() as counts:
            got = ours.generate(ids, **kw)
    finally:
        impls[backend] = real
    assert torch.equal(got, eager.generate(ids, **kw))
    steps = 5  # 6 new tokens: a prefill, then 5 decode steps
    assert counts[("attention_with_kvcache", backend)] == 2 * steps
    assert counts[("attention", backend)] == 2  # the prefill only
    full = [8 + step for step in range(1, steps + 1) for _ in range(2)]  # per step, per layer
    assert all(n <= want for n, want in zip(lengths, full, strict=True))  # never the capacity
    if getattr(config(), "sliding_window", None) is None:
        assert lengths == full


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("config", DECODE_MODELS, ids=lambda c: c.__name__[:-7])
@pytest.mark.parametrize(
    "backend,prompts",
    [("reference", (1, 3, 7, "padded")), pytest.param("triton", (3,), marks=pytest.mark.kernels)],
)
def test_unpadded_prompts_generate_as_eager_with_either_cache(config, cache, backend, prompts):
    """Prompts of 1, 3 and 7 tokens with no padding, and a left-padded batch: every step's
    logits and the tokens of HF's eager attention, dynamic and static cache alike. The
    prefill of an empty static cache comes with no mask (transformers relies on SDPA's
    top-left is_causal there) over max_cache_len keys, most of them unfilled slots; it was
    attended bottom-right over all of them (first-step logits off by 0.25 for Llama)."""
    eager = eager_twin(config())
    ours = causal_lm(config(), f"fusedattn-{backend}", eager.state_dict())
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation=cache,
              output_logits=True, return_dict_in_generate=True)  # fmt: skip
    for prompt in prompts:
        torch.manual_seed(len(str(prompt)))
        if prompt == "padded":
            ids, mask = padded_batch(7)
        else:
            ids = torch.randint(3, 100, (1, prompt))
            mask = torch.ones_like(ids)
        got = ours.generate(ids, attention_mask=mask, **kw)
        want = eager.generate(ids, attention_mask=mask, **kw)
        assert torch.equal(got.sequences, want.sequences), prompt
        for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"{prompt}, step {step}")


def test_a_position_bias_without_a_mask_keeps_the_call_causal():
    """T5's decoder hands a position bias and no mask (no padding): the bias joins the scores
    and causality stays, as in transformers' sdpa path (it was dropped with the mask)."""
    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    bias = torch.randn(1, 2, 5, 5)
    got, _ = hf.attention_forward(module, q, k, v, None, position_bias=bias, backend="reference")
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=bias.masked_fill(~causal, float("-inf"))
    )
    torch.testing.assert_close(got, want.transpose(1, 2))


@pytest.mark.parametrize(
    "backend", ["reference", "torch", pytest.param("triton", marks=pytest.mark.kernels)]
)
@pytest.mark.parametrize(
    "cls,config,side",
    [("BertForMaskedLM", bert_config, "right"), ("MistralForCausalLM", mistral_config, "left")],
    ids=["bert-right", "mistral-left"],
)
def test_nan_in_padded_tokens_never_reaches_the_real_ones(cls, config, side, backend):
    """The pad token's embedding is NaN, so every padded position's key and value are NaN in
    every layer: the real positions' logits are finite and those of a finite pad embedding
    (HF's bool mask alone excludes by adding -inf, and NaN + -inf is NaN: the hook hands the
    keys no query sees to the kernels as key padding, issue #82)."""
    torch.manual_seed(0)
    clean = build(getattr(transformers, cls), config(), f"fusedattn-{backend}")
    poisoned = build(getattr(transformers, cls), config(), f"fusedattn-{backend}",
                     clean.state_dict())  # fmt: skip
    with torch.no_grad():
        poisoned.get_input_embeddings().weight[0] = float("nan")
    ids, mask = padded_batch(side=side)
    ids = ids.masked_fill(mask == 0, 0)
    real = mask.bool()
    with torch.no_grad():  # token 0's logit is NaN where the head is tied to the embedding
        want = clean(input_ids=ids, attention_mask=mask).logits[real][:, 1:]
        got = poisoned(input_ids=ids, attention_mask=mask).logits[real][:, 1:]
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want)


def test_deepseek_indices_become_the_listed_keys_within_the_mask():
    """DeepSeek-V3.2's indices= as the hook reads them: -1 entries never hide a listed key (an
    unused entry beside a real key 0), a bool mask narrowed, a float mask -inf elsewhere,
    causality kept without a mask."""
    q, k = torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 5, 4)
    idx = torch.tensor([[[0, -1, 3], [-1, 0, 4]]], dtype=torch.int32)
    module = torch.nn.Module()
    free = hf._selected_keys(idx, None, q, k, module, False)
    assert free.int().tolist() == [[[[1, 0, 0, 1, 0], [1, 0, 0, 0, 1]]]]
    causal = hf._selected_keys(idx, None, q, k, module, True)  # queries at 3, 4 (bottom-right)
    assert causal.int().tolist() == [[[[1, 0, 0, 1, 0], [1, 0, 0, 0, 1]]]]
    window = torch.ones(1, 1, 2, 5, dtype=torch.bool)
    window[..., 0] = False
    assert hf._selected_keys(idx, window, q, k, module, None).int().tolist() == [
        [[[0, 0, 0, 1, 0], [0, 0, 0, 0, 1]]]]  # fmt: skip
    bias = torch.zeros(1, 1, 2, 5)
    out = hf._selected_keys(idx, bias, q, k, module, None)
    assert torch.isinf(out).sum() == 6 and out[0, 0, 0, 0] == 0
