"""Hugging Face generate with fusedattn's fp8 caches (integrations/huggingface_fp8.py): the
decode steps read the fp8 storage in the kernels, the logits are those of a float64 twin that
reads the same fp8 values (the k× rule), and the tokens agree with a bf16 cache's."""

import functools

import pytest
import torch
from dispatch_probe import count_dispatches

from fusedattn.testing import assert_close_kx

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("fusedattn.integrations.huggingface")
hf_fp8 = pytest.importorskip("fusedattn.integrations.huggingface_fp8")
from test_huggingface import (  # noqa: E402
    causal_lm,
    eager_twin,
    gemma2_config,
    llama_config,
    mistral_config,
    padded_batch,
)
from transformers.generation.utils import ALL_CACHE_NAMES  # noqa: E402

from fusedattn.ops.core import backends  # noqa: E402

# generate's cache argument: `cache` in transformers 5.24 (CI), `past_key_values` in 5.17 (the
# H200 image's), which rejects `cache` as an unused model kwarg
CACHE_ARG = "cache" if "cache" in ALL_CACHE_NAMES else "past_key_values"

# the kernels' cases on the kernel device (a GPU's when there is one): models, ids and caches
pytestmark = pytest.mark.usefixtures("kernel_device")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MODELS = [llama_config, mistral_config, gemma2_config]
NEW_TOKENS = 6


@pytest.fixture(scope="module", autouse=True)
def registered():
    for backend in ("reference", "torch", "triton"):
        hf.register(f"fusedattn-{backend}", backend=backend)


def fp8_cache(model, kind, prompt_len, **kw):
    if kind == "static":
        return hf_fp8.FP8StaticCache(model.config, max_cache_len=prompt_len + NEW_TOKENS, **kw)
    return hf_fp8.FP8DynamicCache(config=model.config, **kw)


def generate(model, ids, mask, cache, **kw):
    # eager steps: on CUDA, generate compiles the forward over a static cache by itself, and
    # the dispatch counts below see only its trace (H200: 6 and 4 of 10 steps counted)
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
        output_logits=True, return_dict_in_generate=True, disable_compile=True,
        **{CACHE_ARG: cache}, **kw,
    )  # fmt: skip


@functools.cache
def cache_update_gets_the_attention_kwargs() -> bool:
    """Whether the installed transformers' attention layers pass their keyword arguments on
    to cache.update, where fusedattn's fp8 layers put the descales that hand the fp8 storage
    itself to the attention (transformers 5.24's do; 5.17's, the H200 image's, call
    update(k, v, layer_idx) and get the dequantized values back: huggingface_fp8's fallback)."""
    seen = []

    class Recording(transformers.DynamicCache):
        def update(self, *args, **kwargs):
            seen.append(isinstance(kwargs.get("kwargs"), dict))
            return super().update(*args, **kwargs)

    model = causal_lm(llama_config(), "eager")
    with torch.no_grad():
        model(torch.ones(1, 2, dtype=torch.long), **{CACHE_ARG: Recording()})
    return all(seen) and bool(seen)


def kernel_reads(dtype, model_dtype, n) -> list:
    """What CacheDtypes records for n decode calls over an fp8 cache of `dtype`: the fp8
    storage with both descales, or on a transformers whose models keep their kwargs from the
    cache (above) the dequantized values in the model's dtype without descales."""
    if cache_update_gets_the_attention_kwargs():
        return [(dtype, dtype, True)] * n
    return [(model_dtype, model_dtype, False)] * n


class CacheDtypes:
    """Records the cache dtypes of every attention_with_kvcache call of `backend`, and whether
    both descales came with them."""

    def __init__(self, backend):
        self.backend, self.dtypes = backend, []

    def __enter__(self):
        impls = backends._REGISTRY["attention_with_kvcache"]
        self.real = real = impls[self.backend]

        def recording(**inputs):
            descaled = inputs["k_descale"] is not None and inputs["v_descale"] is not None
            self.dtypes.append((inputs["k_cache"].dtype, inputs["v_cache"].dtype, descaled))
            return real.run(**inputs)

        impls[self.backend] = backends.Implementation(real.op, real.backend, recording,
                                                      real.refusals)  # fmt: skip
        return self

    def __exit__(self, *exc):
        backends._REGISTRY["attention_with_kvcache"][self.backend] = self.real


TWIN_CASES = [
    (config, kind, "reference", dtype)
    for config in MODELS for kind in ("dynamic", "static") for dtype in (E4M3, E5M2)
] + [  # the kernels in the interpreter, e4m3 (e5m2 through them: test_fp8.py's grids)
    pytest.param(llama_config, "dynamic", "triton", E4M3, marks=pytest.mark.kernels),
    pytest.param(mistral_config, "static", "triton", E4M3, marks=pytest.mark.kernels),
    pytest.param(gemma2_config, "static", "triton", E4M3, marks=pytest.mark.kernels),
]  # fmt: skip


@pytest.mark.parametrize(
    "config,kind,backend,dtype", TWIN_CASES, ids=lambda x: getattr(x, "__name__", str(x))[:9]
)
def test_fp8_cache_logits_are_a_float64_twins_reading_the_same_fp8_values(
    config, kind, backend, dtype
):
    """Every decode step of every layer reads the fp8 storage (in the kernels for Triton);
    every step's logits pass the k× rule against a float64 eager model whose fp8 cache
    (dequantized, as under any other attn_implementation) holds the same values, the float32
    eager model the yardstick: the fp8 cache's rounding is the only error it adds."""
    eager = eager_twin(config())
    ours = causal_lm(config(), f"fusedattn-{backend}", eager.state_dict())
    truth = causal_lm(config(), "eager", eager.state_dict()).double()
    torch.manual_seed(1)
    ids = torch.randint(3, 100, (2, 8))
    mask = torch.ones_like(ids)
    with count_dispatches() as counts, CacheDtypes(backend) as seen:
        got = generate(ours, ids, mask, fp8_cache(ours, kind, 8, dtype=dtype))
    want = generate(truth, ids, mask, fp8_cache(truth, kind, 8, dtype=dtype))
    base = generate(eager, ids, mask, fp8_cache(eager, kind, 8, dtype=dtype))
    steps = NEW_TOKENS - 1
    assert counts[("attention_with_kvcache", backend)] == 2 * steps  # two layers
    assert seen.dtypes == kernel_reads(dtype, torch.float32, 2 * steps)
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b, c) in enumerate(zip(got.logits, want.logits, base.logits, strict=True)):
        assert_close_kx(a, b, c, k=3.0, name=f"step {step} logits")


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("config", MODELS, ids=lambda c: c.__name__[:-7])
def test_a_left_padded_batch_generates_as_eager_over_the_same_fp8_cache(config, kind):
    """Left padding (the mask's holes) over fp8 storage: the tokens and logits of HF's eager
    attention reading the same fp8 values dequantized (float32, as the bf16-cache tests).
    The descales are given, the same to both: calibrated, they would differ, as a padding
    row's keys do (fusedattn gives a row with no key 0, HF's eager path a mean of values)."""
    eager = eager_twin(config())
    ours = causal_lm(config(), "fusedattn-reference", eager.state_dict())
    ids, mask = padded_batch(8)
    calibrating = fp8_cache(ours, kind, 8)
    generate(ours, ids, mask, calibrating)
    given = dict(k_descale=[layer.k_descale for layer in calibrating.layers],
                 v_descale=[layer.v_descale for layer in calibrating.layers])  # fmt: skip
    got = generate(ours, ids, mask, fp8_cache(ours, kind, 8, **given))
    want = generate(eager, ids, mask, fp8_cache(eager, kind, 8, **given))
    assert torch.equal(got.sequences, want.sequences)
    for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"step {step}")


# The fp8 cache against a bf16 one (docs/modules.md, "FP8 KV caches for generate"):
# bf16 models, 8 prompts (4 left-padded), 16 new tokens, the fp8 run fed the bf16 run's tokens
# (teacher forcing: every step compares the same history). Measured on the CPU over 5 seeds:
# the greedy pick agrees on 85-100 % of the steps (mean 93-100 %; a float32 model against the
# same bf16 one: 88-100 %, mean 94-100 %, so the tiny random models' near-ties decide most
# disagreements), the logits' largest difference is at most 5.4 % of their spread (max - min
# over the vocabulary; bf16 arithmetic alone: 0.8 %), under e4m3's rounding of one element,
# 2^-4 of its value.
AGREEMENT_TOKENS = 16
MIN_AGREEMENT = 0.8
MAX_RELATIVE_LOGIT_ERROR = 2.0**-4


class Forced(transformers.LogitsProcessor):
    """Makes generate pick the given tokens (the raw logits, output_logits, are untouched)."""

    def __init__(self, tokens):
        self.tokens, self.step = tokens, 0

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, float("-inf"))
        forced.scatter_(1, self.tokens[:, self.step, None], 0.0)
        self.step += 1
        return forced


@pytest.mark.parametrize("kind", ["dynamic", "static"])
@pytest.mark.parametrize("config", MODELS, ids=lambda c: c.__name__[:-7])
def test_the_fp8_cache_agrees_with_the_bf16_cache(config, kind):
    model = causal_lm(config(), "fusedattn-reference", eager_twin(config()).state_dict())
    model = model.to(torch.bfloat16)
    torch.manual_seed(2)
    ids = torch.randint(3, 100, (8, 10))
    mask = torch.ones_like(ids)
    mask[1::2, :3] = 0  # left padding
    capacity = ids.shape[1] + AGREEMENT_TOKENS
    kw = dict(attention_mask=mask, max_new_tokens=AGREEMENT_TOKENS, do_sample=False,
              pad_token_id=0, output_logits=True, return_dict_in_generate=True)  # fmt: skip
    if kind == "static":
        bf16_cache = transformers.StaticCache(model.config, max_cache_len=capacity)
        cache = hf_fp8.FP8StaticCache(model.config, max_cache_len=capacity)
    else:
        bf16_cache = transformers.DynamicCache(config=model.config)
        cache = hf_fp8.FP8DynamicCache(config=model.config)
    want = model.generate(ids, **{CACHE_ARG: bf16_cache}, **kw)
    tokens = want.sequences[:, ids.shape[1] :]
    got = model.generate(ids, logits_processor=[Forced(tokens)], **{CACHE_ARG: cache}, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert hf_fp8.cache_bytes(cache) * 2 == hf_fp8.cache_bytes(bf16_cache)  # 1 byte, not 2
    picks = torch.stack([a.argmax(-1) for a in got.logits], 1)
    agreement = (picks == tokens).float().mean().item()
    assert agreement >= MIN_AGREEMENT, agreement
    for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        spread = (b.float().amax(-1) - b.float().amin(-1)).amax()
        error = (a.float() - b.float()).abs().amax()
        assert error <= MAX_RELATIVE_LOGIT_ERROR * spread, (step, error.item(), spread.item())


def test_beam_search_reorders_the_descales_with_the_cache():
    """Beams reorder and repeat the batch: each sequence's descales follow its rows (the
    eager model over the same fp8 cache gives the same beams)."""
    eager = eager_twin(llama_config())
    ours = causal_lm(llama_config(), "fusedattn-reference", eager.state_dict())
    ids, mask = padded_batch(8)
    kw = dict(num_beams=3, num_return_sequences=2)
    got = generate(ours, ids, mask, hf_fp8.FP8DynamicCache(config=ours.config), **kw)
    want = generate(eager, ids, mask, hf_fp8.FP8DynamicCache(config=eager.config), **kw)
    assert torch.equal(got.sequences, want.sequences)


def test_given_descales_and_the_calibrated_ones():
    """The descales are the prompt's max |x| / 448 per sequence and KV head, or as given: one
    value for every layer, a list with one per layer, a (B, Hkv) tensor; a reset calibrates
    again at the next prompt."""
    model = causal_lm(llama_config(), "fusedattn-reference")
    ids = torch.randint(3, 100, (2, 5))
    cache = hf_fp8.FP8DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, **{CACHE_ARG: cache})
    layer = cache.layers[0]
    assert layer.k_descale.shape == (2, 2) and layer.k_descale.dtype == torch.float32
    stored = layer.keys.float() * layer.k_descale[:, :, None, None]
    assert torch.equal(layer.keys.float().abs().amax((2, 3)), torch.full((2, 2), 448.0))
    assert stored.abs().amax() > 0
    cache.reset()
    assert layer.k_descale is None

    per_head = torch.tensor([[0.5, 0.25], [1.0, 2.0]])
    cache = hf_fp8.FP8StaticCache(model.config, max_cache_len=8, k_descale=[0.01, per_head],
                                  v_descale=0.02)  # fmt: skip
    with torch.no_grad():
        model(ids, **{CACHE_ARG: cache})
    assert torch.equal(cache.layers[0].k_descale, torch.tensor(0.01))
    assert torch.equal(cache.layers[1].k_descale, per_head)
    assert torch.equal(cache.layers[1].v_descale, torch.tensor(0.02))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(k_descale=0.0), "k_descale must be positive and finite"),
        (dict(v_descale=float("nan")), "v_descale must be positive and finite"),
        (dict(k_descale=torch.ones(3)), "k_descale must hold one value or be"),
        (dict(k_descale=torch.ones(2, 3)), r"k_descale must be \(B, Hkv\) = \(2, 2\)"),
        (dict(k_descale=torch.ones(2, 2, dtype=torch.int32)), "k_descale must be a float"),
        (dict(k_descale=[1.0]), "one entry per layer"),
        (dict(dtype=torch.bfloat16), "dtype must be one of"),
    ],
)
def test_bad_cache_arguments_are_named(kwargs, message):
    model = causal_lm(llama_config(), "fusedattn-reference")
    with pytest.raises(ValueError, match=message):
        cache = hf_fp8.FP8DynamicCache(config=model.config, **kwargs)
        with torch.no_grad():
            model(torch.randint(3, 100, (2, 5)), **{CACHE_ARG: cache})


def test_an_fp8_descale_without_fp8_keys_is_refused():
    q = torch.randn(1, 4, 1, 8)
    k = torch.randn(1, 2, 5, 8)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="k_descale and v_descale come with fp8 keys"):
        hf.attention_forward(module, q, k, k, None, k_descale=torch.ones(1, 2),
                             v_descale=torch.ones(1, 2))  # fmt: skip
    with pytest.raises(ValueError, match="k_descale and v_descale come with fp8 keys"):
        hf.attention_forward(module, q, k.to(E4M3), k.to(E4M3), None)


def test_without_a_config_every_layer_grows_as_a_full_attention_layer():
    """FP8DynamicCache() (no config): the layers come as the model asks for them, full
    attention, read as fp8; Llama (no window) generates as with the config's cache."""
    model = causal_lm(
        llama_config(), "fusedattn-reference", eager_twin(llama_config()).state_dict()
    )
    ids, mask = padded_batch(8)
    with CacheDtypes("reference") as seen:
        got = generate(model, ids, mask, hf_fp8.FP8DynamicCache())
    want = generate(model, ids, mask, hf_fp8.FP8DynamicCache(config=model.config))
    assert seen.dtypes == kernel_reads(E4M3, torch.float32, 2 * (NEW_TOKENS - 1))
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits, strict=True):
        assert torch.equal(a, b)
