"""Packed sequences without padding: transformers' DataCollatorWithFlattening packs a batch
into one row and passes cu_seqlens, which fusedattn runs as `varlen_attention` (no token of
padding computed, no sequence seeing another).

    python examples/packed_sequences.py            # a tiny random Llama, on the CPU
    python examples/packed_sequences.py --real     # Llama-3-8B's layer shapes, 2 layers, bf16 GPU

The packed logits are checked against each sequence run alone, then the model trains a few
steps on packed batches.
"""

import torch
import transformers
from _common import parse
from transformers import DataCollatorWithFlattening

import fusedattn.integrations.huggingface as fa_hf

args = parse(__doc__.splitlines()[0])
fa_hf.register()
size = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
            vocab_size=128256) if args.real else dict(hidden_size=64, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=128)  # fmt: skip
config = transformers.LlamaConfig(num_hidden_layers=2, max_position_embeddings=4096, **size)
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="fusedattn")
model = model.to(args.device, args.dtype)
collate = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
lengths = [700, 1500, 300, 1200] if args.real else [7, 15, 3, 12]


def batch():
    seqs = [torch.randint(1, config.vocab_size, (n,)).tolist() for n in lengths]
    packed = collate([{"input_ids": s} for s in seqs])
    return seqs, {k: v.to(args.device) if torch.is_tensor(v) else v for k, v in packed.items()}


model.eval()
seqs, packed = batch()
with torch.inference_mode():
    logits = model(**{k: v for k, v in packed.items() if k != "labels"}).logits[0]
    start = 0
    for seq in seqs:
        alone = model(input_ids=torch.tensor([seq], device=args.device)).logits[0]
        err = (logits[start : start + len(seq)] - alone).abs().max().item()
        assert err < (5e-2 if args.real else 1e-4), f"packed and alone differ by {err}"
        start += len(seq)
print(f"{len(seqs)} sequences packed into {sum(lengths)} tokens: each equals its own run")

model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3 if not args.real else 1e-4)
steps = args.steps or (10 if args.real else 20)
pattern = torch.randint(1, config.vocab_size, (8,)).tolist()
for step in range(steps):
    seqs = [(pattern * (n // 8 + 1))[:n] for n in lengths]
    packed = collate([{"input_ids": s} for s in seqs])
    packed = {k: v.to(args.device) if torch.is_tensor(v) else v for k, v in packed.items()}
    loss = model(**packed).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == 0:
        first = loss.item()
    if step % 5 == 0 or step == steps - 1:
        print(f"step {step:3d}  loss {loss.item():.3f}")
assert loss.item() < first, "the loss did not fall"
