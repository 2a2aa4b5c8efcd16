"""Context parallelism on torch.distributed: attention over a sequence sharded across ranks.

    from fusedattn import distributed as cp
    q, k, v = (cp.shard_sequence(t, dim=2) for t in (q_full, k_full, v_full))   # this rank's
    out = cp.context_parallel_attention(q, k, v, is_causal=True)                # its output
    full = cp.unshard_sequence(out, dim=2)

Each rank holds a shard of the sequence, T/W positions of it (W = the group's size):
layout "contiguous" gives rank r chunk r of W; "zigzag" cuts the sequence in 2W chunks and
gives rank r chunks r and 2W - 1 - r, so that under a causal mask every rank has the same work.
`context_parallel_attention` returns this rank's shard of `fusedattn.attention` on the whole
sequence (top-left positions: query and key t are both global position t), forward and
backward. Strategies (docs/distributed.md says when to pick which):

- "ring" and "allgather" (ring.py): this rank's query chunks against every rank's K/V chunk,
  block by block, K/V passed around a ring or gathered once; partials merged in fp32.
- "ulysses" (ulysses.py): one all-to-all from sequence shards to head shards, `attention` over
  the whole sequence on H/W heads, one all-to-all back: every variant holds, whole-sequence
  attn_mask, key_padding_mask, ALiBi and dropout included. `context_parallel_varlen_attention`
  runs a packed batch so, its tokens split evenly over the ranks.
- "usp": Ulysses inside group[0] (or a DeviceMesh's "ulysses" dimension), the ring across
  group[1] ("ring"); either layout, over the whole world of W = R·U ranks. The Ulysses groups
  must be runs of consecutive ranks and the ring groups stride over them (a DeviceMesh (R, U)
  named ("ring", "ulysses")): checked, and any other grouping refused by name.

Built only on torch.distributed (NCCL on GPUs, gloo on CPUs). Every rank must call with the
same shapes and options: they are checked with a small all-gather first, and a mismatch or a
refused input raises a ValueError on every rank instead of hanging.
"""

from .api import (
    BACKENDS,
    STRATEGIES,
    context_parallel_attention,
    context_parallel_varlen_attention,
)
from .ring import _band, _block_backward, _block_forward, _blocks_against, _Config
from .sharding import LAYOUTS, chunk_offsets, shard_sequence, unshard_sequence

__all__ = [
    "BACKENDS",
    "LAYOUTS",
    "STRATEGIES",
    "chunk_offsets",
    "context_parallel_attention",
    "context_parallel_varlen_attention",
    "shard_sequence",
    "unshard_sequence",
]
_PRIVATE_FOR_TESTS = (_band, _block_backward, _block_forward, _blocks_against, _Config)
