"""Ulysses context parallelism (DeepSpeed-Ulysses, arXiv 2309.14509): one all-to-all moves q, k
and v from sequence shards to head shards, `fusedattn.attention` runs over the whole sequence
on this rank's H/W heads, one all-to-all moves the output back. Every variant of `attention`
holds unchanged (masks over the whole sequence, key padding, ALiBi, sinks, windows, softcap,
dropout, GQA), since each rank sees whole rows.

Heads: H / W a rank, or where W does not divide Hq the first Hq % W ranks one head more
(DeepSpeed's uneven split; then each K/V head is repeated Hq / Hkv times first, one per query
head). K/V heads are cut as the query heads when Hkv divides by W; otherwise each K/V head is
repeated lcm(Hkv, W) / Hkv times first (GQA with fewer K/V heads than ranks), so that every
rank holds the K/V heads its query heads read; the repeats' gradients sum back.
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


def head_counts(H: int, world: int) -> list[int]:
    """Heads per rank: H / W each, or where W does not divide H the first H % W ranks one
    more (DeepSpeed's uneven split, its PR #6392: 7 heads on 4 ranks as 2, 2, 2, 1)."""
    base, extra = divmod(H, world)
    return [base + (1 if w < extra else 0) for w in range(world)]


def head_slice(rank: int, world: int, H: int) -> slice:
    counts = head_counts(H, world)
    start = sum(counts[:rank])
    return slice(start, start + counts[rank])


def _all_to_all(flat: torch.Tensor, group, world: int, send=None, receive=None) -> torch.Tensor:
    """all_to_all_single of a flat tensor: part w goes to rank w, part w of the result came
    from rank w; send / receive: the parts' sizes (None: W equal parts)."""
    out = flat.new_empty(flat.numel() if receive is None else sum(receive))
    dist.all_to_all_single(out, flat.contiguous().reshape(-1), output_split_sizes=receive,
                           input_split_sizes=send, group=group)  # fmt: skip
    return out


def _even(shapes, world) -> bool:
    return all(s[1] % world == 0 for s in shapes)


def _heads_exchange(tensors, group, world, rank):
    """(B, H, n, D) sequence shards -> this rank's heads (B, h, W·n, D), rank-major: each
    rank's head group w (head_slice) goes to rank w, in one all-to-all."""
    shapes = [t.shape for t in tensors]
    counts = [head_counts(s[1], world) for s in shapes]
    send = [sum(B * c[w] * n * D for (B, _, n, D), c in zip(shapes, counts, strict=True))
            for w in range(world)]  # fmt: skip
    mine = send[rank]  # what each rank sends here: its n positions of this rank's heads
    even = _even(shapes, world)
    received = _all_to_all(_pack_heads(tensors, world), group, world,
                           None if even else send, None if even else [mine] * world)  # fmt: skip
    return _unpack_heads(received.reshape(world, mine), shapes, world, rank)


def _sequence_exchange(tensors, full_heads, group, world, rank):
    """The reverse: this rank's heads (B, h, W·n, E), rank-major -> (B, H, n, E) sequence
    shards, H = full_heads (per tensor)."""
    counts = [head_counts(H, world) for H in full_heads]
    shapes = [t.shape for t in tensors]
    n = [s[2] // world for s in shapes]
    parts = [sum(s[0] * c[w] * m * s[3] for s, c, m in zip(shapes, counts, n, strict=True))
             for w in range(world)]  # fmt: skip
    even = all(H % world == 0 for H in full_heads)
    received = _all_to_all(_pack_sequence(tensors, world), group, world,
                           None if even else [parts[rank]] * world,
                           None if even else parts)  # fmt: skip
    return _unpack_sequence(received, shapes, counts, world)


class _SeqToHeads(torch.autograd.Function):
    """(q, k, v) sequence shards (B, H, n, D) -> head shards over the rank-major sequence
    (B, h, W·n, D), in one packed all-to-all; the backward is its reverse."""

    @staticmethod
    def forward(ctx, group, world, rank, q, k, v):
        ctx.group, ctx.world, ctx.rank = group, world, rank
        ctx.heads = [t.shape[1] for t in (q, k, v)]
        return tuple(_heads_exchange([q, k, v], group, world, rank))

    @staticmethod
    def backward(ctx, dq, dk, dv):
        grads = _sequence_exchange([dq, dk, dv], ctx.heads, ctx.group, ctx.world, ctx.rank)
        return None, None, None, *grads


class _HeadsToSeq(torch.autograd.Function):
    """A head shard over the rank-major sequence (B, h, W·n, E) -> the sequence shard
    (B, H, n, E): the reverse of _SeqToHeads, for one tensor."""

    @staticmethod
    def forward(ctx, group, world, rank, H, x):
        ctx.group, ctx.world, ctx.rank = group, world, rank
        return _sequence_exchange([x], [H], group, world, rank)[0]

    @staticmethod
    def backward(ctx, dx):
        (grad,) = _heads_exchange([dx], ctx.group, ctx.world, ctx.rank)
        return None, None, None, None, grad


def _pack_heads(tensors, W):
    """(B, H, n, D) tensors -> one flat tensor: rank w's part holds every tensor's head group
    w (head_slice), in order."""
    parts = []
    for w in range(W):
        parts += [t[:, head_slice(w, W, t.shape[1])].reshape(-1) for t in tensors]
    return torch.cat(parts)


def _unpack_heads(received, shapes, W, rank):
    """Rows w = rank w's positions of this rank's head group (from _pack_heads) -> for each
    sequence-shard shape (B, H, n, D), its head shard (B, h, W·n, D), rank-major."""
    out, offset = [], 0
    for B, H, n, D in shapes:
        h = head_counts(H, W)[rank]
        size = B * h * n * D
        part = received[:, offset : offset + size].reshape(W, B, h, n, D)
        out.append(part.permute(1, 2, 0, 3, 4).reshape(B, h, W * n, D))
        offset += size
    return out


def _pack_sequence(tensors, W):
    """(B, h, W·n, D) tensors (rank-major sequence) -> one flat tensor: part w the positions
    of rank w's shard."""
    rows = [t.unflatten(2, (W, t.shape[2] // W)).permute(2, 0, 1, 3, 4).reshape(W, -1)
            for t in tensors]  # fmt: skip
    return torch.cat(rows, dim=1).reshape(-1)


def _unpack_sequence(received, shapes, counts, W):
    """Part w = head group w of this rank's sequence shard (counts[i][w] heads of tensor i)
    -> (B, H, n, D) each, shapes given as this rank's head shard (B, h, W·n, D)."""
    pieces = [[] for _ in shapes]
    offset = 0
    for w in range(W):
        for i, ((B, _, N, D), c) in enumerate(zip(shapes, counts, strict=True)):
            size = B * c[w] * (N // W) * D
            pieces[i].append(received[offset : offset + size].reshape(B, c[w], N // W, D))
            offset += size
    return [torch.cat(p, dim=1) if len(p) > 1 else p[0] for p in pieces]


def kv_repeats(Hkv: int, world: int, Hq: int | None = None) -> int:
    """How many times each K/V head is repeated so that the ranks' head groups hold whole
    K/V heads: 1 when W divides Hkv, lcm(Hkv, W) / Hkv otherwise; Hq / Hkv (every query head
    its own K/V head) when W does not divide Hq: the uneven head groups."""
    if Hq is not None and Hq % world:
        return Hq // Hkv
    return 1 if Hkv % world == 0 else math.lcm(Hkv, world) // Hkv


def to_heads(q, k, v, group, world, layout, T, rank=None):
    """This rank's sequence shards -> (q, k, v) of this rank's heads over the whole sequence
    in global order (K/V heads repeated first where W does not divide them)."""
    rank = dist.get_rank(group) if rank is None else rank
    r = kv_repeats(k.shape[1], world, q.shape[1])
    if r > 1:
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    q, k, v = _SeqToHeads.apply(group, world, rank, q, k, v)
    order = rank_major_order(world, T, layout)
    if order is not None:
        order = order.to(q.device)
        q, k, v = (t.index_select(2, order) for t in (q, k, v))
    return q, k, v


def to_sequence(x, group, world, layout, T, H, rank=None):
    """(B, h, T, E) of this rank's heads over the whole sequence in global order -> this
    rank's (B, H, T/W, E), H the heads of every rank."""
    rank = dist.get_rank(group) if rank is None else rank
    inverse = _global_to_rank_major(world, T, layout)
    if inverse is not None:
        x = x.index_select(2, inverse.to(x.device))
    return _HeadsToSeq.apply(group, world, rank, H, x)


@functools.cache  # per (W, T, layout), as rank_major_order: no argsort per call
def _global_to_rank_major(world: int, T: int, layout: str) -> torch.Tensor | None:
    order = rank_major_order(world, T, layout)
    return None if order is None else torch.argsort(order)
