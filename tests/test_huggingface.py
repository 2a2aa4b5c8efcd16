"""transformers models on fusedattn's attention: randomly initialised BERT and GPT-2 built from
configs (no downloads) give the logits of their own SDPA path, and fusedattn really runs."""

import pytest
import torch
from dispatch_probe import count_dispatches

from fusedattn.testing import assert_close_kx

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("fusedattn.integrations.huggingface")


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
    assert counts[("attention", "torch")] >= 2 * 6  # prefill + decoding steps, two layers


def test_softcap_is_refused_clearly():
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(ValueError, match="softcap"):
        hf.attention_forward(torch.nn.Module(), q, q, q, None, softcap=30.0)
