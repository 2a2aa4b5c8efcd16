"""A learnable relative-position bias (T5 / ALiBi-free style) as a FlexAttention score_mod, no
compile: each head adds table[h, q_idx - kv_idx + T - 1] to its scores, and the table learns
from the loss like any parameter. fusedattn traces the mod once into the Triton kernels
(on a GPU; on a CPU the torch backend runs it densely), reads the table by pointer (a new
value never recompiles) and gives its gradient.

    python examples/learnable_relative_bias.py           # a tiny model, on the CPU
    python examples/learnable_relative_bias.py --real     # 4k tokens, 4 layers, bf16 GPU

The task is to repeat the token 3 places back: the bias learns where to look. First the mod
is checked against the same bias as a dense float mask (output and the table's gradient).
"""

import torch
import torch.nn.functional as F
from _common import parse

import fusedattn
from fusedattn.masks import create_block_mask

args = parse(__doc__.splitlines()[0])
torch.manual_seed(0)
B, T, d, H, layers, vocab = (8, 4096, 1024, 8, 4, 512) if args.real else (8, 48, 32, 2, 1, 16)
DELAY = 3


class RelativeBiasAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.table = torch.nn.Parameter(torch.zeros(H, 2 * T - 1))  # one bias per distance

    def score_mod(self, score, b, h, q_idx, kv_idx):
        return score + self.table[h, q_idx - kv_idx + T - 1]

    def forward(self, x, block_mask):
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, H, d // H).permute(2, 0, 3, 1, 4)
        y = fusedattn.attention(q, k, v, block_mask=block_mask, score_mod=self.score_mod)
        return self.proj(y.transpose(1, 2).flatten(2))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.attn = torch.nn.ModuleList(RelativeBiasAttention() for _ in range(layers))
        self.norms = torch.nn.ModuleList(fusedattn.RMSNorm(d) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens, block_mask):
        x = self.embed(tokens)
        for norm, attn in zip(self.norms, self.attn, strict=True):
            x = x + attn(norm(x), block_mask)
        return self.head(x)


model = Model().to(args.device, args.dtype)
causal = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, T, T, device=args.device)

# the mod against the same bias as a dense float mask (-inf above the diagonal)
attn = model.attn[0]
with torch.no_grad():
    attn.table.normal_(0.0, 0.5)
x = torch.randn(2, T, d, device=args.device, dtype=args.dtype)
positions = torch.arange(T, device=args.device)
distance = positions[:, None] - positions[None, :] + T - 1
dense = attn.table[:, distance].masked_fill(distance < T - 1, float("-inf"))  # (H, T, T)
q, k, v = attn.qkv(x).view(2, T, 3, H, d // H).permute(2, 0, 3, 1, 4)
with_mod = fusedattn.attention(q, k, v, block_mask=causal, score_mod=attn.score_mod)
with_mask = fusedattn.attention(q, k, v, attn_mask=dense)
(g_mod,) = torch.autograd.grad(with_mod.float().square().sum(), attn.table)
(g_mask,) = torch.autograd.grad(with_mask.float().square().sum(), attn.table)
tol = 3e-2 if args.real else 1e-5
err = (with_mod - with_mask).abs().max().item()
g_err = ((g_mod - g_mask).abs().max() / g_mask.abs().max()).item()
assert err < tol and g_err < tol, (err, g_err)
print(f"score_mod == dense bias mask: output {err:.1e}, table gradient {g_err:.1e} (relative)")
with torch.no_grad():
    attn.table.zero_()

opt = torch.optim.AdamW(model.parameters(), lr=3e-3 if args.real else 1e-2)
steps = args.steps or (40 if args.real else 60)
g = torch.Generator().manual_seed(1)
first = None
for step in range(steps):
    tokens = torch.randint(0, vocab, (B, T), generator=g).to(args.device)
    labels = torch.roll(tokens, DELAY, 1)  # the token 3 places back...
    labels[:, :DELAY] = -100  # ...where there is one
    logits = model(tokens, causal)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
    opt.zero_grad()
    loss.backward()
    opt.step()
    first = loss.item() if first is None else first
    if step % 10 == 0:
        print(f"step {step} loss {loss.item():.3f}")
peaks = model.attn[0].table.detach().float()[:, T - 1 :].argmax(1)  # index T - 1: distance 0
print(f"each head's bias peaks at distance {peaks.tolist()} (the task's: {DELAY})")
assert args.real or DELAY in peaks.tolist(), "no head learned where to look"
assert loss.item() < 0.7 * first, f"the loss did not fall: {first:.3f} -> {loss.item():.3f}"
print(f"step {steps} loss {loss.item():.3f}")
