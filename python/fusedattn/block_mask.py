"""Block masks: FlexAttention's `mask_mod` and `BlockMask`, evaluated eagerly (no compile) and
run by the Triton kernels on the blocks they list (triton_kernels/attention_blocks.py).

Semantics are Flex's: query i of batch b and head h sees key j iff mask_mod(b, h, i, j). A
mask built with B or H None applies to every batch row or head. `create_block_mask` calls
mask_mod on index tensors that broadcast (b and h 0-dim, i a column, j a row), a chunk of
block rows at a time, so it never holds a Q_LEN x KV_LEN tensor: it keeps, per block, whether
it is empty, full or partial, and the partial blocks' bits packed 32 keys to an int32 (2 KiB
for a 128 x 128 block). A mask_mod written for Flex (indexing, comparisons, &, |, torch.where)
works as it is; Python control flow on the indices does not (as under Flex's vmap).

Layout (both orientations, for the forward and dq, and for dk/dv):
  kv_lists (Bm, Hm, nQB, nKB + 1) int32: [.., 0] the number of key blocks a query block sees,
      [.., 1:] those blocks in ascending order; kv_kinds the same shape: -1 for a full block,
      else the partial block's row in `bits`;
  q_lists, q_kinds (Bm, Hm, nKB, nQB + 1): the query blocks that see each key block;
  bits (P, BS_Q, BS_K // 32) int32.
Bm is B or 1, Hm is H or 1.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch

# Elements of mask_mod's output per chunk (8 Mi bools, and a few times that in a mask_mod's
# temporaries). A document-causal mask over 128k tokens (16 documents, 128 x 128 blocks) builds
# in 23 s with 84 MiB of peak extra memory on the 2-core CPU (its dense bool would be 16 GiB);
# 4 Mi: 26 s, 77 MiB; one 128-row block row (16 Mi at 128k): 20 s, 772 MiB. Two thirds of the
# time is the mask_mod itself (every one of the 2^34 entries is evaluated once, as Flex does).
CHUNK_ELEMENTS = 1 << 23


@dataclass(frozen=True, eq=False)
class BlockMask:
    """Which (BS_Q x BS_K) blocks of a (Q_LEN, KV_LEN) score matrix are empty, full or
    partial, with the partial blocks' bits (the module docstring has the layout)."""

    seq_lengths: tuple[int, int]
    block_size: tuple[int, int]
    kv_lists: torch.Tensor
    kv_kinds: torch.Tensor
    q_lists: torch.Tensor
    q_kinds: torch.Tensor
    bits: torch.Tensor
    mask_mod: object = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(Bm, Hm, Q_LEN, KV_LEN), Bm and Hm 1 where the mask broadcasts."""
        return (*self.kv_lists.shape[:2], *self.seq_lengths)

    @property
    def device(self) -> torch.device:
        return self.kv_lists.device

    def listed_blocks(self) -> int:
        """Blocks listed over every (batch, head) the mask holds (full and partial)."""
        return int(self.kv_lists[..., 0].sum())

    def sparsity(self) -> float:
        """The share of blocks not listed, as Flex's BlockMask.sparsity() (in percent)."""
        Bm, Hm, nqb, width = self.kv_lists.shape
        return 100.0 * (1.0 - self.listed_blocks() / (Bm * Hm * nqb * (width - 1)))

    def to(self, device) -> BlockMask:
        device = torch.device(device)
        if device == self.device:
            return self
        moved = {
            name: getattr(self, name).to(device)
            for name in ("kv_lists", "kv_kinds", "q_lists", "q_kinds", "bits")
        }
        return BlockMask(self.seq_lengths, self.block_size, mask_mod=self.mask_mod, **moved)

    def to_dense(self) -> torch.Tensor:
        """(Bm, Hm, Q_LEN, KV_LEN) bool, True where a query sees a key: O(Q_LEN x KV_LEN)
        memory, what the reference and torch backends run. No op depends on the lists'
        values for its shape (no nonzero, no branch on a tensor), so torch.compile traces
        it in one graph: each row's kinds are scattered to its block columns (unlisted
        slots to a spare column, dropped), full blocks set whole, partial ones read from
        their unpacked bits."""
        Bm, Hm, nqb, width = self.kv_lists.shape
        nkb = width - 1
        bsq, bsk = self.block_size
        Q_LEN, KV_LEN = self.seq_lengths
        slot = torch.arange(nkb, device=self.device)
        listed = slot < self.kv_lists[..., :1]  # (Bm, Hm, nqb, nKB)
        cols = torch.where(listed, self.kv_lists[..., 1:].long(), nkb)
        kinds = torch.where(listed, self.kv_kinds[..., 1:].long(), -2)
        grid = torch.full((Bm, Hm, nqb, nkb + 1), -2, dtype=torch.long, device=self.device)
        grid = grid.scatter(-1, cols, kinds)[..., :nkb]  # -2 empty, -1 full, >= 0 partial
        blocks = (grid == -1)[..., None, None].expand(Bm, Hm, nqb, nkb, bsq, bsk)
        if self.bits.shape[0]:
            shifts = torch.arange(32, device=self.device, dtype=torch.int32)
            unpacked = ((self.bits[..., None] >> shifts) & 1).bool().flatten(-2)  # (P, bsq, bsk)
            blocks = blocks | ((grid >= 0)[..., None, None] & unpacked[grid.clamp(min=0)])
        dense = blocks.permute(0, 1, 2, 4, 3, 5).reshape(Bm, Hm, nqb * bsq, nkb * bsk)
        return dense[:, :, :Q_LEN, :KV_LEN]

    def __repr__(self) -> str:
        return (
            f"fusedattn.masks.BlockMask(shape={self.shape}, block_size={self.block_size}, "
            f"partial={self.bits.shape[0]}, sparsity={self.sparsity():.1f}%)"
        )


def _block_size(BLOCK_SIZE) -> tuple[int, int]:
    bsq, bsk = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    for name, value, least in (("query", bsq, 16), ("key", bsk, 32)):
        if value < least or value & (value - 1):
            raise ValueError(
                f"BLOCK_SIZE: the {name} block size must be a power of two >= {least} (the "
                f"kernels' tiles divide it; bits pack 32 keys to a word), got {value}"
            )
    return int(bsq), int(bsk)


def _any_all(vis: torch.Tensor, nqb: int, bsq: int, nkb: int, bsk: int):
    """Per (bsq x bsk) block of a contiguous (nqb * bsq, nkb * bsk) bool grid: whether any
    entry is set, whether all are. Eight bools read as one int64 word, OR- and AND-folded
    over the block's rows by halving (log2(bsq) steps), then over its bsk / 8 words: about
    a quarter of the time of any() and all() over the bools (12 ms for 128 x 128k)."""
    words = vis.view(torch.uint8).view(torch.int64).view(nqb, bsq, nkb, bsk // 8)
    ones = 0x0101010101010101  # every byte a True
    hi, lo = words, words
    while hi.shape[1] > 1:
        half = hi.shape[1] // 2
        hi = hi[:, :half] | hi[:, half:]
        lo = lo[:, :half] & lo[:, half:]
    hi, lo = hi[:, 0], lo[:, 0]  # (nqb, nkb, bsk / 8)
    return (hi != 0).any(-1), (lo == ones).all(-1)


def pack_bits(visible: torch.Tensor) -> torch.Tensor:
    """(..., n * 32) bool -> (..., n) int32, key j at bit j % 32 of word j // 32."""
    shifts = torch.arange(32, device=visible.device, dtype=torch.int64)
    words = (visible.unflatten(-1, (-1, 32)).to(torch.int64) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _lists(kinds_grid: torch.Tensor):
    """(Bm, Hm, R, C) int32 kinds (-2 empty, -1 full, >= 0 partial) -> the lists and kinds of
    each row's visible blocks in ascending order, (Bm, Hm, R, C + 1)."""
    visible = kinds_grid > -2
    counts = visible.sum(-1, dtype=torch.int32)
    C = kinds_grid.shape[-1]
    col = torch.arange(C, device=kinds_grid.device, dtype=torch.int32).expand_as(kinds_grid)
    # visible blocks first, each group in ascending order (a stable sort on the flag)
    order = torch.sort((~visible).to(torch.int8), dim=-1, stable=True).indices
    idx = torch.gather(col, -1, order)
    kinds = torch.gather(kinds_grid, -1, order)
    lists = torch.cat([counts[..., None], idx], -1).to(torch.int32).contiguous()
    kinds = torch.cat([torch.full_like(counts[..., None], -1), kinds], -1).to(torch.int32)
    return lists, kinds.contiguous()


def _index(value: int, device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.int64, device=device)


def _evaluate(mask_mod, b, h, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """mask_mod on a (len(rows), len(cols)) grid, as bool of that shape."""
    out = mask_mod(b, h, rows[:, None], cols[None, :])
    if not isinstance(out, torch.Tensor):
        out = torch.tensor(bool(out), device=rows.device)
    return out.to(torch.bool).expand(rows.shape[0], cols.shape[0])


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, **_unused):
    """torch.nn.attention.flex_attention.create_block_mask's signature, evaluated eagerly and
    in chunks: a fusedattn.masks.BlockMask. B or H None: the mask applies to all. Extra
    keywords of torch's (`_compile`) are accepted and ignored: nothing here compiles."""
    bsq, bsk = _block_size(BLOCK_SIZE)
    device = torch.device("cpu" if device is None else device)
    Q_LEN, KV_LEN = int(Q_LEN), int(KV_LEN)
    if Q_LEN <= 0 or KV_LEN <= 0:
        raise ValueError(f"create_block_mask: Q_LEN and KV_LEN must be positive, got "
                         f"{Q_LEN}, {KV_LEN}")  # fmt: skip
    Bm, Hm = (1 if B is None else int(B)), (1 if H is None else int(H))
    nqb, nkb = -(-Q_LEN // bsq), -(-KV_LEN // bsk)
    kinds = torch.full((Bm, Hm, nqb, nkb), -2, dtype=torch.int32, device=device)
    bits, n_partial = [], 0
    # chunks of whole blocks, about CHUNK_ELEMENTS each: a block row's worth of key blocks
    # at a time where one block row is more than that (128 rows x 128k keys is 16 Mi)
    col_blocks = max(1, min(nkb, CHUNK_ELEMENTS // (bsq * bsk)))
    row_blocks = max(1, CHUNK_ELEMENTS // (col_blocks * bsk) // bsq)
    for b in range(Bm):
        for h in range(Hm):
            b_t, h_t = _index(b, device), _index(h, device)
            for r0 in range(0, nqb, row_blocks):
                r1 = min(nqb, r0 + row_blocks)
                rows = torch.arange(r0 * bsq, min(Q_LEN, r1 * bsq), device=device)
                for c0 in range(0, nkb, col_blocks):
                    c1 = min(nkb, c0 + col_blocks)
                    cols = torch.arange(c0 * bsk, min(KV_LEN, c1 * bsk), device=device)
                    chunk = _classify(mask_mod, b_t, h_t, rows, cols, r1 - r0, c1 - c0, bsq, bsk)
                    block_kinds, partial_bits = chunk
                    if partial_bits is not None:
                        ids = block_kinds >= 0
                        block_kinds[ids] += n_partial
                        n_partial += partial_bits.shape[0]
                        bits.append(partial_bits)
                    kinds[b, h, r0:r1, c0:c1] = block_kinds
    return _from_kinds(kinds, bits, (Q_LEN, KV_LEN), (bsq, bsk), mask_mod, device)


def _classify(mask_mod, b, h, rows, cols, n_qb, n_kb, bsq, bsk):
    """One chunk of n_qb x n_kb blocks: its kinds (-2 empty, -1 full, 0.. partial in order)
    and the partial blocks' packed bits (None if none)."""
    vis = _evaluate(mask_mod, b, h, rows, cols)
    ragged = rows.numel() != n_qb * bsq or cols.numel() != n_kb * bsk
    if ragged:  # pad to whole blocks
        padded = torch.zeros(n_qb * bsq, n_kb * bsk, dtype=torch.bool, device=vis.device)
        padded[: rows.numel(), : cols.numel()] = vis
        vis = padded
    else:
        vis = vis.contiguous()
    grid = vis.view(n_qb, bsq, n_kb, bsk)
    any_, all_ = _any_all(vis, n_qb, bsq, n_kb, bsk)
    if ragged:  # outside the lengths counts as visible for "full": the kernels bound the
        # sequence themselves
        inside = torch.zeros_like(vis)
        inside[: rows.numel(), : cols.numel()] = True
        all_ = (grid | ~inside.view_as(grid)).all(dim=(1, 3))
    kinds = torch.where(any_, -1, -2).to(torch.int32)
    partial = any_ & ~all_
    if not partial.any():
        return kinds, None
    r, c = partial.nonzero(as_tuple=True)
    kinds[r, c] = torch.arange(r.numel(), dtype=torch.int32, device=vis.device)
    return kinds, pack_bits(grid.permute(0, 2, 1, 3)[r, c])


def _from_kinds(kinds, bits, seq_lengths, block_size, mask_mod, device) -> BlockMask:
    kv_lists, kv_kinds = _lists(kinds)
    q_lists, q_kinds = _lists(kinds.transpose(-1, -2))
    bsq, bsk = block_size
    packed = (
        torch.cat(bits)
        if bits
        else torch.zeros(0, bsq, bsk // 32, dtype=torch.int32, device=device)
    )
    return BlockMask(seq_lengths, block_size, kv_lists, kv_kinds, q_lists, q_kinds,
                     packed.contiguous(), mask_mod)  # fmt: skip


# ---- torch's BlockMask ----------------------------------------------------------------------

# torch BlockMask -> its conversion per device, kept with the object (a model's layers share
# one mask: converted once a step, not once a layer)
_CONVERTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _torch_block_mask_type():
    try:
        from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask
    except ImportError:  # a torch without FlexAttention
        return None
    return TorchBlockMask


def is_torch_block_mask(mask) -> bool:
    cls = _torch_block_mask_type()
    return cls is not None and isinstance(mask, cls)


def from_torch(mask, device=None) -> BlockMask:
    """A torch BlockMask as fusedattn's: its block lists as they are, the bits of its partial
    blocks from its mask_mod (evaluated on those blocks only). Cached with the object."""
    home = mask.kv_num_blocks.device  # where its mask_mod's tensors are: evaluated there
    device = torch.device(device) if device is not None else home
    cached = _CONVERTED.get(mask)
    if cached is not None and device in cached:
        return cached[device]
    if device != home:
        converted = from_torch(mask).to(device)
        with contextlib.suppress(TypeError):
            _CONVERTED.setdefault(mask, {})[device] = converted
        return converted
    device = home
    bsq, bsk = _block_size(mask.BLOCK_SIZE)
    Q_LEN, KV_LEN = (int(n) for n in mask.seq_lengths)
    num, idx = mask.kv_num_blocks.to(device), mask.kv_indices.to(device)
    Bm, Hm, nqb = num.shape
    nkb = -(-KV_LEN // bsk)
    nqb = min(nqb, -(-Q_LEN // bsq))
    kinds = torch.full((Bm, Hm, nqb, nkb), -2, dtype=torch.int32, device=device)
    listed = _listed(num[..., :nqb], idx[..., :nqb, :], nkb)
    full = None
    if mask.full_kv_num_blocks is not None:
        full = _listed(mask.full_kv_num_blocks.to(device)[..., :nqb],
                       mask.full_kv_indices.to(device)[..., :nqb, :], nkb)  # fmt: skip
        kinds[full] = -1
    partial_blocks = listed if full is None else listed & ~full
    bits = []
    if partial_blocks.any():
        bits.append(_partial_bits(mask.mask_mod, partial_blocks, (Q_LEN, KV_LEN), (bsq, bsk)))
        n = bits[0].shape[0]
        kinds[partial_blocks] = torch.arange(n, dtype=torch.int32, device=device)
    converted = _from_kinds(kinds, bits, (Q_LEN, KV_LEN), (bsq, bsk), mask.mask_mod, device)
    with contextlib.suppress(TypeError):  # not weak-referenceable: converted each call
        _CONVERTED.setdefault(mask, {})[device] = converted
    return converted


def _listed(num, idx, nkb) -> torch.Tensor:
    """(Bm, Hm, R, nkb) bool from torch's (count, indices) lists."""
    slot = torch.arange(idx.shape[-1], device=idx.device)
    valid = slot < num[..., None]
    grid = torch.zeros(*num.shape, nkb + 1, dtype=torch.bool, device=idx.device)
    grid.scatter_(-1, torch.where(valid, idx.long().clamp(max=nkb - 1), nkb), True)
    return grid[..., :nkb]


def _partial_bits(mask_mod, partial, seq_lengths, block_size) -> torch.Tensor:
    """The packed bits of the listed partial blocks, in nonzero() order: mask_mod evaluated on
    those blocks only, a batch of blocks at a time."""
    bsq, bsk = block_size
    Q_LEN, KV_LEN = seq_lengths
    b, h, r, c = partial.nonzero(as_tuple=True)
    device = partial.device
    out = []
    per_chunk = max(1, CHUNK_ELEMENTS // (bsq * bsk))
    rows, cols = torch.arange(bsq, device=device), torch.arange(bsk, device=device)
    for s in range(0, b.numel(), per_chunk):
        sl = slice(s, s + per_chunk)
        qi = (r[sl] * bsq)[:, None, None] + rows[None, :, None]
        kj = (c[sl] * bsk)[:, None, None] + cols[None, None, :]
        inside = (qi < Q_LEN) & (kj < KV_LEN)
        vis = mask_mod(b[sl][:, None, None], h[sl][:, None, None], qi.clamp(max=Q_LEN - 1),
                       kj.clamp(max=KV_LEN - 1))  # fmt: skip
        vis = torch.as_tensor(vis, device=device).to(torch.bool).expand_as(inside) & inside
        out.append(pack_bits(vis))
    return torch.cat(out)


def as_block_mask(mask, device) -> BlockMask:
    """fusedattn's BlockMask on `device` from either kind; TypeError for anything else."""
    if isinstance(mask, BlockMask):
        return mask.to(device)
    if is_torch_block_mask(mask):
        return from_torch(mask, device)
    raise TypeError(
        "block_mask must be a fusedattn.masks.BlockMask or a torch.nn.attention.flex_attention."
        f"BlockMask, got {type(mask).__name__}"
    )
