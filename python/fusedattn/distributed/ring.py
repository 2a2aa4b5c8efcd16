"""Ring and all-gather context parallelism: this rank's query chunks against every rank's K/V
chunk, block by block.

- strategy "ring": K/V (the Hkv heads only) travel rank to rank with batched point-to-point
  operations, the next block's transfer in flight while the kernel works on the block at hand;
  in the backward dK/dV accumulators travel with their K/V and arrive back at their owner.
  "allgather": K/V gathered once, dK/dV summed back to their owners by a reduce-scatter.
- Blocks that causal masking or a window hides entirely are never computed; a block that the
  mask cuts runs as one kernel call with its keys or queries sliced so that the cut is a
  top-left window (`_band`).
- Partial outputs and log-sum-exps merge in fp32 (out = sum of exp(lse_b - lse) * out_b), dQ
  accumulates in fp32 and dK/dV travel in fp32: no bf16 rounding per hop, so the error does
  not grow with W. float64 inputs merge, accumulate and travel in float64. The backward of a block uses the whole row's out and lse (the row's
  probabilities restricted to the block), so nothing is recomputed twice.
- sinks join each row's normaliser once, after the merge; each rank's sinks gradient is its
  part (the data-parallel reduction sums them, as for every parameter).
- Backends: "triton" (the kernels, their backward taking the row's out and lse), "reference"
  (naive blocks, float64 capable), "torch" (SDPA for a block's output; its lse, which SDPA
  does not return, from the block's scores, naively). Dropout is refused: blocks would draw
  independent masks.
"""

from __future__ import annotations

import warnings
import zlib
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..masks import NO_WINDOW, Window, window_mask
from ..ops import attention
from ..ops.attention import custom_ops
from ..ops.core import backends
from ..reference.attention import attention_scores, expand_kv_heads, log_sum_exp
from .sharding import _dense_like, chunk_offsets

STRATEGIES = ("ring", "allgather")


# ---- one block: a query chunk against a key chunk ----------------------------------------------


def _band(n: int, m: int, lo, hi):
    """Query rows i < n see keys j < m iff lo <= j - i <= hi (None = unbounded). -> None when
    no pair is visible, else (q_start, k_start, window_size or None) such that rows
    q_start.. against keys k_start.. are exactly that under a top-left `window_size` (rows
    before q_start see nothing)."""
    if (lo is not None and lo > m - 1) or (hi is not None and hi < -(n - 1)):
        return None
    q_start = k_start = 0
    if lo is not None and lo > 0:  # keys before lo are never seen: start the keys there
        k_start, hi, lo = lo, None if hi is None else hi - lo, 0
    if hi is not None and hi < 0:  # rows before -hi see nothing: start the queries there
        q_start, lo, hi = -hi, None if lo is None else lo - hi, 0
    n, m = n - q_start, m - k_start
    if (lo is None or lo <= -(n - 1)) and (hi is None or hi >= m - 1):
        return q_start, k_start, None  # every pair visible: no mask
    return q_start, k_start, (-1 if lo is None else -lo, -1 if hi is None else hi)


class Block(NamedTuple):
    """The visible part of one (query chunk, K/V chunk) pair: local rows of this rank's q,
    local keys of the owner's K/V, the top-left window that cuts them (None: every pair
    visible), and the global positions of their first row and key."""

    rows: slice
    keys: slice
    window: tuple[int, int] | None
    q_global: int
    k_global: int


def _block_of(q_chunk, k_chunk, cfg) -> Block | None:
    """The Block of a query chunk and a key chunk, each (global offset, local offset, length),
    or None when no pair of them is visible."""
    (q_off, q_local, n), (k_off, k_local, m) = q_chunk, k_chunk
    d = q_off - k_off  # query i at global q_off + i sees key j at k_off + j iff
    # (q_off + i) - left <= k_off + j <= (q_off + i) + right: d - left <= j - i <= d + right
    left, right = cfg.window
    band = _band(n, m, None if left < 0 else d - left, None if right < 0 else d + right)
    if band is None:
        return None
    q_start, k_start, window = band
    return Block(
        slice(q_local + q_start, q_local + n), slice(k_local + k_start, k_local + m), window,
        q_off + q_start, k_off + k_start,
    )  # fmt: skip


def _block_forward(q, k, v, window, cfg):
    """(out fp32, lse) of the query rows q against the keys k, v under the top-left window."""
    if cfg.backend == "triton":  # the kernel, its output kept in fp32 for the merge
        left, right = window or (-1, -1)
        out, lse, _ = custom_ops._attention_forward(
            q, k, v, None, None, None, None, None, None, 0, 0, left,
            right, False, cfg.scale_value, cfg.softcap, 0.0, None, "triton",
            out_dtype=torch.float32,
        )  # fmt: skip
        return out, lse
    kw = dict(scale=cfg.scale, enable_gqa=cfg.enable_gqa, window_size=window,
              softcap=cfg.softcap)  # fmt: skip
    acc = merge_dtype(q)
    if cfg.backend == "torch" or acc == torch.float64:
        # SDPA returns no lse, and the reference's is float32: the block's scores' (float64
        # for float64 inputs, whose merge would otherwise be float32-accurate, 5e-7)
        out = attention(q, k, v, backend=cfg.backend, **kw)
        scores = attention_scores(q, k, None, scale=cfg.scale, softcap=cfg.softcap,
                                  window=NO_WINDOW if window is None else Window(*window))  # fmt: skip
        return out.to(acc), log_sum_exp(scores, acc)
    out, lse = attention(q, k, v, return_lse=True, backend=cfg.backend, **kw)
    return out.float(), lse


def merge_dtype(q: torch.Tensor) -> torch.dtype:
    """What partial outputs, lse and gradients merge in: float64 for float64 inputs (the
    reference and torch backends), fp32 for the rest."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _block_backward(dout, q, k, v, out, lse, window, cfg, dlse=None):
    """(dq, dk, dv) in fp32 of the query rows q against the keys k, v, from the rows' whole
    out and lse (the row's probabilities restricted to these keys); dlse: the whole lse's
    gradient at these rows (its row term delta - dlse holds for every block of the row)."""
    lse = lse.contiguous()  # the kernels read lse as a dense (B, H, T), not through strides
    if cfg.backend == "triton":
        left, right = window or (-1, -1)
        dq, dk, dv, _, _ = custom_ops._attention_backward(
            dout, q, k, v, out, lse, None, None, None, None, None, None, 0, 0, left, right,
            False, cfg.scale_value, cfg.softcap, 0.0, None, False, "triton",
            delta_from_out=True, grads_dtype=torch.float32, dlse=dlse,
        )  # fmt: skip
        return dq, dk, dv
    return _naive_block_backward(dout, q, k, v, out, lse, window or (-1, -1), cfg, dlse)


def _naive_block_backward(do, q, k, v, out, lse, window, cfg, dlse=None):
    """The block's gradients with the row's probabilities P = exp(s - lse) restricted to it,
    in fp32 (fp64 kept): dV = P^T dO, dS = P (dO V^T - rowsum(dO O)), through softcap."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    group = q.shape[1] // k.shape[1]
    kx, vx = (expand_kv_heads(t, q.shape[1]).to(compute) for t in (k, v))
    qc, doc = q.to(compute), do.to(compute)
    raw = torch.matmul(qc, kx.transpose(-2, -1)) * cfg.scale_value
    s = cfg.softcap * torch.tanh(raw / cfg.softcap) if cfg.softcap > 0 else raw
    Tq, Tk = q.shape[2], k.shape[2]
    visible = window_mask(Window(window[0], window[1]), Tq, Tk, device=q.device)
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    p = torch.exp(s - lse.to(compute)[..., None]).nan_to_num(0.0)  # rows with lse -inf: 0
    dv = torch.matmul(p.transpose(-2, -1), doc)
    delta = (doc * out.to(compute)).sum(-1, keepdim=True)
    if dlse is not None:
        delta = delta - dlse.to(compute)[..., None]
    ds = p * (torch.matmul(doc, vx.transpose(-2, -1)) - delta)
    if cfg.softcap > 0:
        ds = ds * (1.0 - torch.tanh(raw / cfg.softcap) ** 2)
    dq = torch.matmul(ds, kx) * cfg.scale_value
    dk = torch.matmul(ds.transpose(-2, -1), qc) * cfg.scale_value
    B, Hkv = k.shape[:2]
    dk = dk.view(B, Hkv, group, *dk.shape[2:]).sum(2)
    dv = dv.view(B, Hkv, group, *dv.shape[2:]).sum(2)
    return dq, dk, dv


def _merge(acc_out, acc_lse, out, lse):
    """fp32 (float64) merge of two partial results of the same rows (lse -inf = nothing seen
    yet)."""
    if acc_out is None:
        return out, lse
    new = torch.logaddexp(acc_lse, lse)
    safe = torch.where(new == float("-inf"), 0.0, new)
    w_acc = torch.exp(acc_lse - safe)[..., None]
    w_new = torch.exp(lse - safe)[..., None]
    return acc_out * w_acc + out * w_new, new


# ---- communication ------------------------------------------------------------------------------


def _ring_exchange(tensors, group, world, rank):
    """Start sending `tensors` to the next rank and receiving the previous rank's into new
    buffers; -> (requests, buffers)."""
    send_to = (
        dist.get_global_rank(group, (rank + 1) % world) if group is not None else (rank + 1) % world
    )
    recv_from = (
        dist.get_global_rank(group, (rank - 1) % world) if group is not None else (rank - 1) % world
    )
    buffers = [_dense_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), send_to, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, b, recv_from, group) for b in buffers]
    return dist.batch_isend_irecv(ops), buffers


def _reduce_scatter(chunks: list[torch.Tensor], group) -> torch.Tensor:
    """Sum over ranks of chunks[r] (one per rank, equal shapes), delivered to rank r."""
    flat = torch.cat([c.contiguous() for c in chunks])  # (W * B, ...): rank r gets rows r
    out = _dense_like(chunks[0])
    with warnings.catch_warnings():  # torch 2.14 renames it reduce_scatter_single
        warnings.simplefilter("ignore", FutureWarning)
        dist.reduce_scatter_tensor(out, flat, group=group)
    return out


# ---- the op -------------------------------------------------------------------------------------


class _Config:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _check_backend(q, k, v, scale, enable_gqa, window, softcap, backend) -> None:
    """Every refusal of `backend` for the block calls, raised as fusedattn.attention raises it
    (BackendUnavailableError) before anything is sent. The Triton blocks call the kernels'
    forward and backward directly, so the backend's refusals (device, dtype, head dims, the
    interpreter switch on a CPU) are asked here once, for a block with the call's options: a
    block differs only in its length and window, which no backend refuses. The torch blocks
    compute the log-sum-exp themselves (SDPA returns none); the sinks join in the merge."""
    inputs = dict(
        q=q, k=k, v=v, attn_mask=None, dropout_p=0.0, scale=scale, enable_gqa=enable_gqa,
        key_padding_mask=None, window=window, softcap=float(softcap), alibi_slopes=None,
        sinks=None, return_lse=backend != "torch",
    )  # fmt: skip
    backends.select("attention", backend, q.device, inputs)


def _global_check(q, k, v, sinks, cfg, group, world):
    """Every rank called with the same shapes and options (one small all-gather), and the
    sequence fits the layout: a ValueError on every rank otherwise, never a hang."""
    meta = torch.tensor(
        [q.shape[0], q.shape[1], q.shape[2], q.shape[3], k.shape[1], k.shape[2], v.shape[-1],
         zlib.crc32(repr((cfg.layout, cfg.strategy, cfg.is_causal, cfg.window, cfg.softcap,
                          cfg.scale, sinks is not None, cfg.backend, str(q.dtype))).encode())],
        dtype=torch.int64,
    )  # fmt: skip
    if dist.get_backend(group) == "nccl":
        meta = meta.to(q.device)
    gathered = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(gathered, meta, group=group)
    rows = [tuple(g.tolist()) for g in gathered]
    if any(r != rows[0] for r in rows):
        raise ValueError(
            "context_parallel_attention: the ranks disagree on shapes or options "
            f"(B, Hq, T/W, D, Hkv, Tk/W, Dv, options per rank: {rows}); every rank must pass "
            "its shard of the same sequence with the same arguments"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"q and k must be shards of the same sequence (self-attention): T/W = {q.shape[2]} "
            f"and {k.shape[2]}"
        )
    chunk_offsets(0, world, q.shape[2] * world, cfg.layout)  # divisibility, same on every rank


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cfg):
        out, lse = _forward(q, k, v, sinks, cfg)
        # the fp32 output for the backward's delta = rowsum(dO * O): not the one rounded to
        # q's dtype (in bf16 that rounding reached dq, dk and the sinks' gradient)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.cfg = cfg
        ctx.set_materialize_grads(False)  # an unread lse: no dlse term (no collective more)
        return out.to(q.dtype), lse.float()  # the lse fp32, as attention's (merged in float64
        # for float64 inputs)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sinks, out, lse = ctx.saved_tensors
        if dout is None:  # the loss reads the lse alone
            dout = torch.zeros(out.shape, dtype=q.dtype, device=q.device)
        dq, dk, dv, dsinks = _backward(dout, q, k, v, sinks, out, lse, ctx.cfg, dlse)
        return dq, dk, dv, dsinks, None


def _chunks(owner, cfg):
    """[(global offset, local offset, length)] of the chunks rank `owner` holds."""
    local, out = 0, []
    for start, n in chunk_offsets(owner, cfg.world, cfg.T, cfg.layout):
        out.append((start, local, n))
        local += n
    return out


def _blocks_against(owner, cfg) -> list[Block]:
    """The blocks of this rank's queries against `owner`'s K/V chunks that see something."""
    found = (_block_of(qc, kc, cfg) for qc in _chunks(cfg.rank, cfg) for kc in _chunks(owner, cfg))
    return [b for b in found if b is not None]


def _kv_sources(cfg):
    """Yield (owner, k, v) of every rank's K/V: passed around the ring, the next transfer in
    flight while the caller computes on the current one, or gathered at once."""
    k, v = cfg.k, cfg.v
    if cfg.strategy == "allgather":
        ks = [_dense_like(k) for _ in range(cfg.world)]
        vs = [_dense_like(v) for _ in range(cfg.world)]
        dist.all_gather(ks, k.contiguous(), group=cfg.group)
        dist.all_gather(vs, v.contiguous(), group=cfg.group)
        for owner in range(cfg.world):
            yield owner, ks[owner], vs[owner]
        return
    for step in range(cfg.world):
        pending = None
        if step < cfg.world - 1:
            pending = _ring_exchange([k, v], cfg.group, cfg.world, cfg.rank)
        yield (cfg.rank - step) % cfg.world, k, v
        if pending is not None:
            for req in pending[0]:
                req.wait()
            k, v = pending[1]


def _forward(q, k, v, sinks, cfg):
    cfg.k, cfg.v = k, v
    B, Hq, n, _ = q.shape
    Dv = v.shape[-1]
    acc = merge_dtype(q)
    out = torch.zeros(B, Hq, n, Dv, dtype=acc, device=q.device)
    lse = torch.full((B, Hq, n), float("-inf"), dtype=acc, device=q.device)
    for owner, k_owner, v_owner in _kv_sources(cfg):
        for blk in _blocks_against(owner, cfg):
            b_out, b_lse = _block_forward(
                q[:, :, blk.rows], k_owner[:, :, blk.keys], v_owner[:, :, blk.keys],
                blk.window, cfg,
            )  # fmt: skip
            rows = blk.rows
            out[:, :, rows], lse[:, :, rows] = _merge(
                out[:, :, rows], lse[:, :, rows], b_out, b_lse
            )
    if sinks is not None:  # each head's sink joins every row's normaliser, once
        sink = sinks.to(acc).view(1, -1, 1).expand_as(lse)
        total = torch.logaddexp(lse, sink)
        out = out * torch.exp(lse - total).nan_to_num(0.0)[..., None]
        lse = total
    cfg.k = cfg.v = None
    return out, lse


def _backward(dout, q, k, v, sinks, out, lse, cfg, dlse=None):
    acc = merge_dtype(q)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk_own = dv_own = None
    if cfg.strategy == "allgather":
        cfg.k, cfg.v = k, v
        dks = [torch.zeros(k.shape, dtype=acc, device=k.device) for _ in range(cfg.world)]
        dvs = [torch.zeros(v.shape, dtype=acc, device=v.device) for _ in range(cfg.world)]
        for owner, k_owner, v_owner in _kv_sources(cfg):
            _accumulate(dout, q, k_owner, v_owner, out, lse, owner, dq, dks[owner], dvs[owner],
                        cfg, dlse)  # fmt: skip
        dk_own, dv_own = _reduce_scatter(dks, cfg.group), _reduce_scatter(dvs, cfg.group)
    else:
        # K/V and their fp32 dK/dV accumulators travel together; after W - 1 hops the
        # accumulators hold every rank's contribution but the last, and one more hop brings
        # them home.
        k_cur, v_cur = k, v
        dk_cur = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv_cur = torch.zeros(v.shape, dtype=acc, device=v.device)
        for step in range(cfg.world):
            owner = (cfg.rank - step) % cfg.world
            pending = None
            if step < cfg.world - 1:  # the K/V move on while this block computes
                pending = _ring_exchange([k_cur, v_cur], cfg.group, cfg.world, cfg.rank)
            _accumulate(dout, q, k_cur, v_cur, out, lse, owner, dq, dk_cur, dv_cur, cfg, dlse)
            if cfg.world > 1:  # the accumulators follow their K/V (home after the last hop)
                reqs, (dk_cur, dv_cur) = _ring_exchange(
                    [dk_cur, dv_cur], cfg.group, cfg.world, cfg.rank
                )
                for req in reqs:
                    req.wait()
            if pending is not None:
                for req in pending[0]:
                    req.wait()
                k_cur, v_cur = pending[1]
        dk_own, dv_own = dk_cur, dv_cur
    dsinks = None
    if sinks is not None and sinks.requires_grad:
        delta = (dout.to(acc) * out.to(acc)).sum(-1)
        if dlse is not None:
            delta = delta - dlse.to(acc)
        p_sink = torch.exp(sinks.to(acc).view(1, -1, 1) - lse)
        dsinks = (-(p_sink * delta).sum(dim=(0, 2))).to(sinks.dtype)
    cfg.k = cfg.v = None
    return dq.to(q.dtype), dk_own.to(k.dtype), dv_own.to(v.dtype), dsinks


def _accumulate(dout, q, k_owner, v_owner, out, lse, owner, dq, dk, dv, cfg, dlse=None):
    """Add the gradients of this rank's query chunks against `owner`'s K/V chunks."""
    for blk in _blocks_against(owner, cfg):
        rows, keys = blk.rows, blk.keys
        b_dq, b_dk, b_dv = _block_backward(
            dout[:, :, rows], q[:, :, rows], k_owner[:, :, keys], v_owner[:, :, keys],
            out[:, :, rows], lse[:, :, rows], blk.window, cfg,
            None if dlse is None else dlse[:, :, rows],
        )  # fmt: skip
        dq[:, :, rows] += b_dq
        dk[:, :, keys] += b_dk
        dv[:, :, keys] += b_dv


def ring_attention(q, k, v, sinks, cfg):
    """(out, lse) of this rank's shard, ring or all-gather (cfg.strategy), autograd included."""
    return _ContextParallelAttention.apply(q, k, v, sinks, cfg)
