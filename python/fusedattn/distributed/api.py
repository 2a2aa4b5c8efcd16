"""`context_parallel_attention` and `context_parallel_varlen_attention`: the arguments checked
(on every rank, before any collective that could hang), then the strategy's path: ring and
all-gather (ring.py), Ulysses (ulysses.py), or USP, Ulysses inside and the ring across."""

from __future__ import annotations

import functools
import numbers
import zlib

import torch
import torch.distributed as dist

from ..block_mask import heads_of, is_torch_block_mask
from ..checks import (
    check_attention_args,
    check_bool,
    check_dropout,
    check_varlen_args,
)
from ..ops import attention, varlen_attention
from ..ops.attention.api import check_block_mask, flex_backend
from ..ops.core import backends
from ..score_mod import prepare as prepare_score_mod
from . import ring, ulysses
from .sharding import _check_layout, _world, chunk_offsets

STRATEGIES = ("ring", "allgather", "ulysses", "usp")
BACKENDS = ("auto", "triton", "reference", "torch")
# What the key-splitting strategies cannot take: each rank holds only some keys of a row.
WHOLE_ROW_ONLY = ("attn_mask", "key_padding_mask", "alibi_slopes")


def _agree(shapes: list[int], crc: int, error: Exception | None, groups, device) -> None:
    """Every rank's shard shapes and options are equal and no rank's own checks failed, learnt
    through one small all-gather per group in `groups` (a 2-D mesh: its rows, then its
    columns, reach every rank). Raises on every rank: shards of other shapes first, naming
    each rank's (a sequence that W does not divide comes as shards of two lengths, and each
    rank's own checks see only its own), then a rank's own error where it has one, else
    which ranks refused, else the options."""
    flag = 1 if error is not None else 0  # 1: a refusal seen, 2: differing shapes seen
    differ = None  # the rows of the first group whose shapes differ
    for group in groups:
        world = dist.get_world_size(group)
        meta = torch.tensor([flag, *shapes, crc], dtype=torch.int64)
        if dist.get_backend(group) == "nccl":
            meta = meta.to(device)
        gathered = [torch.empty_like(meta) for _ in range(world)]
        dist.all_gather(gathered, meta, group=group)
        rows = [g.tolist() for g in gathered]
        if differ is None and any(r[1:-1] != rows[0][1:-1] for r in rows):
            differ = rows
        options_differ = any(r[-1] != rows[0][-1] for r in rows)
        flag = max([flag, 2 if differ else 0, 1 if options_differ else 0] + [r[0] for r in rows])
        refused = [i for i, r in enumerate(rows) if r[0] == 1]
    if differ is not None or flag == 2:
        per_rank = "another group's ranks"
        if differ is not None:
            per_rank = "; ".join(f"rank {i}: {_shapes_str(r[1:-1])}" for i, r in enumerate(differ))
        raise ValueError(
            f"context_parallel_attention: the ranks' shards differ ({per_rank}); every rank "
            "must pass its shard of the same sequence (T/W positions each, of a length T that "
            "W divides, 2W with layout='zigzag': pad the sequence to it) with the same heads "
            "and head dims"
        )
    if error is not None:
        raise error
    if flag:
        which = f"rank(s) {refused} of the group" if refused else "a rank"
        raise ValueError(
            f"context_parallel_attention: {which} refused its inputs or passed other options "
            "(that rank's error says which); every rank must pass its shard of the same "
            "sequence with the same arguments"
        )


def _shapes_str(fields: list[int]) -> str:
    """q, k, v shapes from _shape_fields' flat list (5 fields a tensor)."""
    return ", ".join(
        f"{name} {tuple(fields[5 * i + 1 : 5 * i + 1 + fields[5 * i]])}"
        for i, name in enumerate(("q", "k", "v"))
    )


def _shape_fields(*tensors) -> list[int]:
    """Each tensor's rank and dims, padded to a fixed length (4-D at most is read)."""
    fields = []
    for t in tensors:
        dims = list(t.shape[:4])
        fields += [len(dims), *dims, *([0] * (4 - len(dims)))]
    return fields


def _options_crc(*options) -> int:
    return zlib.crc32(repr(options).encode())


def _heads(name: str, count: int, world: int) -> None:
    if count < world:
        raise ValueError(
            f"strategy 'ulysses' shards the heads over the group: {name} = {count} query heads "
            f"are fewer than W = {world} ranks (a rank would hold none: pick a smaller "
            "degree, or the ring strategy)"
        )


def _check_usp_groups(u_group, r_group) -> None:
    """USP's convention: the Ulysses groups are runs of consecutive ranks and the ring groups
    stride over them by U, so that the rank at ring position r and Ulysses position u holds
    shard r·U + u of the sequence (a DeviceMesh (R, U) named ("ring", "ulysses"): its rows
    are the Ulysses groups; yunchang's use_ulysses_low=True). Other groupings (strided
    Ulysses groups, a mesh whose names are swapped) would attend to the wrong positions."""
    u_ranks = dist.get_process_group_ranks(u_group)
    r_ranks = dist.get_process_group_ranks(r_group)
    U = len(u_ranks)
    consecutive = u_ranks == list(range(u_ranks[0], u_ranks[0] + U))
    strided = r_ranks == list(range(r_ranks[0], r_ranks[0] + U * len(r_ranks), U))
    if not (consecutive and strided):
        raise ValueError(
            "strategy 'usp' needs Ulysses groups of consecutive ranks and ring groups that "
            "stride over them by U (the rank at ring position r and Ulysses position u holds "
            "shard r*U + u of the sequence: a DeviceMesh of shape (R, U) with mesh_dim_names "
            f"('ring', 'ulysses'), or yunchang's use_ulysses_low=True); got the Ulysses group "
            f"{u_ranks} and the ring group {r_ranks} of rank {dist.get_rank()}"
        )


def _full_shape(t: torch.Tensor, shape) -> torch.Tensor:
    """A tensor of `shape` on t's device and dtype holding one row of storage (every other
    dim of stride 0): what the checks see of the whole sequence, without its memory."""
    return t.new_empty((shape[-1],)).as_strided(shape, (0,) * (len(shape) - 1) + (1,))


def _slice_heads(x, rank, world, H, dim):
    """x's rank-th share of its head dim `dim` when it has one of size H (> 1), else x (the
    shares of ulysses.head_counts: uneven where W does not divide H)."""
    if x is None or x.dim() < -dim or x.shape[dim] != H or H == 1:
        return x
    heads = ulysses.head_slice(rank, world, H)
    return x.narrow(dim, heads.start, heads.stop - heads.start)


def _check_flex(flex, full, backend) -> dict:
    """A Ulysses call's block mask (for the whole sequence and all Hq heads) and score_mod
    checked as `attention` checks them (before any collective); the score_mod prepared, as
    the backend choice sees it."""
    out = {}
    if flex["block_mask"] is not None:
        check_block_mask(flex["block_mask"], full[0], full[1])
    if flex["score_mod"] is not None:
        out["score_mod"] = prepare_score_mod(flex["score_mod"], full[0].device)
    if out or flex["block_mask"] is not None:
        flex_backend(backend, full[0], flex["block_mask"], flex["score_mod"])
    return out


def _flex_fields(flex) -> tuple:
    """What every rank must agree on of a block mask (its sizes; its blocks are the caller's
    to keep equal, as an attn_mask's values are)."""
    mask = flex["block_mask"]
    if not is_torch_block_mask(mask):  # None, or refused by _check_flex on every rank
        return (None if mask is None else type(mask).__name__, flex["score_mod"] is not None)
    sizes = tuple(mask.kv_num_blocks.shape), tuple(mask.seq_lengths), str(mask.BLOCK_SIZE)
    return (*sizes, flex["score_mod"] is not None)


def _rank_flex(flex, device, rank, world, H) -> dict:
    """The block mask and score_mod of this rank's query heads: a per-head mask's share of
    the heads (block_mask.heads_of, h offset), a score_mod called with h the head's number
    among all Hq."""
    out = {}
    heads = ulysses.head_slice(rank, world, H)
    if flex["block_mask"] is not None:
        out["block_mask"] = heads_of(flex["block_mask"], heads, device)
    if flex["score_mod"] is not None:
        mod = flex["score_mod"]
        out["score_mod"] = mod if heads.start == 0 else functools.partial(
            _offset_heads, mod, heads.start)  # fmt: skip
    return out


def _offset_heads(score_mod, start, score, b, h, q_idx, kv_idx):
    return score_mod(score, b, h + start, q_idx, kv_idx)


def _mesh_groups(group):
    """(ulysses group, ring group) of USP's `group`: a pair, or a DeviceMesh with dimensions
    named "ring" and "ulysses"."""
    if isinstance(group, tuple | list) and len(group) == 2:
        return group[0], group[1]
    names = getattr(group, "mesh_dim_names", None)
    if names and set(names) == {"ring", "ulysses"}:
        return group.get_group("ulysses"), group.get_group("ring")
    raise ValueError(
        "strategy 'usp' takes group=(ulysses_group, ring_group) or a 2-D DeviceMesh with "
        f"dimensions named 'ring' and 'ulysses', got {group!r}"
    )


class _LseWithoutGradient(torch.autograd.Function):
    """The lse of the Ulysses strategies, returned beside an output that has a gradient: a
    backward through it raises, naming why, instead of leaving its part of dq and dk out.
    (Its own all-to-all back would be a second collective in the backward, run only on the
    ranks whose loss reads it; the ring strategy differentiates its lse.)"""

    @staticmethod
    def forward(ctx, lse, anchor, strategy):
        ctx.strategy = strategy
        return lse.clone()

    @staticmethod
    def backward(ctx, _dlse):
        raise RuntimeError(
            f"context_parallel_attention(strategy={ctx.strategy!r}) returns an lse without a "
            "gradient: a loss that reads it would lose that part of dq and dk. Detach it "
            "(lse.detach()), or use strategy='ring', whose lse is differentiable"
        )


def _lse_refusing_backward(lse, out, strategy):
    if torch.is_grad_enabled() and out.requires_grad:
        return _LseWithoutGradient.apply(lse, out, strategy)
    return lse


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    window_size: tuple[int, int] | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    layout: str = "zigzag",
    strategy: str = "ring",
    dropout_p: float = 0.0,
    return_lse: bool = False,
    backend: str = "auto",
    attn_mask: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    block_mask=None,
    score_mod=None,
):
    """This rank's shard of `fusedattn.attention` over the whole sequence; see the package
    docstring. q (B, Hq, T/W, D), k (B, Hkv, T/W, D), v (B, Hkv, T/W, Dv): this rank's shard
    (`shard_sequence`). attn_mask, key_padding_mask, alibi_slopes, block_mask and score_mod
    (strategy "ulysses" only) are the whole sequence's, the same on every rank: a block mask
    built for (Q_LEN, KV_LEN) = (T, T) in natural order whatever the layout, a score_mod's
    q_idx and kv_idx positions in the whole sequence and h the query head of all Hq (each
    rank runs its heads' share of a per-head mask). Returns out (B, Hq, T/W, Dv)
    [, lse (B, Hq, T/W) float32]."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context_parallel_attention needs torch.distributed initialised")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    _check_layout(layout)
    if backend not in BACKENDS:
        raise ValueError(
            f"backend must be one of {BACKENDS} for context parallelism, got {backend!r}"
        )
    check_dropout(dropout_p)
    check_bool("return_lse", return_lse)
    given = {"attn_mask": attn_mask, "key_padding_mask": key_padding_mask,
             "alibi_slopes": alibi_slopes}  # fmt: skip
    flex = {"block_mask": block_mask, "score_mod": score_mod}
    if strategy in ("ulysses", "usp"):
        return _ulysses(q, k, v, group, is_causal, scale, enable_gqa, window_size, softcap,
                        sinks, layout, strategy, dropout_p, return_lse, backend, given, flex)  # fmt: skip
    whole_row = [name for name, value in {**given, **flex}.items() if value is not None]
    if whole_row:
        raise ValueError(
            f"strategy {strategy!r} splits each row's keys over the ranks and cannot take "
            f"{', '.join(whole_row)}: use strategy='ulysses' (every rank sees whole rows)"
        )
    if dropout_p:
        raise ValueError(
            f"strategy {strategy!r} does not take dropout (dropout_p={dropout_p}): each block "
            "would draw its own mask, so the result would not be attention with dropout on the "
            "whole sequence (strategy='ulysses' takes it)"
        )
    window = check_attention_args(
        q, k, v, None, 0.0, is_causal, scale, enable_gqa, None, window_size=window_size,
        softcap=softcap, sinks=sinks,
    )  # fmt: skip
    world, rank = _world(group)
    if backend == "auto":
        backend = "triton" if q.is_cuda else "torch"
    ring._check_backend(q, k, v, scale, enable_gqa, window, softcap, backend)
    cfg = ring._Config(
        group=group, world=world, rank=rank, T=q.shape[2] * world, layout=layout,
        strategy=strategy, is_causal=is_causal, window=(window.left, window.right),
        scale=scale, scale_value=q.shape[-1] ** -0.5 if scale is None else float(scale),
        softcap=float(softcap), enable_gqa=enable_gqa, backend=backend,
    )  # fmt: skip
    ring._global_check(q, k, v, sinks, cfg, group, world)
    out, lse = ring.ring_attention(q, k, v, sinks, cfg)
    return (out, lse) if return_lse else out


def _ulysses(q, k, v, group, is_causal, scale, enable_gqa, window_size, softcap, sinks, layout,
             strategy, dropout_p, return_lse, backend, given, flex):  # fmt: skip
    """Ulysses (or USP: Ulysses inside group[0], the ring across group[1])."""
    usp = strategy == "usp"
    u_group, r_group = _mesh_groups(group) if usp else (group, None)
    U, u_rank = _world(u_group)
    R, r_rank = _world(r_group) if usp else (1, 0)
    n = q.shape[2] if q.dim() == 4 else 0
    T = n * U * R
    error = None
    try:  # every local check; a failure is raised on every rank by _agree, never a hang
        if usp:
            _check_usp_groups(u_group, r_group)
            whole_row = [name for name, value in {**given, **flex}.items() if value is not None]
            if whole_row or dropout_p:
                what = ", ".join(whole_row + (["dropout_p"] if dropout_p else []))
                raise ValueError(
                    f"strategy 'usp' runs the ring across its ring groups and cannot take "
                    f"{what}: use strategy='ulysses'"
                )
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
            raise ValueError(
                "q, k and v must be (B, H, T/W, D) shards, got shapes "
                f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        chunk_offsets(0, U * R, T, layout)  # divisibility
        B, Hq, _, D = q.shape
        _heads("Hq", Hq, U)
        full = [_full_shape(t, (t.shape[0], t.shape[1], T, t.shape[3])) for t in (q, k, v)]
        window = check_attention_args(
            *full, given["attn_mask"], dropout_p, is_causal, scale, enable_gqa,
            given["key_padding_mask"], window_size=window_size, softcap=softcap,
            alibi_slopes=given["alibi_slopes"], sinks=sinks,
        )  # fmt: skip
        if backend == "auto":
            backend = "triton" if q.is_cuda else "torch"
        kv_all = k.shape[1] * ulysses.kv_repeats(k.shape[1], U, Hq)
        kv_heads = ulysses.head_counts(kv_all, U)[u_rank]
        q_heads = ulysses.head_counts(Hq, U)[u_rank]
        heads = [_full_shape(t, (B, h, T, t.shape[3]))
                 for t, h in ((q, q_heads), (k, kv_heads), (v, kv_heads))]  # fmt: skip
        if usp:  # the ring's blocks on this rank's heads
            ring._check_backend(*heads, scale, True, window, softcap, backend)
        else:
            flex_args = _check_flex(flex, full, backend)
            backends.select("attention", backend, q.device, dict(
                q=heads[0], k=heads[1], v=heads[2], attn_mask=given["attn_mask"],
                dropout_p=dropout_p, scale=scale, enable_gqa=True,
                key_padding_mask=given["key_padding_mask"], window=window,
                softcap=float(softcap), alibi_slopes=given["alibi_slopes"], sinks=sinks,
                return_lse=return_lse, **flex_args,
            ))  # fmt: skip
    except (ValueError, TypeError) as exc:
        error = exc
    crc = _options_crc(layout, strategy, is_causal, window_size, softcap, scale, dropout_p,
                       return_lse, backend, str(q.dtype), *(None if t is None else
                       tuple(t.shape) for t in (*given.values(), sinks)),
                       *_flex_fields(flex))  # fmt: skip
    _agree(_shape_fields(q, k, v), crc, error, [u_group] if not usp else [u_group, r_group],
           q.device)  # fmt: skip
    qh, kh, vh = ulysses.to_heads(q, k, v, u_group, U, layout, n * U, u_rank)
    hs = dict(rank=u_rank, world=U, H=Hq)
    sinks_h = _slice_heads(sinks, dim=-1, **hs)
    if usp:
        # the Ulysses group's shards are this ring member's: the layout's chunks over R (a
        # zigzag over W = U·R puts chunks r·U .. r·U + U - 1 and their mirror on ring rank r)
        cfg = ring._Config(
            group=r_group, world=R, rank=r_rank, T=T, layout=layout, strategy="ring",
            is_causal=is_causal, window=(window.left, window.right), scale=scale,
            scale_value=D**-0.5 if scale is None else float(scale), softcap=float(softcap),
            enable_gqa=True, backend=backend,
        )  # fmt: skip
        out, lse = ring.ring_attention(qh, kh, vh, sinks_h, cfg)  # _agree checked both groups
    else:
        result = attention(
            qh, kh, vh, _slice_heads(given["attn_mask"], dim=-3, **hs), dropout_p, is_causal,
            scale, qh.shape[1] != kh.shape[1], key_padding_mask=given["key_padding_mask"],
            window_size=window_size, softcap=softcap,
            alibi_slopes=_slice_heads(given["alibi_slopes"], dim=-1, **hs), sinks=sinks_h,
            return_lse=return_lse, backend=backend, **_rank_flex(flex, qh.device, **hs),
        )  # fmt: skip
        out, lse = result if return_lse else (result, None)
    out = ulysses.to_sequence(out, u_group, U, layout, n * U, Hq, u_rank)
    if not return_lse:
        return out
    lse = ulysses.to_sequence(lse.detach().unsqueeze(-1), u_group, U, layout, n * U, Hq, u_rank)
    return out, _lse_refusing_backward(lse.squeeze(-1), out, strategy)


def context_parallel_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    group=None,
    strategy: str = "ulysses",
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    window_size: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    causal_alignment: str = "top_left",
    return_lse: bool = False,
    backend: str = "auto",
):
    """This rank's share of `fusedattn.varlen_attention` over the whole packed batch: the
    packed tokens split evenly over the W ranks (rank r holds tokens r·N/W .. (r+1)·N/W - 1 of
    q, and of k and v, N each's total), documents free to cross the cuts; cu_seqlens_* and
    max_seqlen_* are the whole batch's, the same on every rank. q (N_q/W, Hq, D), k, v
    (N_k/W, Hkv, D[v]). Returns (N_q/W, Hq, Dv) [, lse (Hq, N_q/W) float32]. Strategy
    "ulysses" only: the ring cannot isolate one document from another."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context_parallel_varlen_attention needs torch.distributed initialised")
    if strategy != "ulysses":
        raise ValueError(
            f"context_parallel_varlen_attention runs strategy 'ulysses' only, got {strategy!r}: "
            "splitting keys over the ranks cannot keep the documents of a packed batch apart"
        )
    if backend not in BACKENDS:
        raise ValueError(
            f"backend must be one of {BACKENDS} for context parallelism, got {backend!r}"
        )
    W, rank = _world(group)
    error = None
    try:
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise ValueError(
                "q, k and v must be packed (N/W, H, D) shards, got shapes "
                f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
        _heads("Hq", q.shape[1], W)
        for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {value!r}")
        full = [_full_shape(t, (t.shape[0] * W, *t.shape[1:])) for t in (q, k, v)]
        check_varlen_args(
            *full, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            is_causal, scale, enable_gqa, window_size=window_size,
            softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
            causal_alignment=causal_alignment, return_lse=return_lse,
        )  # fmt: skip
        for name, cu, t in (("cu_seqlens_q", cu_seqlens_q, q), ("cu_seqlens_k", cu_seqlens_k, k)):
            total = int(cu[-1])  # on the host: a packed call's lengths are read there anyway
            if total != t.shape[0] * W:
                raise ValueError(
                    f"{name}[-1] = {total} tokens in the batch, but the W = {W} shards hold "
                    f"{t.shape[0]} each ({t.shape[0] * W}): split the packed tokens evenly, "
                    "padding the batch to a multiple of W"
                )
    except (ValueError, TypeError) as exc:
        error = exc
    crc = _options_crc(is_causal, window_size, softcap, scale, dropout_p, causal_alignment,
                       return_lse, backend, str(q.dtype), max_seqlen_q, max_seqlen_k,
                       enable_gqa)  # fmt: skip
    _agree(_shape_fields(q, k, v), crc, error, [group], q.device)
    as_dense = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]  # (1, H, N/W, D) views
    Tq = q.shape[0] * W
    qh, kh, vh = ulysses.to_heads(*as_dense, group, W, "contiguous", None, rank)
    qh, kh, vh = (t[0].transpose(0, 1) for t in (qh, kh, vh))  # (N, H/W, D)
    hs = dict(rank=rank, world=W, H=q.shape[1])
    result = varlen_attention(
        qh, kh, vh, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        is_causal, scale, qh.shape[1] != kh.shape[1], window_size=window_size, softcap=softcap,
        alibi_slopes=_slice_heads(alibi_slopes, dim=-1, **hs),
        sinks=_slice_heads(sinks, dim=-1, **hs), causal_alignment=causal_alignment,
        return_lse=return_lse, backend=backend,
    )  # fmt: skip
    out, lse = result if return_lse else (result, None)
    Hq = q.shape[1]
    out = ulysses.to_sequence(out.transpose(0, 1).unsqueeze(0), group, W, "contiguous", Tq, Hq,
                              rank)  # fmt: skip
    out = out[0].transpose(0, 1)
    if not return_lse:
        return out
    lse = ulysses.to_sequence(lse.detach()[None, :, :, None], group, W, "contiguous", Tq, Hq,
                              rank)  # fmt: skip
    return out, _lse_refusing_backward(lse[0, :, :, 0], out, "ulysses")
