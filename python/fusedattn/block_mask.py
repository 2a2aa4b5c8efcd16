"""Block masks: FlexAttention's `mask_mod` and `BlockMask`, evaluated eagerly (no compile) and
run by the Triton kernels on the blocks they list (triton_kernels/attention_blocks.py).

Semantics are Flex's: query i of batch b and head h sees key j iff mask_mod(b, h, i, j). A
mask built with B or H None applies to every batch row or head. `create_block_mask` calls
mask_mod on index tensors that broadcast (b and h 0-dim, i a column, j a row), a chunk of
block rows at a time, so it never holds a Q_LEN x KV_LEN tensor: it keeps, per block, whether
it is empty, full or partial, and the partial blocks' bits packed 32 keys to an int32 (2 KiB
for a 128 x 128 block). A mask_mod written for Flex (indexing, comparisons, &, |, torch.where)
works as it is; Python control flow on the indices does not (as under Flex's vmap).

fusedattn's `BlockMask` is torch's class (torch.nn.attention.flex_attention.BlockMask, a
subclass): every attribute (kv_num_blocks, kv_indices, full_kv_*, q_*, full_q_*, BLOCK_SIZE,
seq_lengths, mask_mod, all assignable), constructor (from_kv_blocks), slicing and method
(_adjust, numel, sparsity, to_dense: torch's block map, to_string, as_tuple, shape) is
torch's, and torch's own flex_attention takes it. What the kernels read is its
`KernelBlocks`, made from those fields (the partial blocks' bits from mask_mod, on those
blocks only) the first time a device asks and kept until a field is assigned;
create_block_mask makes both at once. Torch's tensors follow torch's convention: a block cut
by Q_LEN or KV_LEN is partial (torch pads the mask with False); the kernels' form lists it
full where every key inside the lengths is visible (the kernels bound the sequence).

KernelBlocks layout (both orientations, for the forward and dq, and for dk/dv):
  kv_lists (Bm, Hm, nQB, nKB + 1) int32: [.., 0] the number of key blocks a query block sees,
      [.., 1:] those blocks in ascending order; kv_kinds the same shape: -1 for a full block,
      else the partial block's row in `bits`;
  q_lists, q_kinds (Bm, Hm, nKB, nQB + 1): the query blocks that see each key block;
  bits (P, BS_Q, max(1, BS_K // 32)) int32: key j (its offset in its block) of row i at bit
      j % 32 of word j // 32 (BS_K = 16: the low 16 bits of one word).
Bm is B or 1, Hm is H or 1.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from dataclasses import dataclass

import torch
from torch.nn.attention import flex_attention as _flex

TorchBlockMask = _flex.BlockMask
noop_mask = _flex.noop_mask
# the mask_mod torch gives a sliced BlockMask (it asks for a new one)
_SLICED_MASK_MOD = getattr(_flex, "_sliced_mask_mod_error", None)

# Elements of mask_mod's output per chunk (8 Mi bools, and a few times that in a mask_mod's
# temporaries). A document-causal mask over 128k tokens (16 documents, 128 x 128 blocks) builds
# in 23 s with 84 MiB of peak extra memory on the 2-core CPU (its dense bool would be 16 GiB);
# 4 Mi: 26 s, 77 MiB; one 128-row block row (16 Mi at 128k): 20 s, 772 MiB. Two thirds of the
# time is the mask_mod itself (every one of the 2^34 entries is evaluated once, as Flex does).
CHUNK_ELEMENTS = 1 << 23
MIN_BLOCK = 16  # the kernels' smallest tile (tl.dot takes 16)


def words_per_row(bsk: int) -> int:
    return max(1, bsk // 32)


@dataclass(frozen=True, eq=False)
class KernelBlocks:
    """What the kernels read of a block mask: which (BS_Q x BS_K) blocks of a (Q_LEN, KV_LEN)
    score matrix are empty, full or partial, with the partial blocks' bits (the module
    docstring has the layout)."""

    seq_lengths: tuple[int, int]
    block_size: tuple[int, int]
    kv_lists: torch.Tensor
    kv_kinds: torch.Tensor
    q_lists: torch.Tensor
    q_kinds: torch.Tensor
    bits: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.kv_lists.device

    def listed_blocks(self) -> int:
        """Blocks listed over every (batch, head) the mask holds (full and partial)."""
        return int(self.kv_lists[..., 0].sum())

    def metadata(self) -> tuple:
        """What a plan keys this form on (ops/attention/plans.py): the lengths, the block size
        and each tensor's shape, strides, dtype, device and 16-byte alignment (what the
        kernels' launch arguments and Triton's specialisation read), the bits' but for their
        count (a pointer, whatever the number of partial blocks). Kept with the object."""
        found = self.__dict__.get("_metadata")
        if found is None:
            found = (self.seq_lengths, self.block_size, *(
                (t.shape if name != "bits" else t.shape[1:], t.stride(), t.dtype, t.device,
                 t.data_ptr() % 16 == 0)
                for name, t in ((n, getattr(self, n)) for n in
                                ("kv_lists", "kv_kinds", "q_lists", "q_kinds", "bits"))
            ))  # fmt: skip
            object.__setattr__(self, "_metadata", found)  # frozen: set once, like a cache
        return found

    def to(self, device) -> KernelBlocks:
        device = torch.device(device)
        if device == self.device:
            return self
        moved = {
            name: getattr(self, name).to(device)
            for name in ("kv_lists", "kv_kinds", "q_lists", "q_kinds", "bits")
        }
        return KernelBlocks(self.seq_lengths, self.block_size, **moved)

    def heads(self, heads: slice) -> KernelBlocks:
        """The blocks of query heads `heads` (a per-head mask's share of them, as Ulysses
        gives a rank; a mask built with H None is every head's): the lists sliced, the
        partial blocks' bits shared."""
        if self.kv_lists.shape[1] == 1:
            return self
        lists = {name: getattr(self, name)[:, heads]
                 for name in ("kv_lists", "kv_kinds", "q_lists", "q_kinds")}  # fmt: skip
        return KernelBlocks(self.seq_lengths, self.block_size, bits=self.bits, **lists)

    def kinds_grid(self) -> torch.Tensor:
        """(Bm, Hm, nQB, nKB) int64: -2 empty, -1 full, >= 0 the partial block's bits row.
        No op depends on the lists' values for its shape, so torch.compile traces it: each
        row's kinds scattered to its block columns (unlisted slots to a spare column)."""
        Bm, Hm, nqb, width = self.kv_lists.shape
        nkb = width - 1
        slot = torch.arange(nkb, device=self.device)
        listed = slot < self.kv_lists[..., :1]
        cols = torch.where(listed, self.kv_lists[..., 1:].long(), nkb)
        kinds = torch.where(listed, self.kv_kinds[..., 1:].long(), -2)
        grid = torch.full((Bm, Hm, nqb, nkb + 1), -2, dtype=torch.long, device=self.device)
        return grid.scatter(-1, cols, kinds)[..., :nkb]

    def dense_mask(self) -> torch.Tensor:
        """(Bm, Hm, Q_LEN, KV_LEN) bool, True where a query sees a key: O(Q_LEN x KV_LEN)
        memory, what the reference and torch backends run (traceable: kinds_grid)."""
        Bm, Hm, nqb, width = self.kv_lists.shape
        nkb = width - 1
        bsq, bsk = self.block_size
        Q_LEN, KV_LEN = self.seq_lengths
        grid = self.kinds_grid()
        blocks = (grid == -1)[..., None, None].expand(Bm, Hm, nqb, nkb, bsq, bsk)
        if self.bits.shape[0]:
            shifts = torch.arange(32, device=self.device, dtype=torch.int32)
            unpacked = ((self.bits[..., None] >> shifts) & 1).bool().flatten(-2)[..., :bsk]
            blocks = blocks | ((grid >= 0)[..., None, None] & unpacked[grid.clamp(min=0)])
        dense = blocks.permute(0, 1, 2, 4, 3, 5).reshape(Bm, Hm, nqb * bsq, nkb * bsk)
        return dense[:, :, :Q_LEN, :KV_LEN]


# the fields whose assignment makes the kernels' form stale
_FIELDS = frozenset(("seq_lengths", "kv_num_blocks", "kv_indices", "full_kv_num_blocks",
                     "full_kv_indices", "BLOCK_SIZE", "mask_mod"))  # fmt: skip


class BlockMask(TorchBlockMask):
    """torch.nn.attention.flex_attention.BlockMask (every attribute, constructor, slicing
    and method is torch's), with the kernels' form of it (`kernel_blocks`) kept per device.
    fusedattn.masks.create_block_mask makes one without a compile."""

    def __init__(self, *args, **kwargs):
        object.__setattr__(self, "_kernel", {})
        super().__init__(*args, **kwargs)

    def __setattr__(self, name, value):
        if name in _FIELDS:
            self.__dict__.get("_kernel", {}).clear()
        super().__setattr__(name, value)

    def kernel_blocks(self, device=None) -> KernelBlocks:
        """The kernels' form on `device` (default: the mask's): made once from the fields
        (mask_mod evaluated on the partial blocks only, where it is), then moved."""
        home = self.kv_num_blocks.device
        device = home if device is None else torch.device(device)
        cache = self.__dict__.setdefault("_kernel", {})
        found = cache.get(device)
        if found is None:
            found = cache.get(home)
            if found is None:
                found = cache[home] = kernel_blocks_of(self)
            if device != home:
                found = cache[device] = found.to(device)
        return found

    # the kernels' form, as the mask's own attributes (on the mask's device)
    @property
    def block_size(self) -> tuple[int, int]:
        return _block_size(self.BLOCK_SIZE)

    @property
    def device(self) -> torch.device:
        return self.kv_num_blocks.device

    @property
    def kv_lists(self) -> torch.Tensor:
        return self.kernel_blocks().kv_lists

    @property
    def kv_kinds(self) -> torch.Tensor:
        return self.kernel_blocks().kv_kinds

    @property
    def q_lists(self) -> torch.Tensor:
        return self.kernel_blocks().q_lists

    @property
    def q_kinds(self) -> torch.Tensor:
        return self.kernel_blocks().q_kinds

    @property
    def bits(self) -> torch.Tensor:
        return self.kernel_blocks().bits

    def listed_blocks(self) -> int:
        """Blocks the kernels visit over every (batch, head) the mask holds."""
        return self.kernel_blocks().listed_blocks()

    def dense_mask(self) -> torch.Tensor:
        """(Bm, Hm, Q_LEN, KV_LEN) bool, True where a query sees a key (O(Q_LEN x KV_LEN));
        torch's to_dense() is the (Bm, Hm, nQB, nKB) block map."""
        return self.kernel_blocks().dense_mask()

    def to(self, device) -> BlockMask:
        moved = _as_ours(super().to(device))
        cached = self.__dict__.get("_kernel", {})
        device = moved.kv_num_blocks.device
        if device in cached:
            moved._kernel[device] = cached[device]
        elif cached:
            moved._kernel[device] = next(iter(cached.values())).to(device)
        return moved

    def __getitem__(self, index) -> BlockMask:
        """torch's slicing (batch, head, query-block rows; mask_mod reset, as torch does: a
        sliced mask is refused until one is assigned)."""
        return _as_ours(super().__getitem__(index))


def _offset_heads(mask_mod, start, b, h, q_idx, kv_idx):
    return mask_mod(b, h + start, q_idx, kv_idx)


def heads_of(mask: TorchBlockMask, heads: slice, device) -> BlockMask:
    """The mask of query heads `heads` (start:stop) of a BlockMask with a head dimension, as
    a BlockMask of its own whose head h is the original's h + start: torch's slice of the
    fields, mask_mod offset, and the kernels' form on `device` sliced from the original's
    (the partial blocks' bits are not evaluated again). A mask with H None: itself."""
    num = mask.kv_num_blocks
    if num.dim() < 2 or num.shape[-2] == 1:
        return mask
    index = (slice(None),) * (num.dim() - 2) + (heads,)
    sliced = _as_ours(TorchBlockMask.__getitem__(mask, index))
    sliced.mask_mod = functools.partial(_offset_heads, mask.mask_mod, heads.start)
    sliced._kernel[torch.device(device)] = from_torch(mask, device).heads(heads)
    return sliced


def _as_ours(mask: TorchBlockMask) -> BlockMask:
    """A torch BlockMask's fields as fusedattn's (torch's methods that build a new mask name
    torch's class)."""
    if type(mask) is BlockMask:
        return mask
    fields = {name: getattr(mask, name) for name in (
        "seq_lengths", "kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
        "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices", "BLOCK_SIZE",
        "mask_mod")}  # fmt: skip
    ours = BlockMask(**fields)
    for extra in ("dq_write_order", "dq_write_order_full", "dq_kv_order", "dq_kv_order_spt"):
        if hasattr(mask, extra):  # torch 2.13+
            setattr(ours, extra, getattr(mask, extra))
    return ours


def _block_size(BLOCK_SIZE) -> tuple[int, int]:
    bsq, bsk = (BLOCK_SIZE, BLOCK_SIZE) if isinstance(BLOCK_SIZE, int) else tuple(BLOCK_SIZE)
    for name, value in (("query", bsq), ("key", bsk)):
        if value < MIN_BLOCK or value & (value - 1):
            raise ValueError(
                f"BLOCK_SIZE: the {name} block size must be a power of two >= {MIN_BLOCK} (the "
                f"kernels' tiles divide it, and tl.dot takes 16 at least), got {value}"
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
    """(..., bsk) bool -> (..., max(1, bsk // 32)) int32, key j at bit j % 32 of word j // 32
    (fewer than 32 keys: the low bits of one word)."""
    if visible.shape[-1] < 32:
        pad = torch.zeros(*visible.shape[:-1], 32 - visible.shape[-1], dtype=torch.bool,
                          device=visible.device)  # fmt: skip
        visible = torch.cat([visible, pad], -1)
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


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(…, R, C) bool -> torch's (num_blocks int32 (…, R), indices int32 (…, R, C)): each
    row's set columns first in ascending order, then the rest (torch's _dense_to_ordered)."""
    num = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort(blocks.to(torch.int32), dim=-1, descending=True, stable=True)
    return num.contiguous(), order.to(torch.int32).contiguous()


def _index(value: int, device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.int64, device=device)


def _evaluate(mask_mod, b, h, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """mask_mod on a (len(rows), len(cols)) grid, as bool of that shape."""
    out = mask_mod(b, h, rows[:, None], cols[None, :])
    if not isinstance(out, torch.Tensor):
        out = torch.tensor(bool(out), device=rows.device)
    return out.to(torch.bool).expand(rows.shape[0], cols.shape[0])


def _default_device() -> torch.device:
    """torch's default for create_block_mask and create_mask: the current accelerator where
    one is available, else the CPU."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return accelerator.current_accelerator()
    return torch.device("cpu")


def _positional_count(fn) -> int:
    code = getattr(fn, "__code__", None)
    if code is not None:
        return code.co_argcount - len(getattr(fn, "__defaults__", None) or ())
    return sum(p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY,
               p.POSITIONAL_OR_KEYWORD) for p in inspect.signature(fn).parameters.values())  # fmt: skip


def create_mask(mod_fn, B, H, Q_LEN, KV_LEN, device=None) -> torch.Tensor:
    """torch.nn.attention.flex_attention.create_mask: the dense (B, H, Q_LEN, KV_LEN) bool
    mask of a mask_mod (4 arguments), or of a score_mod (5: False where it gives -inf on a
    zero score), evaluated once on broadcasting index tensors (no vmap). O(Q_LEN x KV_LEN)."""
    device = _default_device() if device is None else device
    B, H = (1 if B is None else int(B)), (1 if H is None else int(H))

    def index(n, dim):
        shape = [1, 1, 1, 1]
        shape[dim] = n
        return torch.arange(n, device=device).view(shape)

    b, h, q, kv = index(B, 0), index(H, 1), index(int(Q_LEN), 2), index(int(KV_LEN), 3)
    count = _positional_count(mod_fn)
    if count == 5:
        zeros = torch.zeros(B, H, int(Q_LEN), int(KV_LEN), device=device)
        out = torch.as_tensor(mod_fn(zeros, b, h, q, kv), device=device)
        return ~torch.isneginf(out.expand(B, H, int(Q_LEN), int(KV_LEN)))
    if count != 4:
        raise AssertionError(f"Expected 4 or 5 positional args, got {count}")
    out = torch.as_tensor(mod_fn(b, h, q, kv), device=device)
    return out.to(torch.bool).expand(B, H, int(Q_LEN), int(KV_LEN))


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128,
                      _compile=False, separate_full_blocks=True, compute_dq_write_order=False,
                      dq_kv_order=True) -> BlockMask:  # fmt: skip
    """torch.nn.attention.flex_attention.create_block_mask (its signature and keywords; an
    unknown keyword raises), evaluated eagerly and in chunks: a fusedattn BlockMask (torch's
    class) whose kernels' form is made at the same time. B or H None: the mask applies to
    all. device None: torch's default (the current accelerator, else the CPU). _compile
    changes nothing (nothing here compiles); separate_full_blocks=False lists every
    non-empty block as partial in torch's fields, as torch does (the kernels still skip
    mask reads in full blocks); compute_dq_write_order fills torch's dq write-order fields
    for torch's own FLASH backward (fusedattn's backward is deterministic without them)."""
    del _compile
    bsq, bsk = _block_size(BLOCK_SIZE)
    device = torch.device(_default_device() if device is None else device)
    Q_LEN, KV_LEN = int(Q_LEN), int(KV_LEN)
    if Q_LEN <= 0 or KV_LEN <= 0:
        raise ValueError(f"create_block_mask: Q_LEN and KV_LEN must be positive, got "
                         f"{Q_LEN}, {KV_LEN}")  # fmt: skip
    if not isinstance(dq_kv_order, bool):
        raise ValueError("dq_kv_order must be a bool when using create_block_mask")
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
    kernel = _from_kinds(kinds, bits, (Q_LEN, KV_LEN), (bsq, bsk), device)
    mask = _torch_fields(kinds, (Q_LEN, KV_LEN), (bsq, bsk), mask_mod, separate_full_blocks)
    mask._kernel[device] = kernel
    if compute_dq_write_order:
        order = getattr(_flex, "_compute_dq_write_order_from_block_mask", None)
        if order is None:
            raise ValueError("compute_dq_write_order: this torch has no dq write order")
        mask.dq_write_order, mask.dq_write_order_full = order(mask, dq_kv_order=dq_kv_order)
        mask.dq_kv_order_spt = dq_kv_order
    return mask


def _torch_fields(kinds, seq_lengths, block_size, mask_mod, separate_full_blocks) -> BlockMask:
    """The BlockMask with torch's fields for a kinds grid: torch's partial and full block
    lists (a block cut by the lengths is partial there, as torch pads with False), both
    orientations."""
    Q_LEN, KV_LEN = seq_lengths
    bsq, bsk = block_size
    nqb, nkb = kinds.shape[-2:]
    full = kinds == -1
    cut = torch.zeros(nqb, nkb, dtype=torch.bool, device=kinds.device)
    if Q_LEN % bsq:
        cut[-1, :] = True
    if KV_LEN % bsk:
        cut[:, -1] = True
    partial = (kinds >= 0) | (full & cut)
    full = full & ~cut
    if not separate_full_blocks:
        partial, full = partial | full, None
    kv_num, kv_idx = _ordered(partial)
    q_num, q_idx = _ordered(partial.transpose(-1, -2))
    fields = dict(full_kv_num_blocks=None, full_kv_indices=None, full_q_num_blocks=None,
                  full_q_indices=None)  # fmt: skip
    if full is not None:
        fields["full_kv_num_blocks"], fields["full_kv_indices"] = _ordered(full)
        fields["full_q_num_blocks"], fields["full_q_indices"] = _ordered(full.transpose(-1, -2))
    return BlockMask(seq_lengths, kv_num, kv_idx, q_num_blocks=q_num, q_indices=q_idx,
                     BLOCK_SIZE=(bsq, bsk), mask_mod=mask_mod, **fields)  # fmt: skip


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


def _from_kinds(kinds, bits, seq_lengths, block_size, device) -> KernelBlocks:
    kv_lists, kv_kinds = _lists(kinds)
    q_lists, q_kinds = _lists(kinds.transpose(-1, -2))
    bsq, bsk = block_size
    packed = (
        torch.cat(bits)
        if bits
        else torch.zeros(0, bsq, words_per_row(bsk), dtype=torch.int32, device=device)
    )
    return KernelBlocks(seq_lengths, block_size, kv_lists, kv_kinds, q_lists, q_kinds,
                        packed.contiguous())  # fmt: skip


# ---- the kernels' form of torch's fields -----------------------------------------------------

# a torch BlockMask (not fusedattn's) -> its kernels' form per device, kept with the object (a
# model's layers share one mask: converted once a step, not once a layer)
_CONVERTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_torch_block_mask(mask) -> bool:
    return isinstance(mask, TorchBlockMask)


def kernel_blocks_of(mask: TorchBlockMask) -> KernelBlocks:
    """The kernels' form of a BlockMask's fields, on its device: its block lists as they are,
    the bits of its partial blocks from its mask_mod (evaluated on those blocks only)."""
    if _SLICED_MASK_MOD is not None and mask.mask_mod is _SLICED_MASK_MOD:
        raise RuntimeError(
            "Cannot use mask_mod from a sliced BlockMask: torch resets it when a BlockMask is "
            "sliced; assign one (the original's, offset to the slice) before using the mask"
        )
    device = mask.kv_num_blocks.device
    bsq, bsk = _block_size(mask.BLOCK_SIZE)
    Q_LEN, KV_LEN = (int(n) for n in mask.seq_lengths)
    num, idx = mask.kv_num_blocks, mask.kv_indices
    while num.dim() < 3:  # torch allows fewer leading dimensions
        num, idx = num.unsqueeze(0), idx.unsqueeze(0)
    Bm, Hm, nqb = num.shape
    nkb = -(-KV_LEN // bsk)
    nqb = min(nqb, -(-Q_LEN // bsq))
    kinds = torch.full((Bm, Hm, nqb, nkb), -2, dtype=torch.int32, device=device)
    listed = _listed(num[..., :nqb], idx[..., :nqb, :], nkb)
    if mask.full_kv_num_blocks is not None:
        full_num, full_idx = mask.full_kv_num_blocks, mask.full_kv_indices
        while full_num.dim() < 3:
            full_num, full_idx = full_num.unsqueeze(0), full_idx.unsqueeze(0)
        full = _listed(full_num[..., :nqb], full_idx[..., :nqb, :], nkb)
        kinds[full] = -1
        listed = listed & ~full
    bits = []
    if listed.any():
        bits.append(_partial_bits(mask.mask_mod, listed, (Q_LEN, KV_LEN), (bsq, bsk)))
        kinds[listed] = torch.arange(bits[0].shape[0], dtype=torch.int32, device=device)
    return _from_kinds(kinds, bits, (Q_LEN, KV_LEN), (bsq, bsk), device)


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


def from_torch(mask, device=None) -> KernelBlocks:
    """A BlockMask's kernels' form on `device` (default: its own): fusedattn's keeps it
    itself; a torch one's is cached with the object."""
    if isinstance(mask, BlockMask):
        return mask.kernel_blocks(device)
    home = mask.kv_num_blocks.device
    device = torch.device(device) if device is not None else home
    cached = _CONVERTED.get(mask)
    if cached is not None and device in cached:
        return cached[device]
    converted = from_torch(mask) if device != home else kernel_blocks_of(mask)
    converted = converted.to(device)
    with contextlib.suppress(TypeError):  # not weak-referenceable: converted each call
        _CONVERTED.setdefault(mask, {})[device] = converted
    return converted


def as_block_mask(mask, device) -> KernelBlocks:
    """The kernels' form on `device` of fusedattn's or torch's BlockMask; TypeError for
    anything else."""
    if is_torch_block_mask(mask):
        return from_torch(mask, device)
    raise TypeError(
        "block_mask must be a fusedattn.masks.BlockMask or a torch.nn.attention.flex_attention."
        f"BlockMask, got {type(mask).__name__}"
    )
