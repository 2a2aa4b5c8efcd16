"""Synthetic seq2seq tasks for the reference transformer: digit reversal, trained in seconds on
a CPU, used by the tests and the training demo (benchmarks/bench_demo.py)."""

from __future__ import annotations

import math

import torch

PAD, BOS, EOS, FIRST_DIGIT = 0, 1, 2, 3
VOCAB = FIRST_DIGIT + 10


def reversal_batch(n: int, max_len: int = 8, generator=None, device=None):
    """src = digit strings of length 1..max_len (padded); tgt = [bos, reversed, eos] (padded)."""
    src = torch.full((n, max_len), PAD)
    tgt = torch.full((n, max_len + 2), PAD)
    lengths = torch.randint(1, max_len + 1, (n,), generator=generator)
    for i, length in enumerate(lengths.tolist()):
        digits = torch.randint(FIRST_DIGIT, VOCAB, (length,), generator=generator)
        src[i, :length] = digits
        tgt[i, 0], tgt[i, 1 : length + 1], tgt[i, length + 1] = BOS, digits.flip(0), EOS
    return src.to(device), tgt.to(device)


def exact_match(generated: torch.Tensor, tgt: torch.Tensor) -> float:
    """Share of rows whose generated tokens up to and including eos equal tgt[1:]."""
    hits = 0
    for row, target in zip(generated.tolist(), tgt.tolist(), strict=True):
        answer = [t for t in target[1:] if t != PAD]
        hits += row[: len(answer)] == answer
    return hits / len(tgt)


def train_reversal(model, steps: int = 700, batch: int = 64, lr: float = 3e-3, seed: int = 0):
    """AdamW with 50 warm-up steps then cosine decay to 0 (the loss settles near 1e-3 by step
    500 for a 2+2-layer d=64 model). Returns the per-step losses. The data stream depends only
    on `seed`, so two models see the same batches."""
    device = next(model.parameters()).device
    data = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    model.train()
    losses = []
    for _ in range(steps):
        src, tgt = reversal_batch(batch, generator=data, device=device)
        loss = model.loss(src, tgt)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        losses.append(loss.item())
    return losses
