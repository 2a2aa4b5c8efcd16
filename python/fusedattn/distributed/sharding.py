"""Sharding a sequence over the ranks of a group: which positions each rank holds, and the
shard <-> whole-sequence moves every strategy's callers use.

layout "contiguous": rank r holds chunk r of W; "zigzag": the sequence cut in 2W chunks, rank
r holds chunks r and 2W - 1 - r (every rank the same causal work).
"""

from __future__ import annotations

import functools
import numbers

import torch
import torch.distributed as dist

from ..checks import check_tensor

LAYOUTS = ("zigzag", "contiguous")


def _world(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def chunk_offsets(rank: int, world: int, T: int, layout: str) -> list[tuple[int, int]]:
    """(global start, length) of each chunk rank `rank` holds of a sequence of T positions."""
    _check_layout(layout)
    if layout == "contiguous":
        if T % world:
            raise ValueError(
                f"layout='contiguous' needs a sequence length divisible by W={world}, got {T}"
            )
        n = T // world
        return [(rank * n, n)]
    if T % (2 * world):
        raise ValueError(
            f"layout='zigzag' cuts the sequence in 2W = {2 * world} chunks: its length must be "
            f"divisible by {2 * world}, got {T}"
        )
    c = T // (2 * world)
    return [(rank * c, c), ((2 * world - 1 - rank) * c, c)]


def _check_sequence(x, dim) -> int:
    """x a tensor and dim one of its dims (made non-negative)."""
    check_tensor("x", x)
    if isinstance(dim, bool) or not isinstance(dim, numbers.Integral):
        raise TypeError(f"dim must be an int, got {dim!r}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for x with {x.dim()} dimensions")
    return int(dim) % x.dim()


def shard_sequence(x: torch.Tensor, dim: int, group=None, layout: str = "zigzag") -> torch.Tensor:
    """This rank's shard of x along `dim` (the whole sequence, the same on every rank)."""
    dim = _check_sequence(x, dim)
    world, rank = _world(group)
    parts = [
        x.narrow(dim, start, n) for start, n in chunk_offsets(rank, world, x.shape[dim], layout)
    ]
    return torch.cat(parts, dim=dim) if len(parts) > 1 else parts[0].contiguous()


def unshard_sequence(x: torch.Tensor, dim: int, group=None, layout: str = "zigzag") -> torch.Tensor:
    """The whole sequence from every rank's shard x along `dim` (an all-gather; the same on
    every rank)."""
    dim = _check_sequence(x, dim)
    world, _ = _world(group)
    _check_layout(layout)
    shards = [_dense_like(x) for _ in range(world)]
    dist.all_gather(shards, x.contiguous(), group=group)
    T = x.shape[dim] * world
    pieces = []
    for r, shard in enumerate(shards):
        local = 0
        for start, n in chunk_offsets(r, world, T, layout):
            pieces.append((start, shard.narrow(dim, local, n)))
            local += n
    return torch.cat([p for _, p in sorted(pieces, key=lambda item: item[0])], dim=dim)


def _dense_like(t: torch.Tensor) -> torch.Tensor:
    """An empty contiguous tensor of t's shape: collectives and p2p want dense buffers (a
    shard is often a transposed view)."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


@functools.cache  # a layer's every call asks for the same few orders
def rank_major_order(world: int, T: int, layout: str) -> torch.Tensor | None:
    """The index of each global position in the rank-major concatenation of every rank's shard
    (rank 0's positions first, in its local order): `whole = rank_major[..., order, ...]`. None
    when the two orders are the same (contiguous)."""
    if layout == "contiguous":
        return None
    order = torch.empty(T, dtype=torch.long)
    local = 0
    for r in range(world):
        for start, n in chunk_offsets(r, world, T, layout):
            order[start : start + n] = torch.arange(local, local + n)
            local += n
    return order
