"""Packed documents trained with a document mask: FlexAttention's mask_mod and BlockMask, no
compile. Each row of the batch packs several documents; a token sees the earlier tokens of
its own document only. The mask is built once per batch (no T x T tensor) and every layer's
attention runs it: on a GPU the Triton kernels visit only the blocks it lists, forward and
backward; on a CPU the dense mask it stands for.

    python examples/document_mask.py            # a tiny model, on the CPU
    python examples/document_mask.py --real      # 8k tokens per row, 4 layers, bf16 GPU

The packed logits are checked against each document run alone, then the model trains.
"""

import torch
import torch.nn.functional as F
from _common import parse

import fusedattn
from fusedattn.masks import create_block_mask

args = parse(__doc__.splitlines()[0])
torch.manual_seed(0)
B, T, d, H, layers, vocab = (2, 8192, 1024, 8, 4, 32000) if args.real else (2, 96, 32, 2, 2, 64)
block = 128 if args.real else 32


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = fusedattn.RMSNorm(d), fusedattn.RMSNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)
        )

    def forward(self, x, block_mask):
        q, k, v = self.qkv(self.norm1(x)).view(*x.shape[:2], 3, H, d // H).permute(2, 0, 3, 1, 4)
        y = fusedattn.attention(q, k, v, block_mask=block_mask)
        x = x + self.proj(y.transpose(1, 2).flatten(2))
        return x + self.mlp(self.norm2(x))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens, block_mask):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, block_mask)
        return self.head(x)


def pack(generator):
    """B rows of T tokens, each row documents of random lengths; doc[b, i] numbers them."""
    doc = torch.zeros(B, T, dtype=torch.long)
    for b in range(B):
        cuts = torch.randint(1, T, (5,), generator=generator).sort().values
        doc[b] = torch.bucketize(torch.arange(T), cuts, right=True)
    tokens = torch.randint(0, vocab, (B, T), generator=generator)
    return tokens.to(args.device), doc.to(args.device)


def document_mask(doc):
    def mask_mod(b, h, q, kv):
        return (doc[b, q] == doc[b, kv]) & (q >= kv)

    # built once for the batch, shared by every layer (H None: the same for every head)
    return create_block_mask(mask_mod, B, None, T, T, device=args.device, BLOCK_SIZE=block)


model = Model().to(args.device, args.dtype)
g = torch.Generator().manual_seed(1)
tokens, doc = pack(g)
bm = document_mask(doc)
print(f"document mask over {B} x {T} tokens: {bm}")
with torch.no_grad():
    logits = model(tokens, bm)
    for b in range(B):
        for n in doc[b].unique():
            rows = (doc[b] == n).nonzero().flatten()
            one = tokens[b : b + 1, rows]
            alone_mask = create_block_mask(lambda b_, h, q, kv: q >= kv, None, None, len(rows),
                                           len(rows), device=args.device, BLOCK_SIZE=block)  # fmt: skip
            err = (model(one, alone_mask)[0] - logits[b, rows]).abs().max().item()
            assert err < (5e-2 if args.real else 1e-4), f"row {b}, document {n}: {err}"
print("each packed document's logits equal its own run")

opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
steps = args.steps or (10 if args.real else 20)
for step in range(steps):
    tokens, doc = pack(g)
    tokens = torch.cumsum(tokens % 2, 1) % vocab  # a learnable pattern
    bm = document_mask(doc)
    labels = tokens[:, 1:].masked_fill(doc[:, 1:] != doc[:, :-1], -100)  # no label across documents
    logits = model(tokens, bm)[:, :-1]
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 5 == 0:
        print(f"step {step} loss {loss.item():.3f}")
print(f"step {steps} loss {loss.item():.3f}")
