"""A BERT-style encoder trained on a padded batch: the key padding reaches the kernels as a
key_padding_mask, so tiles that hold only padding are never read.

    python examples/bert_padded.py            # tiny, on the CPU
    python examples/bert_padded.py --real     # 12 layers of 768, sequences up to 512, bf16 GPU

An nn.TransformerEncoder with fusedattn's modules swapped in; sequences of random lengths are
right-padded to the longest, and src_key_padding_mask marks the padding (True = padding, as in
torch). The task: predict each token's class from its neighbours (a masked-LM stand-in); the
loss must fall.
"""

import torch
from _common import parse
from torch import nn

import fusedattn

args = parse(__doc__.splitlines()[0])
d, heads, layers, T, B, vocab = (
    (768, 12, 12, 512, 16, 30522) if args.real else (64, 4, 2, 24, 8, 50)
)
steps = args.steps or (20 if args.real else 60)
torch.manual_seed(0)

layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
embed, head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
net = nn.ModuleDict(dict(embed=embed, encoder=encoder, head=head)).to(args.device, args.dtype)
fusedattn.swap_modules(net)
opt = torch.optim.AdamW(net.parameters(), lr=1e-3 if not args.real else 1e-4)

for step in range(steps):
    lengths = torch.randint(T // 2, T + 1, (B,), device=args.device)
    padding = fusedattn.masks.padding_mask_from_lengths(lengths, T)  # (B, T), True = padding
    ids = torch.randint(1, vocab, (B, T), device=args.device).masked_fill(padding, 0)
    target = torch.roll(ids, 1, dims=1)  # each position predicts its left neighbour's token
    hidden = net["encoder"](net["embed"](ids), src_key_padding_mask=padding)
    logits = net["head"](hidden).float()
    loss = nn.functional.cross_entropy(logits[~padding], target[~padding])
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == 0:
        first = loss.item()
    if step % 10 == 0 or step == steps - 1:
        print(
            f"step {step:3d}  loss {loss.item():.3f}  real tokens {int((~padding).sum())}/{B * T}"
        )
assert loss.item() < first, "the loss did not fall"
print(f"loss {first:.3f} -> {loss.item():.3f}")
