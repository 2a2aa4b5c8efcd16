"""A Hugging Face Llama-family model on fusedattn's attention: train a few steps, then generate.

    python examples/hf_llama.py            # a tiny random Llama, on the CPU
    python examples/hf_llama.py --real     # Llama-3-8B's layer shapes, 4 layers, bf16 on a GPU

`fusedattn.integrations.huggingface.register()` adds attn_implementation="fusedattn" to
transformers (`pip install ".[hf]"`). Training runs fusedattn's attention with its backward;
generation's decoding steps run `attention_with_kvcache` over HF's KV cache on a GPU. Works
the same for Mistral (sliding window), Gemma 2 (softcap) and GPT-OSS (sinks).
"""

import torch
import transformers
from _common import parse

import fusedattn.integrations.huggingface as fa_hf

args = parse(__doc__.splitlines()[0])
fa_hf.register()
if args.real:
    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
    )  # fmt: skip
    B, T = 4, 2048
else:
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    B, T = 4, 32
config.pad_token_id, config.eos_token_id = 0, None
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="fusedattn")
model = model.to(args.device, args.dtype)

# a repeating pattern to learn: the loss must fall
pattern = torch.randint(1, config.vocab_size, (1, 8), device=args.device)
ids = pattern.repeat(B, T // 8)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3 if not args.real else 1e-4)
steps = args.steps or (10 if args.real else 30)
model.train()
for step in range(steps):
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == 0:
        first = loss.item()
    if step % 10 == 0 or step == steps - 1:
        print(f"step {step:3d}  loss {loss.item():.3f}")
assert loss.item() < first, "the loss did not fall"

model.eval()
prompt = ids[:2, :16]
mask = torch.ones_like(prompt)
mask[1, :4] = 0  # a left-padded batch, as generate expects
with torch.inference_mode():
    out = model.generate(
        prompt, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0
    )
print("generated:", out[0, 16:].tolist())
print("pattern:  ", pattern[0].tolist())
