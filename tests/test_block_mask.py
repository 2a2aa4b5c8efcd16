"""Block masks (issue #71): fusedattn.masks.create_block_mask against brute force, and
attention(..., block_mask=) on the Triton kernels' block-sparse loops against float64 under
the k× rule, forward and gradients; torch's BlockMask; torch.compile; the tiles visited.

Block sizes here are 32 (the interpreter's tiles are 16-32): lengths that are not multiples
of them, partial and full blocks, empty rows, per-batch and per-head patterns.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from kx_check import assert_op_kx

import fusedattn
from fusedattn import reference
from fusedattn.masks import and_masks, create_block_mask, or_masks

# kernels: on a GPU machine these run the compiled kernels (tensors on CUDA by default, the
# masks built on the CPU and moved by the call), on the CPU the interpreter
pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("kernel_device")]

BS = 32


def _here(t: torch.Tensor) -> torch.Tensor:
    """A CPU-made tensor (seeded generators are CPU ones) on the test's device."""
    return t.to(torch.get_default_device())


def _docs(lengths):
    return torch.repeat_interleave(torch.arange(len(lengths), device="cpu"),
                                   torch.tensor(lengths, device="cpu"))  # fmt: skip


def document_causal(lengths):
    doc = _docs(lengths)

    def mask_mod(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    return mask_mod


def prefix_lm(prefix):  # prefix (B,) lengths: bidirectional within the prefix, causal after
    def mask_mod(b, h, q, kv):
        return (kv <= q) | (kv < prefix[b])

    return mask_mod


def window_in_documents(lengths, left):
    doc = _docs(lengths)

    def mask_mod(b, h, q, kv):
        return (doc[q] == doc[kv]) & (kv <= q) & (q - kv <= left)

    return mask_mod


def random_blocks(nqb, nkb, B, H, seed):  # a random block pattern, random bits inside
    g = torch.Generator().manual_seed(seed)
    keep = torch.rand(B, H, nqb, nkb, generator=g, device="cpu") < 0.35
    bits = torch.rand(B, H, nqb * BS, nkb * BS, generator=g, device="cpu") < 0.7

    def mask_mod(b, h, q, kv):
        return keep[b, h, q // BS, kv // BS] & bits[b, h, q, kv]

    return mask_mod


def dense_of(mask_mod, B, H, Tq, Tk):
    q = torch.arange(Tq, device="cpu")[:, None]
    kv = torch.arange(Tk, device="cpu")[None, :]
    one = lambda i: torch.tensor(i, device="cpu")  # noqa: E731
    rows = [
        torch.stack([mask_mod(one(b), one(h), q, kv).expand(Tq, Tk) for h in range(H)])
        for b in range(B)
    ]
    return torch.stack(rows)


CASES = {
    # name: (mask_mod factory, B or None, H or None, Tq, Tk)
    "document_causal": (lambda: document_causal([37, 50, 13]), None, None, 100, 100),
    "prefix_lm_per_batch": (
        lambda: prefix_lm(torch.tensor([5, 70], device="cpu")),
        2,
        None,
        90,
        90,
    ),
    "window_in_documents": (lambda: window_in_documents([60, 41], 20), None, None, 101, 101),
    "random_per_head": (lambda: random_blocks(3, 4, 2, 2, 0), 2, 2, 77, 120),
    "rows_that_see_nothing": (
        lambda: lambda b, h, q, kv: (q % 40 < 20) & (kv < 50),
        None,
        None,
        70,
        96,
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_the_builder_gives_the_mask_mod_in_both_orientations(name):
    factory, B, H, Tq, Tk = CASES[name]
    mask_mod = factory()
    bm = create_block_mask(mask_mod, B, H, Tq, Tk, BLOCK_SIZE=BS)
    want = dense_of(mask_mod, B or 1, H or 1, Tq, Tk)
    assert torch.equal(bm.dense_mask(), want)
    # the q orientation lists the same blocks as the kv orientation, transposed
    for lists, kinds, other in (
        (bm.kv_lists, bm.kv_kinds, bm.q_lists),
        (bm.q_lists, bm.q_kinds, bm.kv_lists),
    ):
        grid = torch.zeros(*lists.shape[:3], other.shape[2], dtype=torch.int32, device="cpu") - 2
        for b, h, r in itertools.product(*(range(n) for n in lists.shape[:3])):
            n = int(lists[b, h, r, 0])
            assert lists[b, h, r, 1 : 1 + n].tolist() == sorted(lists[b, h, r, 1 : 1 + n].tolist())
            grid[b, h, r, lists[b, h, r, 1 : 1 + n].long()] = kinds[b, h, r, 1 : 1 + n]
        if lists is bm.kv_lists:
            kv_grid = grid
        else:
            assert torch.equal(grid.transpose(-1, -2), kv_grid)
    # full blocks are those whose every in-range entry is visible; none listed is empty
    padded = torch.zeros(*want.shape[:2], -(-Tq // BS) * BS, -(-Tk // BS) * BS, dtype=torch.bool,
                         device="cpu")  # fmt: skip
    padded[..., :Tq, :Tk] = want
    blocks = padded.unflatten(2, (-1, BS)).unflatten(4, (-1, BS))
    inside = torch.zeros_like(padded)
    inside[..., :Tq, :Tk] = True
    inside = inside.unflatten(2, (-1, BS)).unflatten(4, (-1, BS))
    full = (blocks | ~inside).all(dim=(3, 5))
    assert torch.equal(kv_grid == -1, full & blocks.any(dim=(3, 5)))
    assert torch.equal(kv_grid == -2, ~blocks.any(dim=(3, 5)))


def _qkv(B, H, Tq, Tk, D=16, Hkv=None, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    Hkv = Hkv or H

    def randn(*shape):
        return _here(torch.randn(*shape, generator=g, device="cpu").to(dtype))

    return dict(q=randn(B, H, Tq, D), k=randn(B, Hkv, Tk, D), v=randn(B, Hkv, Tk, D))


def _reference_op(block_mask, **kw):
    def op(q, k, v, attn_mask=None, **tensors):
        dense = block_mask.to(q.device).dense_mask()
        if attn_mask is not None:
            dense = (
                attn_mask & dense
                if attn_mask.dtype == torch.bool
                else attn_mask.masked_fill(~dense, float("-inf"))
            )
        return reference.attention(q, k, v, attn_mask=dense, **kw, **tensors)

    return op


def _triton_op(block_mask, **kw):
    def op(q, k, v, **tensors):
        return fusedattn.attention(
            q, k, v, block_mask=block_mask, backend="triton", **kw, **tensors
        )

    return op


@pytest.mark.parametrize("name", CASES)
def test_triton_block_sparse_attention_matches_float64(name):
    factory, B, H, Tq, Tk = CASES[name]
    bm = create_block_mask(factory(), B, H, Tq, Tk, BLOCK_SIZE=BS)
    tensors = _qkv(B or 2, H or 2, Tq, Tk)
    assert_op_kx(_triton_op(bm), _reference_op(bm), tensors, grad_of=("q", "k", "v"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    ["causal_gqa_bf16", "padding_window_softcap", "bool_and_float_masks", "alibi_sinks_tq_ne_tk"],
)
def test_block_masks_compose_with_the_other_options(variant):
    B, H, Tq, Tk = 2, 4, 70, 90
    mask_mod = window_in_documents([30, 40, 20], 50)
    if variant == "alibi_sinks_tq_ne_tk":
        Tq = 45
        mask_mod = and_masks(
            lambda b, h, q, kv: kv >= 0, lambda b, h, q, kv: (kv // 7 + q) % 3 != 0
        )
    bm = create_block_mask(mask_mod, None, None, Tq, Tk, BLOCK_SIZE=BS)
    dtype = torch.bfloat16 if variant == "causal_gqa_bf16" else torch.float32
    tensors = _qkv(B, H, Tq, Tk, Hkv=2 if variant == "causal_gqa_bf16" else H, dtype=dtype)
    kw = {}
    if variant == "causal_gqa_bf16":
        kw = dict(is_causal=True, enable_gqa=True)
    elif variant == "padding_window_softcap":
        pad = torch.zeros(B, Tk, dtype=torch.bool)
        pad[1, 60:] = True
        tensors["key_padding_mask"] = pad
        kw = dict(window_size=(25, 3), softcap=5.0)
    elif variant == "bool_and_float_masks":
        g = torch.Generator().manual_seed(3)
        tensors["attn_mask"] = _here(torch.randn(B, 1, Tq, Tk, generator=g, device="cpu"))
        tensors["attn_mask"][:, :, :, ::5] = float("-inf")
    else:
        g = torch.Generator().manual_seed(4)
        kw = dict(alibi_slopes=_here(torch.rand(H, generator=g, device="cpu")),
                  sinks=_here(torch.randn(H, generator=g, device="cpu")),
                  causal_alignment="bottom_right", window_size=(-1, 0))  # fmt: skip
    grads = ("q", "k", "v", "attn_mask") if "attn_mask" in tensors else ("q", "k", "v")
    assert_op_kx(_triton_op(bm, **kw), _reference_op(bm, **kw), tensors, grad_of=grads)


def test_a_row_that_sees_nothing_gives_zero_output_gradients_and_minus_inf_lse():
    bm = create_block_mask(
        lambda b, h, q, kv: (q < 20) & (kv < 40), None, None, 64, 64, BLOCK_SIZE=BS
    )
    t = {n: x.requires_grad_() for n, x in _qkv(1, 2, 64, 64).items()}
    out, lse = fusedattn.attention(**t, block_mask=bm, return_lse=True, backend="triton")
    assert torch.equal(out[:, :, 20:], torch.zeros_like(out[:, :, 20:]))
    assert torch.isinf(lse[:, :, 20:]).all() and (lse[:, :, 20:] < 0).all()
    out.sum().backward()
    assert not t["q"].grad[:, :, 20:].any() and not t["k"].grad[:, :, 40:].any()
    assert torch.isfinite(t["q"].grad).all()


def test_a_causal_block_mask_equals_is_causal_and_dropout_follows_the_dense_mask():
    Tq = 75
    t = _qkv(1, 2, Tq, Tq)
    bm = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, Tq, Tq, BLOCK_SIZE=BS)
    got = fusedattn.attention(**t, block_mask=bm, backend="triton")
    want = fusedattn.attention(**t, is_causal=True, backend="triton")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # dropout: the same Philox stream per (head, query, key) as the dense kernels'
    torch.manual_seed(7)
    a = fusedattn.attention(**t, block_mask=bm, dropout_p=0.3, backend="triton")
    torch.manual_seed(7)
    b = fusedattn.attention(**t, attn_mask=_here(bm.dense_mask()), dropout_p=0.3, backend="triton")
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_kernels_visit_only_the_listed_tiles(monkeypatch):
    """A pattern listing 2 of 16 key blocks per query row: the forward's P·V products (one per
    visited tile) are 2/16 of the dense call's, and the backward's dK/dV updates too (counted
    in the interpreter, where a kernel's helpers are Python calls)."""
    import fusedattn.triton_kernels.attention_loops as kernels

    if torch.get_default_device().type == "cuda":
        pytest.skip("counts the interpreter's calls; a compiled kernel has no Python calls")

    T = 16 * BS
    bm = create_block_mask(
        lambda b, h, q, kv: (kv // BS) % 8 == (q // BS) % 8, None, None, T, T, BLOCK_SIZE=BS
    )
    assert bm.listed_blocks() == 16 * 2
    counts = {"fwd": 0, "dkdv": 0}
    fwd_pv, dkdv_update = kernels._fwd_pv, kernels._dkdv_update

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(kernels, "_fwd_pv", counting("fwd", fwd_pv))
    monkeypatch.setattr(kernels, "_dkdv_update", counting("dkdv", dkdv_update))
    t = {n: x.requires_grad_() for n, x in _qkv(1, 1, T, T).items()}
    fusedattn.attention(**t, block_mask=bm, backend="triton").sum().backward()
    sparse = dict(counts)
    counts.update(fwd=0, dkdv=0)
    fusedattn.attention(**t, backend="triton").sum().backward()
    assert sparse["fwd"] > 0 and sparse["fwd"] * 8 == counts["fwd"], (sparse, counts)
    assert sparse["dkdv"] * 8 == counts["dkdv"], (sparse, counts)


def test_wrong_sizes_and_the_cuda_backend_are_refused_before_any_launch():
    bm = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 64, 64, BLOCK_SIZE=BS)
    t = _qkv(1, 2, 64, 80)
    with pytest.raises(
        ValueError, match=r"block_mask was built for \(Q_LEN, KV_LEN\) = \(64, 64\)"
    ):
        fusedattn.attention(**t, block_mask=bm)
    per_head = create_block_mask(lambda b, h, q, kv: q >= kv, None, 3, 64, 80, BLOCK_SIZE=BS)
    with pytest.raises(ValueError, match="block_mask was built for B=1, H=3"):
        fusedattn.attention(**t, block_mask=per_head)
    with pytest.raises(ValueError, match="block_mask: the CUDA attention"):
        fusedattn.attention(**_qkv(1, 2, 64, 64), block_mask=bm, backend="cuda")
    with pytest.raises(TypeError, match="block_mask must be"):
        fusedattn.attention(**_qkv(1, 2, 64, 64), block_mask=bm.dense_mask())
    with pytest.raises(ValueError, match="BLOCK_SIZE"):
        create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 64, 64, BLOCK_SIZE=48)


def test_torch_block_masks_are_converted_once_and_give_the_same_result():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    mask_mod = or_masks(document_causal([40, 60]), lambda b, h, q, kv: kv < 4)
    torch_bm = flex.create_block_mask(mask_mod, None, None, 100, 100, device="cpu", BLOCK_SIZE=BS)
    ours = create_block_mask(mask_mod, None, None, 100, 100, BLOCK_SIZE=BS)
    from fusedattn.block_mask import from_torch

    converted = from_torch(torch_bm)
    assert from_torch(torch_bm) is converted  # kept with the object
    assert torch.equal(converted.dense_mask(), ours.dense_mask())
    torch_and = flex.and_masks(document_causal([40, 60]), lambda b, h, q, kv: kv < 4)
    assert torch.equal(create_block_mask(torch_and, None, None, 100, 100, BLOCK_SIZE=BS).dense_mask(),
                       dense_of(torch_and, 1, 1, 100, 100))  # fmt: skip
    t = _qkv(1, 2, 100, 100)
    got = fusedattn.attention(**t, block_mask=torch_bm, backend="triton")
    want = fusedattn.attention(**t, block_mask=ours, backend="triton")
    assert torch.equal(got, want)


def test_compiled_block_mask_attention_is_one_graph_with_eagers_result():
    bm = create_block_mask(document_causal([30, 34]), None, None, 64, 64, BLOCK_SIZE=BS)
    t = {n: x.requires_grad_() for n, x in _qkv(1, 2, 64, 64).items()}

    def step(q, k, v):
        return fusedattn.attention(q, k, v, block_mask=bm, backend="triton")

    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    got = torch.compile(step, fullgraph=True, backend=recording)(**t)
    assert len(graphs) == 1
    want = step(**t)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.sum().backward()


def test_the_flex_attention_import_gives_torchs_flex_attention_without_a_compile():
    """fusedattn.compat.flex_attention against torch's own flex_attention (eager, on the CPU)
    on the same torch BlockMask and on fusedattn's."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    from fusedattn.compat import flex_attention as compat

    doc = _here(_docs([50, 46]))  # the masks built on the device of the call

    def mask_mod(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    torch_bm = flex.create_block_mask(mask_mod, None, None, 96, 96, device=torch.get_default_device(),
                                      BLOCK_SIZE=BS)  # fmt: skip
    ours = compat.create_block_mask(mask_mod, None, None, 96, 96, BLOCK_SIZE=BS,
                                    device=torch.get_default_device())  # fmt: skip
    t = _qkv(2, 4, 96, 96, Hkv=2)
    q64, k64, v64 = (t[n].double() for n in ("q", "k", "v"))
    want, want_lse = flex.flex_attention(q64, k64, v64, block_mask=torch_bm, enable_gqa=True,
                                         return_lse=True)  # fmt: skip
    for bm in (torch_bm, ours):
        out, lse = compat.flex_attention(t["q"], t["k"], t["v"], block_mask=bm, enable_gqa=True,
                                         return_lse=True)  # fmt: skip
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


def test_the_fp8_forward_with_a_block_mask_equals_it_with_the_dense_mask():
    """fp8 q, k, v (e4m3 with descales, inference): the block-sparse forward against the same
    kernels on the dense bool mask the block mask stands for."""
    from fusedattn.fp8 import quantize

    B, H, T, D = 1, 2, 70, 32
    g = torch.Generator().manual_seed(5)
    e4m3 = torch.float8_e4m3fn
    x = [_here(torch.randn(B, H, T, D, generator=g, device="cpu")) for _ in range(3)]
    ds = [_here(torch.rand(B, H, generator=g, device="cpu") * 0.01 + 0.004) for _ in range(3)]
    q8, k8, v8 = (quantize(t, d[:, :, None, None], e4m3) for t, d in zip(x, ds, strict=True))
    bm = create_block_mask(window_in_documents([30, 40], 25), None, None, T, T, BLOCK_SIZE=BS)
    kw = dict(q_descale=ds[0], k_descale=ds[1], v_descale=ds[2], return_lse=True, backend="triton")
    got, lse = fusedattn.attention(q8, k8, v8, block_mask=bm, **kw)
    want, want_lse = fusedattn.attention(q8, k8, v8, attn_mask=_here(bm.dense_mask()), **kw)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
