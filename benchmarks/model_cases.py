"""The model benchmark's cases and the models each impl runs (bench_model.py times them).

Two families, one op name each:

- `model:<name>`, the reference transformer: `naive` (its O(T²) modules), `sdpa` (the same
  weights on torch's own F.scaled_dot_product_attention and F.layer_norm, no fusedattn code:
  model_baselines.py), `fusedattn-torch` (swap_modules on fusedattn's torch backend, its SDPA
  wrapper), `auto`, and `fusedattn-triton` / `fusedattn-cuda` where those run the model's ops;
- `hf:<name>`, Hugging Face models as users load them: transformers' own attn_implementation
  (`eager`, `sdpa`, `flash_attention_2` where flash-attn is installed) against fusedattn's hook
  (`fusedattn` = auto, `fusedattn-triton`, `fusedattn-cuda`).

GPU sizes: GPT-2 small (12 x 768, causal), BERT-base (12 x 768, padded batches: lengths
uniform in [T/2, T]) and a Llama-3-shaped decoder (4 layers of Llama-3-8B: 4096 wide, 32 query
heads over 8 KV heads, RMSNorm, SwiGLU 14336, vocabulary 128256), bf16, B*T = 16k tokens,
T = 512 and 2048. CPU: the same models at 1 layer and 128 wide, float32, T = 64.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import harness
import model_baselines
import torch

import fusedattn
from fusedattn.reference.transformer import Transformer, TransformerConfig

MODES = ("infer", "train", "infer-compiled", "train-compiled")
BASELINES = ("sdpa", "eager", "flash_attention_2")  # what a user has: the ratios' denominators
HF_HOOKS = {"fusedattn": "auto", "fusedattn-triton": "triton", "fusedattn-cuda": "cuda"}


@dataclass(frozen=True)
class Case:
    family: str  # "model" (the reference transformer) or "hf"
    name: str
    lengths: tuple[int, ...]
    tokens: int  # B * T per step
    dtype: torch.dtype
    padded: bool = False  # lengths uniform in [T/2, T], the rest padding
    config: dict = field(default_factory=dict, compare=False)

    @property
    def op(self) -> str:
        return f"{self.family}:{self.name}"


def cases(quick: bool, device: torch.device) -> list[Case]:
    gpu = device.type == "cuda"
    lengths = ((512, 2048) if quick else (512, 1024, 2048, 4096)) if gpu else (64,)
    tokens, dtype = (16384, torch.bfloat16) if gpu else (128, torch.float32)
    width = dict(d_model=768, n_heads=12, d_ff=3072) if gpu else dict(d_model=128, n_heads=4,
                                                                      d_ff=512)  # fmt: skip
    layers = 12 if gpu else 1  # one layer on the CPU: every layer runs the same ops
    common = dict(dropout=0.0, activation="gelu", max_len=max(*lengths, 128), **width)
    gpt2 = dict(vocab_size=50304 if gpu else 1000, n_encoder_layers=0, n_decoder_layers=layers,
                norm_first=True, **common)  # fmt: skip
    bert = dict(vocab_size=30528 if gpu else 1000, n_encoder_layers=layers, n_decoder_layers=0,
                **common)  # fmt: skip
    hf_width = dict(hidden=768, heads=12, kv_heads=12, ff=3072, layers=12, vocab=None)
    if not gpu:
        hf_width = dict(hidden=128, heads=4, kv_heads=4, ff=512, layers=1, vocab=1000)
    llama = dict(hidden=4096, heads=32, kv_heads=8, ff=14336, layers=4, vocab=128256)
    if not gpu:
        llama = dict(hidden=128, heads=4, kv_heads=2, ff=512, layers=1, vocab=1000)
    return [
        Case("model", "gpt2-small", lengths, tokens, dtype, config=gpt2),
        Case("model", "bert-base-padded", lengths, tokens, dtype, padded=True, config=bert),
        Case("hf", "gpt2", lengths, tokens, dtype, config=dict(hf_width, arch="gpt2")),
        Case("hf", "bert-padded", lengths, tokens, dtype, True, dict(hf_width, arch="bert")),
        Case("hf", "llama3", lengths, tokens, dtype, config=dict(llama, arch="llama")),
    ]


def flash_attn_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


def impls(case: Case, device: torch.device) -> list[str]:
    """The impls of a case, the comparisons that matter first (a run stopped by its deadline
    keeps them): auto and the user baselines, then fusedattn's own backends, then naive."""
    kernels = [f"fusedattn-{b}" for b in harness.KERNEL_BACKENDS
               if all(b in harness.kernel_backends(op, device) for op in _ops(case))]  # fmt: skip
    if case.family == "model":
        return ["auto", "sdpa", *kernels, "fusedattn-torch", "naive"]
    fa2 = ["flash_attention_2"] if device.type == "cuda" and flash_attn_installed() else []
    return ["fusedattn", "sdpa", "eager", *fa2, *kernels]


def _ops(case: Case) -> tuple[str, ...]:
    return ("attention", "layer_norm") if case.family == "model" else ("attention",)


# ---- building the models ---------------------------------------------------------------------


def build(case: Case, impl: str, device: torch.device):
    """(model, naive twin for the check) of one impl; the same weights for every impl (seed 0)."""
    torch.manual_seed(0)
    if case.family == "model":
        naive = Transformer(TransformerConfig(**case.config)).to(device=device, dtype=case.dtype)
        if impl == "naive":
            return naive, naive
        if impl == "sdpa":
            return model_baselines.sdpa_model(naive), naive
        backend = {"auto": "auto", "fusedattn-torch": "torch"}.get(impl, impl.split("-", 1)[-1])
        return fusedattn.swap_modules(copy.deepcopy(naive), backend=backend), naive
    model = hf_model(case).to(device=device, dtype=case.dtype)
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    if impl in HF_HOOKS:
        import fusedattn.integrations.huggingface as fa_hf

        fa_hf.register(impl, backend=HF_HOOKS[impl])
    model.set_attn_implementation(impl)
    return model, eager


def hf_model(case: Case):
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
    )

    c = case.config
    positions = max(*case.lengths, 128)  # the check runs at T = 128
    if c["arch"] == "gpt2":
        config = GPT2Config(vocab_size=c["vocab"] or 50257, n_positions=positions,
                            n_embd=c["hidden"], n_layer=c["layers"], n_head=c["heads"],
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=0, eos_token_id=0)  # fmt: skip
        return GPT2LMHeadModel(config)
    if c["arch"] == "bert":
        config = BertConfig(vocab_size=c["vocab"] or 30522, hidden_size=c["hidden"],
                            num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                            intermediate_size=c["ff"], max_position_embeddings=positions,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
        return BertForMaskedLM(config)
    config = LlamaConfig(vocab_size=c["vocab"], hidden_size=c["hidden"],
                         intermediate_size=c["ff"], num_hidden_layers=c["layers"],
                         num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
                         max_position_embeddings=positions, rope_theta=500000.0,
                         bos_token_id=0, eos_token_id=0)  # fmt: skip
    return LlamaForCausalLM(config)


# ---- inputs and steps ------------------------------------------------------------------------


def batch(case: Case, T: int, B: int, device, seed: int = 0) -> dict:
    """Token ids (ids >= 3: 0 is the reference transformer's pad id) and, for padded cases, a
    length per sequence uniform in [T/2, T]: `padding` (B, T) bool, True = pad."""
    g = torch.Generator().manual_seed(seed)
    vocab = case.config.get("vocab_size") or case.config.get("vocab") or 1000
    ids = torch.randint(3, min(vocab, 30000), (B, T), generator=g)
    padding = torch.zeros(B, T, dtype=torch.bool)
    if case.padded:
        lengths = torch.randint(T // 2, T + 1, (B, 1), generator=g)
        padding = torch.arange(T) >= lengths
        if case.family == "model":
            ids = ids.masked_fill(padding, 0)  # the reference transformer's pad_id
    return dict(ids=ids.to(device), padding=padding.to(device))


def forward(case: Case, model, inputs: dict) -> torch.Tensor:
    """The logits."""
    if case.family == "model":
        return model(inputs["ids"])
    mask = (~inputs["padding"]).long() if case.padded else None
    return model(input_ids=inputs["ids"], attention_mask=mask).logits


def loss(case: Case, model, inputs: dict) -> torch.Tensor:
    """The training loss: the reference transformer's own (next token, or masked-LM on every
    real token); HF: labels = the ids (-100 on padding)."""
    if case.family == "model":
        ids = inputs["ids"]
        return model.loss(ids, ids) if case.padded else model.loss(ids)
    labels = inputs["ids"].masked_fill(inputs["padding"], -100)
    mask = (~inputs["padding"]).long() if case.padded else None
    return model(input_ids=inputs["ids"], attention_mask=mask, labels=labels).loss


def check(case: Case, model, naive, device) -> str:
    """The k× verdict (k = 3) of the model's logits against its naive twin in float64, the
    baseline the twin in the model's dtype (HF: the eager implementation), at T = 128 (T = 32
    on the CPU) with the case's padding; padded positions are not compared."""
    T = 128 if device.type == "cuda" else 32
    inputs = batch(case, T, 2, device, seed=1)
    truth = copy.deepcopy(naive).double()
    with torch.no_grad():
        out, want, base = (forward(case, m, inputs) for m in (model, truth, naive))
    real = (~inputs["padding"])[..., None]
    out, want, base = (t * real for t in (out, want, base))
    return harness.correctness(out, want, base, k=3.0)
