"""Swap fusedattn into a torch nn.Transformer and train it for a few steps.

    python examples/swap_transformer.py            # tiny, on the CPU, under a minute
    python examples/swap_transformer.py --real     # d_model 1024, 16 heads, bf16 on a GPU

`fusedattn.swap_modules` replaces every nn.MultiheadAttention and nn.LayerNorm in place
(weights, device and mode kept), including inside nn.TransformerEncoderLayer, whose own fast
path is kept from bypassing them. The task: copy a random token sequence (the decoder sees
the source and learns to repeat it), so the loss must fall.
"""

import torch
from _common import parse
from torch import nn

import fusedattn

args = parse(__doc__.splitlines()[0])
d_model, heads, layers, T, B, vocab = (
    (1024, 16, 4, 1024, 8, 32000) if args.real else (64, 4, 2, 16, 8, 32)
)
steps = args.steps or (20 if args.real else 60)
torch.manual_seed(0)

embed = nn.Embedding(vocab, d_model)
model = nn.Transformer(d_model, heads, layers, layers, 4 * d_model, dropout=0.0, batch_first=True)
head = nn.Linear(d_model, vocab)
net = nn.ModuleDict(dict(embed=embed, model=model, head=head)).to(args.device, args.dtype)
fusedattn.swap_modules(net)  # backend="auto": the fastest measured kernel per call
swapped = sum(isinstance(m, fusedattn.MultiheadAttention) for m in net.modules())
print(f"{swapped} attention modules swapped")

opt = torch.optim.AdamW(net.parameters(), lr=3e-3 if not args.real else 3e-4)
causal = nn.Transformer.generate_square_subsequent_mask(T, device=args.device, dtype=args.dtype)
losses = []
for step in range(steps):
    src = torch.randint(1, vocab, (B, T), device=args.device)
    tgt_in = torch.cat([torch.zeros_like(src[:, :1]), src[:, :-1]], dim=1)  # shifted right
    out = net["model"](net["embed"](src), net["embed"](tgt_in), tgt_mask=causal, tgt_is_causal=True)
    loss = nn.functional.cross_entropy(net["head"](out).flatten(0, 1).float(), src.flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
    if step % 10 == 0 or step == steps - 1:
        print(f"step {step:3d}  loss {loss.item():.3f}")
assert losses[-1] < losses[0], "the copy task's loss did not fall"
print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
