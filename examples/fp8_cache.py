"""Generate with the KV cache in fp8: half the cache's memory, and the tokens a bf16 cache gives.

    python examples/fp8_cache.py            # a tiny random Llama in bf16, on the CPU
    python examples/fp8_cache.py --real     # Llama-3-8B's layer shapes, 4 layers, on a GPU

`FP8DynamicCache` / `FP8StaticCache` keep each layer's keys and values in float8_e4m3fn with
one descale per sequence and KV head, calibrated on the prompt. Under
attn_implementation="fusedattn" every decoding step reads the fp8 cache in the kernels (one
byte an element, dequantized in registers); docs/api.md, "FP8", has the rules and the error.
The script generates twice, bf16 cache then fp8 cache fed the bf16 run's tokens, and prints
how often the fp8 run's greedy pick is the bf16 run's on the same history.
"""

import torch
import transformers
from _common import parse

import fusedattn.integrations.huggingface as fa_hf
from fusedattn.integrations.huggingface_fp8 import FP8StaticCache, cache_bytes

args = parse(__doc__.splitlines()[0])
fa_hf.register()
if args.real:
    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=16384,
    )  # fmt: skip
    B, T, new = 8, 8192, 32
else:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    B, T, new = 8, 48, 24
config.pad_token_id, config.eos_token_id = 0, None
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="fusedattn")
model = model.to(args.device, torch.bfloat16).eval()  # a bf16 model on the CPU too


class Forced(transformers.LogitsProcessor):
    """Feeds generate the given tokens; its raw logits (output_logits) stay the model's."""

    def __init__(self, tokens):
        self.tokens, self.step = tokens, 0

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, float("-inf"))
        forced.scatter_(1, self.tokens[:, self.step, None], 0.0)
        self.step += 1
        return forced


prompt = torch.randint(1, config.vocab_size, (B, T), device=args.device)
mask = torch.ones_like(prompt)
mask[1::2, : T // 4] = 0  # every other sequence left-padded, as generate expects
kw = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0,
          output_logits=True, return_dict_in_generate=True)  # fmt: skip
with torch.inference_mode():
    bf16_cache = transformers.StaticCache(model.config, max_cache_len=T + new)
    want = model.generate(prompt, cache=bf16_cache, **kw)
    tokens = want.sequences[:, T:]
    fp8_cache = FP8StaticCache(model.config, max_cache_len=T + new)
    got = model.generate(prompt, cache=fp8_cache, logits_processor=[Forced(tokens)], **kw)

picks = torch.stack([logits.argmax(-1) for logits in got.logits], dim=1)
agree = (picks == tokens).float().mean().item()
bf16_bytes, fp8_bytes = cache_bytes(bf16_cache), cache_bytes(fp8_cache)
print(f"KV cache: bf16 {bf16_bytes / 2**20:.2f} MiB, fp8 {fp8_bytes / 2**20:.2f} MiB "
      f"({1 - fp8_bytes / bf16_bytes:.0%} saved)")  # fmt: skip
assert fp8_bytes * 2 == bf16_bytes
assert agree >= 0.8, f"the fp8 cache's greedy picks agree with bf16's on {agree:.0%} only"
print(f"greedy picks equal to the bf16 cache's on the same history: {agree:.0%} "
      f"of {picks.numel()} steps")  # fmt: skip
