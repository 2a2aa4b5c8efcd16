"""The hard shapes of DESIGN.md's correctness rule, and input builders for them.

Sizes that no block size divides (1, 7, 63, 129, 1000), head dims like 40/80/96, Tq != Tk,
GQA, B > 1 with H > 1, and non-contiguous views: the (B, T, H, D) projection transposed to
(B, H, T, D) and a slice of a wider tensor.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

ODD_SIZES = (1, 7, 63, 129)
HEAD_DIMS = (16, 40, 64, 80, 96, 128)


@dataclass(frozen=True)
class AttentionShape:
    B: int
    Hq: int
    Hkv: int
    Tq: int
    Tk: int
    D: int
    Dv: int

    def __str__(self):
        return f"B{self.B}-Hq{self.Hq}-Hkv{self.Hkv}-Tq{self.Tq}-Tk{self.Tk}-D{self.D}-Dv{self.Dv}"


def attention_shapes(sizes=ODD_SIZES, head_dims=(16, 40, 80)) -> list[AttentionShape]:
    """Self- and cross-attention over odd sizes, odd head dims, MHA and GQA, B>1 with H>1."""
    shapes = []
    for (Tq, Tk), D in itertools.product(itertools.product(sizes, repeat=2), head_dims):
        if Tq != Tk and head_dims[0] != D:
            continue  # cross shapes at one head dim keep the grid small
        # B 2 and H 2 (GQA: 2 query heads over 1 KV head on every other shape): batch and head
        # offsets without the interpreter's cost of 4 heads (half the programs)
        shapes.append(AttentionShape(2, 2, 2 if (Tq + Tk + D) % 2 else 1, Tq, Tk, D, D))
    return shapes


def make_tensor(shape, dtype, device, *, layout="contiguous", requires_grad=False):
    """Random normal tensor of `shape` (B, H, T, D) in one of the layouts users pass:

    contiguous; "transposed": a (B, T, H, D) tensor viewed as (B, H, T, D), the layout a
    projection gives; "sliced": the first D columns of a wider tensor (row stride > D).
    """
    B, H, T, D = shape
    if layout == "contiguous":
        t = torch.randn(B, H, T, D, dtype=dtype, device=device)
    elif layout == "transposed":
        t = torch.randn(B, T, H, D, dtype=dtype, device=device).transpose(1, 2)
    elif layout == "sliced":
        t = torch.randn(B, H, T, D + 8, dtype=dtype, device=device)[..., :D]
    else:
        raise ValueError(f"unknown layout {layout!r}")
    return t.requires_grad_(requires_grad)


def make_qkv(s: AttentionShape, dtype, device, *, layout="contiguous", requires_grad=False):
    q = make_tensor(
        (s.B, s.Hq, s.Tq, s.D), dtype, device, layout=layout, requires_grad=requires_grad
    )
    k = make_tensor(
        (s.B, s.Hkv, s.Tk, s.D), dtype, device, layout=layout, requires_grad=requires_grad
    )
    v = make_tensor(
        (s.B, s.Hkv, s.Tk, s.Dv), dtype, device, layout=layout, requires_grad=requires_grad
    )
    return q, k, v


def leaf_copies(tensors, dtype=None):
    """Detached copies that require grad (optionally upcast), for a reference computation."""
    return [t.detach().to(dtype or t.dtype).requires_grad_(t.requires_grad) for t in tensors]
