"""FSDP2 (torch.distributed.fsdp.fully_shard) with fusedattn (issue #34), gloo on the CPU: a
model with the drop-in modules swapped in trains with the losses and gradients of the
unsharded model, and so does a decoder whose attention layers run
context_parallel_attention over a sharded sequence (examples/context_parallel.py's model)."""

import sys
from pathlib import Path

import pytest
import torch
from distributed_helpers import run_group

pytestmark = pytest.mark.slow  # processes started per test: not in the quick subset

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def encoder():
    import fusedattn

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    return fusedattn.swap_modules(model)


def swapped_worker(rank, world, steps=3):
    """Every rank trains its FSDP shard on the same batch (FSDP averages the gradients: the
    single process's); rank 0 also trains the unsharded model. -> (losses, single losses,
    largest gradient difference, largest parameter difference)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fusedattn

    mesh = init_device_mesh("cpu", (world,))
    sharded, single = encoder(), encoder()
    assert any(isinstance(m, fusedattn.MultiheadAttention) for m in sharded.modules())
    for layer in sharded.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (sharded, single)]
    x = torch.randn(3, 10, 32, generator=torch.Generator().manual_seed(1))
    pad = torch.zeros(3, 10, dtype=torch.bool)
    pad[1, 7:] = True
    losses, grad_diff = {0: [], 1: []}, 0.0
    for step in range(steps):
        for i, (model, opt) in enumerate(zip((sharded, single), opts, strict=True)):
            loss = model(x, src_key_padding_mask=pad).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            if step == 0 and i == 1:
                for a, b in zip(sharded.parameters(), single.parameters(), strict=True):
                    grad_diff = max(grad_diff, (a.grad.full_tensor() - b.grad).abs().max().item())
            opt.step()
            losses[i].append(loss.item())
    param_diff = max(
        (a.full_tensor() - b).abs().max().item()
        for a, b in zip(sharded.parameters(), single.parameters(), strict=True)
    )
    return losses[0], losses[1], grad_diff, param_diff


def test_fully_shard_of_a_swapped_model_trains_like_the_unsharded_one():
    for losses, single, grad_diff, param_diff in run_group(swapped_worker, 2, timeout=180):
        assert max(abs(a - b) for a, b in zip(losses, single, strict=True)) < 1e-5
        assert grad_diff < 1e-5 and param_diff < 1e-5


def context_parallel_worker(rank, world, steps=4):
    """The example's decoder, its sequence sharded (zigzag) and its parameters sharded by FSDP
    over the same ranks; the local loss is scaled by W since FSDP averages gradients where
    context parallelism needs their sum. Rank 0 also trains the unsharded model."""
    sys.path.insert(0, str(EXAMPLES))
    import context_parallel as example
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fusedattn import distributed as cp

    args = type("Args", (), dict(vocab=64, dim=32, heads=4, layers=2, seq=24, batch=2))
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    sharded = example.Decoder(args.vocab, args.dim, args.heads, args.layers, args.seq)
    torch.manual_seed(0)
    single = example.Decoder(args.vocab, args.dim, args.heads, args.layers, args.seq)
    for block in sharded.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    # SGD: parameters follow the gradients linearly (Adam would blow a 1e-9 difference in a
    # near-zero gradient up to a step of lr)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (sharded, single)]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, args.vocab, (args.batch, args.seq + 1), generator=g)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    positions = torch.arange(args.seq).expand(args.batch, -1)
    mine = [cp.shard_sequence(t, dim=1) for t in (inputs, targets, positions)]
    ce = torch.nn.functional.cross_entropy
    losses, single_losses = [], []
    for _ in range(steps):
        logits = sharded(mine[0], mine[2], sharded=True)
        total = ce(logits.flatten(0, 1), mine[1].flatten(), reduction="sum")
        loss = total / (args.batch * args.seq)
        opts[0].zero_grad()
        (loss * world).backward()  # FSDP averages over the ranks; the global loss is a sum
        opts[0].step()
        dist.all_reduce(loss := loss.detach().clone())
        losses.append(loss.item())
        logits = single(inputs, positions)
        loss = ce(logits.flatten(0, 1), targets.flatten())
        opts[1].zero_grad()
        loss.backward()
        opts[1].step()
        single_losses.append(loss.item())
    param_diff = max(
        (a.full_tensor() - b).abs().max().item()
        for a, b in zip(sharded.parameters(), single.parameters(), strict=True)
    )
    return losses, single_losses, param_diff


def test_fully_shard_with_context_parallel_attention_trains_like_one_process():
    for losses, single, param_diff in run_group(context_parallel_worker, 2, timeout=180):
        assert max(abs(a - b) for a, b in zip(losses, single, strict=True)) < 1e-4, (losses, single)
        assert param_diff < 1e-4
        assert losses[-1] < losses[0]
