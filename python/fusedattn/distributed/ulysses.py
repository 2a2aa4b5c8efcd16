"""Ulysses context parallelism (DeepSpeed-Ulysses, arXiv 2309.14509): one all-to-all moves q, k
and v from sequence shards to head shards, `fusedattn.attention` runs over the whole sequence
on this rank's H/W heads, one all-to-all moves the output back. Every variant of `attention`
holds unchanged (masks over the whole sequence, key padding, ALiBi, sinks, windows, softcap,
dropout, GQA), since each rank sees whole rows.

Heads: Hq must divide by W. K/V heads are cut the same way when Hkv divides by W; otherwise
each K/V head is repeated lcm(Hkv, W) / Hkv times first (GQA with fewer K/V heads than ranks),
so that every rank holds the K/V heads its query heads read; the repeats' gradients sum back.
Per-head inputs (sinks, ALiBi slopes, a mask or bias with a head dimension) are sliced to the
rank's heads: their gradients are this rank's part.

Bytes per rank and direction: each all-to-all sends (W - 1)/W of the local tensor, so the
forward moves (W - 1)/W · (n·Hq·D + n·Hkv'·(D + Dv) + n·Hq·Dv) elements per rank (n = T/W,
Hkv' the K/V heads after any repeat) whatever W is; the backward the same again.

The all-to-alls are differentiable (their backward is the reverse all-to-all) and one per
direction: q, k and v travel packed in one, so every rank runs its collectives in the same
order in the backward too.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist

from .sharding import rank_major_order


def _all_to_all(flat: torch.Tensor, group) -> torch.Tensor:
    """all_to_all_single of a (W, ...) tensor: chunk w goes to rank w; returns what every rank
    sent here, chunk w from rank w."""
    out = torch.empty_like(flat)
    dist.all_to_all_single(out, flat.contiguous(), group=group)
    return out


class _SeqToHeads(torch.autograd.Function):
    """(q, k, v) sequence shards (B, H, n, D) -> head shards over the rank-major sequence
    (B, H/W, W·n, D), in one packed all-to-all; the backward is its reverse."""

    @staticmethod
    def forward(ctx, group, world, q, k, v):
        ctx.group, ctx.world = group, world
        ctx.shapes = [t.shape for t in (q, k, v)]
        packed = _pack_heads([q, k, v], world)
        return tuple(_unpack_heads(_all_to_all(packed, group), ctx.shapes, world))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        W = ctx.world
        local = [(s[0], s[1] // W, s[2] * W, s[3]) for s in ctx.shapes]
        packed = _pack_sequence([dq, dk, dv], W)
        grads = _unpack_sequence(_all_to_all(packed, ctx.group), local, W)
        return None, None, *grads


class _HeadsToSeq(torch.autograd.Function):
    """A head shard over the rank-major sequence (B, H/W, W·n, E) -> the sequence shard
    (B, H, n, E): the reverse of _SeqToHeads, for one tensor."""

    @staticmethod
    def forward(ctx, group, world, x):
        ctx.group, ctx.world, ctx.shape = group, world, x.shape
        packed = _pack_sequence([x], world)
        return _unpack_sequence(_all_to_all(packed, group), [x.shape], world)[0]

    @staticmethod
    def backward(ctx, dx):
        W = ctx.world
        packed = _pack_heads([dx], W)
        (grad,) = _unpack_heads(_all_to_all(packed, ctx.group), [dx.shape], W)
        return None, None, grad


def _pack_heads(tensors, W):
    """(B, H, n, D) tensors -> (W, total) with row w holding every tensor's head group w."""
    rows = [t.unflatten(1, (W, t.shape[1] // W)).transpose(0, 1).reshape(W, -1) for t in tensors]
    return torch.cat(rows, dim=1)


def _unpack_heads(received, shapes, W):
    """Rows w = rank w's positions of this rank's head group (from _pack_heads) -> for each
    sequence-shard shape (B, H, n, D), its head shard (B, H/W, W·n, D), rank-major."""
    out, offset = [], 0
    for B, H, n, D in shapes:
        size = B * (H // W) * n * D
        part = received[:, offset : offset + size].reshape(W, B, H // W, n, D)
        out.append(part.permute(1, 2, 0, 3, 4).reshape(B, H // W, W * n, D))
        offset += size
    return out


def _pack_sequence(tensors, W):
    """(B, h, W·n, D) tensors (rank-major sequence) -> (W, total): row w the positions of rank
    w's shard."""
    rows = [t.unflatten(2, (W, t.shape[2] // W)).permute(2, 0, 1, 3, 4).reshape(W, -1)
            for t in tensors]  # fmt: skip
    return torch.cat(rows, dim=1)


def _unpack_sequence(received, shapes, W):
    """Rows w = head group w of this rank's sequence shard -> (B, H, n, D) each, shapes given
    as the head-shard (B, h, W·n, D)."""
    out, offset = [], 0
    for B, h, N, D in shapes:
        n = N // W
        size = B * h * n * D
        part = received[:, offset : offset + size].reshape(W, B, h, n, D)
        out.append(part.transpose(0, 1).reshape(B, W * h, n, D))
        offset += size
    return out


def kv_repeats(Hkv: int, world: int) -> int:
    """How many times each K/V head is repeated so that the ranks' head groups hold whole
    K/V heads: 1 when W divides Hkv, lcm(Hkv, W) / Hkv otherwise."""
    return 1 if Hkv % world == 0 else math.lcm(Hkv, world) // Hkv


def head_slice(rank: int, world: int, H: int) -> slice:
    return slice(rank * H // world, (rank + 1) * H // world)


def to_heads(q, k, v, group, world, layout, T):
    """This rank's sequence shards -> (q, k, v) of this rank's heads over the whole sequence
    in global order (K/V heads repeated first where W does not divide them)."""
    r = kv_repeats(k.shape[1], world)
    if r > 1:
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    q, k, v = _SeqToHeads.apply(group, world, q, k, v)
    order = rank_major_order(world, T, layout)
    if order is not None:
        order = order.to(q.device)
        q, k, v = (t.index_select(2, order) for t in (q, k, v))
    return q, k, v


def to_sequence(x, group, world, layout, T):
    """(B, H/W, T, E) over the whole sequence in global order -> this rank's (B, H, T/W, E)."""
    inverse = _global_to_rank_major(world, T, layout)
    if inverse is not None:
        x = x.index_select(2, inverse.to(x.device))
    return _HeadsToSeq.apply(group, world, x)


@functools.cache  # per (W, T, layout), as rank_major_order: no argsort per call
def _global_to_rank_major(world: int, T: int, layout: str) -> torch.Tensor | None:
    order = rank_major_order(world, T, layout)
    return None if order is None else torch.argsort(order)
