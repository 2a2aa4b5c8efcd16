"""Train a small decoder with its sequence sharded over W processes (context parallelism), and
check that the losses equal the single-process run's.

    python examples/context_parallel.py                    # 2 processes, gloo, on the CPU
    python examples/context_parallel.py --cp ulysses       # all-to-all over the heads instead
    torchrun --nproc-per-node 8 examples/context_parallel.py --real   # NCCL, one GPU per rank

Every rank holds 1/W of the sequence (zigzag: chunks r and 2W - 1 - r, so causal work is
balanced) and runs `fusedattn.distributed.context_parallel_attention` in each layer: with
`--cp ring` (the default) K/V travel around the ring while each block computes; with `--cp
ulysses` one all-to-all gives each rank the whole sequence for H/W heads (the head count must
divide by W), `fusedattn.attention` runs there, and one all-to-all brings the output back.
Parameters are replicated and their gradients summed over the ranks (what FSDP or DDP would do
over the same group). Rank 0 also runs the unsharded model in one process and compares the
losses step by step.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn

import fusedattn
from fusedattn import distributed as cp


class Block(nn.Module):
    def __init__(self, dim, heads, strategy="ring"):
        super().__init__()
        self.heads, self.strategy = heads, strategy
        self.norm1, self.norm2 = fusedattn.LayerNorm(dim), fusedattn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, sharded: bool):
        B, T, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, self.heads, -1).transpose(1, 3).unbind(2)
        if sharded:  # this rank's shard of attention over the whole sequence
            a = cp.context_parallel_attention(q, k, v, is_causal=True, strategy=self.strategy)
        else:
            a = fusedattn.attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, dim))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, vocab, dim, heads, layers, max_len, strategy="ring"):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, strategy) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids, positions, sharded=False):
        x = self.embed(ids) + self.pos(positions)
        for block in self.blocks:
            x = block(x, sharded)
        return self.head(x)


def batches(args, steps):
    """The same data on every rank (seeded): a repeating pattern, so the loss falls."""
    g = torch.Generator().manual_seed(0)
    pattern = torch.randint(1, args.vocab, (args.batch, 8), generator=g)
    ids = pattern.repeat(1, args.seq // 8 + 1)[:, : args.seq + 1]
    for _ in range(steps):
        yield ids[:, :-1], ids[:, 1:]  # inputs, next-token targets


def train(args, sharded: bool, device) -> list[float]:
    torch.manual_seed(0)
    model = Decoder(args.vocab, args.dim, args.heads, args.layers, args.seq, args.cp)
    model = model.to(device, args.dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2 if not args.real else 1e-3)
    positions = torch.arange(args.seq).expand(args.batch, -1)
    losses = []
    for ids, targets in batches(args, args.steps):
        ids, targets, pos = (t.to(device) for t in (ids, targets, positions))
        if sharded:
            ids, targets, pos = (cp.shard_sequence(t, dim=1) for t in (ids, targets, pos))
        logits = model(ids, pos, sharded).float()
        # each rank's share of the mean over the whole sequence; summed over ranks below
        total = nn.functional.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), reduction="sum"
        )
        loss = total / (args.batch * args.seq)
        opt.zero_grad()
        loss.backward()
        if sharded:  # replicated parameters: sum the ranks' gradients (FSDP/DDP's job)
            for p in model.parameters():
                dist.all_reduce(p.grad)
            dist.all_reduce(loss := loss.detach().clone())
        opt.step()
        losses.append(loss.item())
    return losses


def run(rank, world, args, init_file=None):
    if init_file is not None:  # spawned here: gloo on the CPU
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world
        )
    device = torch.device(f"cuda:{rank % torch.cuda.device_count()}" if args.real else "cpu")
    if args.real:
        torch.cuda.set_device(device)
    sharded = train(args, sharded=True, device=device)
    if rank == 0:
        single = train(args, sharded=False, device=device)
        for step, (a, b) in enumerate(zip(sharded, single, strict=True)):
            if step % 5 == 0 or step == len(single) - 1:
                print(f"step {step:3d}  loss {a:.5f} on {world} ranks, {b:.5f} in one process")
        tol = 2e-2 if args.real else 1e-4
        worst = max(abs(a - b) for a, b in zip(sharded, single, strict=True))
        assert worst < tol, f"losses differ by {worst:.3g}"
        assert sharded[-1] < sharded[0], "the loss did not fall"
        print(
            f"{world} ranks ({args.cp}), losses equal to the single-process run (largest "
            f"difference {worst:.2g})"
        )
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="GPU sizes, bf16, NCCL (torchrun)")
    parser.add_argument("--world", type=int, default=2, help="processes to spawn (CPU runs)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--cp", choices=("ring", "allgather", "ulysses"), default="ring",
                        help="context-parallel strategy")  # fmt: skip
    args = parser.parse_args()
    args.vocab, args.dim, args.heads, args.layers = (
        (32000, 1024, 16, 4) if args.real else (64, 64, 4, 2)
    )
    args.seq, args.batch = (32768, 1) if args.real else (64, 2)
    args.steps = args.steps or 20
    args.dtype = torch.bfloat16 if args.real else torch.float32
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group("nccl" if args.real else "gloo")
        run(dist.get_rank(), dist.get_world_size(), args)
        return
    if args.real:
        sys.exit("--real runs under torchrun (one process per GPU)")
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        torch.multiprocessing.spawn(run, args=(args.world, args, init_file), nprocs=args.world)


if __name__ == "__main__":
    main()
