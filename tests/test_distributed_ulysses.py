"""Ulysses context parallelism (issue #72): strategy "ulysses" on 2 to 4 gloo processes against
fusedattn.attention on the whole sequence in float64 under the k× rule (outputs, lse and every
gradient gathered from the ranks), with what the key-splitting strategies cannot take (a
whole-sequence float mask with its gradient, key padding, ALiBi), per-head inputs sliced to
each rank's heads, K/V heads replicated where W does not divide them (one K/V head at W = 4);
the packed form; USP (Ulysses inside, the ring across) as 2x2, 1x4 and 4x1 groups and a
DeviceMesh; a per-head block mask with a learnable score_mod bias (each rank its heads'
share of the mask, h offset to its first head); the traffic (one all-to-all each way, no K/V gathered); bad calls refused on every
rank. One spawn per group size runs all of its cases (tests/distributed_helpers.py)."""

import pytest
import torch
from distributed_helpers import run_group

from fusedattn import reference
from fusedattn.testing import compare_kx

T, D, HQ = 24, 8, 12  # 12 query heads divide W = 1..4; 24 positions a multiple of 2W
OPTIONS = {
    "causal_gqa": dict(is_causal=True, hkv=4),
    "bias_padding": dict(bias=True, padding=True, hkv=4),
    "alibi_sinks_window": dict(alibi=True, sinks=True, window_size=(6, 3), hkv=4),
    "softcap_one_kv_head": dict(softcap=2.0, is_causal=True, hkv=1),
    "everything": dict(is_causal=True, bias=True, padding=True, sinks=True, softcap=2.0, hkv=2),
}
pytestmark = pytest.mark.slow


def inputs(option, dtype="float32"):
    """The whole sequence's tensors and keywords, the same in every process (seeded)."""
    g = torch.Generator().manual_seed(11)
    opts = OPTIONS[option]
    hkv = opts["hkv"]
    to = getattr(torch, dtype)
    q = torch.randn(2, HQ, T, D, generator=g).to(to)
    k, v = (torch.randn(2, hkv, T, D, generator=g).to(to) for _ in range(2))
    dout = torch.randn(2, HQ, T, D, generator=g).to(to)
    kw = dict(is_causal=opts.get("is_causal", False), window_size=opts.get("window_size"),
              softcap=opts.get("softcap", 0.0), enable_gqa=hkv != HQ)  # fmt: skip
    grads = {}
    if opts.get("bias"):  # a learned relative-position bias per head: its gradient too
        grads["attn_mask"] = torch.randn(1, HQ, T, T, generator=g).to(to)
    if opts.get("sinks"):
        grads["sinks"] = torch.randn(HQ, generator=g)
    if opts.get("padding"):
        kpm = torch.zeros(2, T, dtype=torch.bool)
        kpm[1, 17:] = True
        kw["key_padding_mask"] = kpm
    if opts.get("alibi"):
        kw["alibi_slopes"] = torch.rand(HQ, generator=g) * 0.3
    return q, k, v, dout, grads, kw


def run_ulysses(cp, option, layout, backend, dtype, **extra):
    """This rank's call; the whole sequence's out, lse and gradients back (gathered)."""
    import torch.distributed as dist

    q, k, v, dout, grads, kw = inputs(option, dtype)
    shard = lambda t: cp.shard_sequence(t, 2, layout=layout)  # noqa: E731
    leaves = [shard(t).requires_grad_() for t in (q, k, v)]
    extras = {n: t.clone().requires_grad_() for n, t in grads.items()}
    lse_too = backend != "torch"  # SDPA returns no log-sum-exp: the torch backend refuses it
    result = cp.context_parallel_attention(
        *leaves, strategy="ulysses", layout=layout, return_lse=lse_too, backend=backend,
        **kw, **extras, **extra,
    )  # fmt: skip
    out, lse = result if lse_too else (result, None)
    got = torch.autograd.grad(out, leaves + list(extras.values()), shard(dout))
    whole = [cp.unshard_sequence(t, 2, layout=layout) for t in (out.detach(), *got[:3])]
    whole.append(None if lse is None else
                 cp.unshard_sequence(lse.unsqueeze(-1), 2, layout=layout)[..., 0])  # fmt: skip
    for g in got[3:]:  # each rank's part of a per-head input's gradient: summed
        g = g.clone()
        dist.all_reduce(g)
        whole.append(g)
    return whole


def truth(option, dtype, compute, backend="reference"):
    """out, dq, dk, dv, lse, d<extras> of `attention` on the whole sequence in one process."""
    import fusedattn

    q, k, v, dout, grads, kw = inputs(option, dtype)
    leaves = [t.to(compute).requires_grad_() for t in (q, k, v)]
    extras = {n: t.to(compute if n == "attn_mask" else t.dtype).requires_grad_()
              for n, t in grads.items()}  # fmt: skip
    out, lse = fusedattn.attention(*leaves, return_lse=True, backend=backend, **kw, **extras)
    got = torch.autograd.grad(out, leaves + list(extras.values()), dout.to(compute))
    return [out, *got[:3], lse, *got[3:]]


NAMES = ("out", "dq", "dk", "dv", "lse", "d_extra", "d_extra2")

CASES = [  # (option, layout, backend, dtype)
    ("causal_gqa", "zigzag", "reference", "float32"),
    ("bias_padding", "contiguous", "reference", "float32"),
    ("alibi_sinks_window", "zigzag", "reference", "float32"),
    ("softcap_one_kv_head", "contiguous", "reference", "float32"),
    ("everything", "zigzag", "reference", "bfloat16"),
    ("causal_gqa", "contiguous", "torch", "float32"),
    ("everything", "zigzag", "triton", "float32"),
]


def flex_inputs(dtype):
    """A per-head block mask (BLOCK_SIZE 16: partial blocks cut by T = 24), a learnable
    relative bias per head read by a score_mod, and the whole sequence's tensors."""
    from fusedattn.masks import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):  # a causal window of 3 + h % 4 keys, or a global key
        return ((q_idx >= kv_idx) & (q_idx - kv_idx <= 3 + h % 4)) | (kv_idx == 1)

    g = torch.Generator().manual_seed(5)
    to = getattr(torch, dtype)
    q = torch.randn(2, HQ, T, D, generator=g).to(to)
    k, v = (torch.randn(2, 4, T, D, generator=g).to(to) for _ in range(2))
    dout = torch.randn(2, HQ, T, D, generator=g).to(to)
    table = torch.randn(HQ, 2 * T - 1, generator=g)
    mask = create_block_mask(mask_mod, None, HQ, T, T, device="cpu", BLOCK_SIZE=16)
    return q, k, v, dout, table, mask


def flex_call(attend, table, mask, **kw):
    """attention or context_parallel_attention with the block mask and the bias table's
    score_mod (h the query head among all HQ)."""

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + T - 1] * (1 + 0.5 * (h == 7))

    return attend(block_mask=mask, score_mod=relative_bias, enable_gqa=True, **kw)


FLEX_CASES = [("zigzag", "reference", "float32"), ("contiguous", "triton", "float32")]


def flex_cases(world):
    """The kernels' case at W = 2 only (the interpreter's time); the reference's at every W
    (the head offsets 3, 6, 9 at W = 4)."""
    return FLEX_CASES if world == 2 else FLEX_CASES[:1]


def run_flex(cp, layout, backend, dtype):
    """This rank's Ulysses call with the block mask and the score_mod; the whole sequence's
    out, dq, dk, dv and the table's gradient (each rank's heads' part, summed) back."""
    import functools

    import torch.distributed as dist

    q, k, v, dout, table, mask = flex_inputs(dtype)
    shard = lambda t: cp.shard_sequence(t, 2, layout=layout)  # noqa: E731
    leaves = [shard(t).requires_grad_() for t in (q, k, v)]
    table = table.requires_grad_()
    attend = functools.partial(cp.context_parallel_attention, *leaves, strategy="ulysses",
                               layout=layout, backend=backend)  # fmt: skip
    out = flex_call(attend, table, mask)
    got = torch.autograd.grad(out, [*leaves, table], shard(dout))
    whole = [cp.unshard_sequence(t, 2, layout=layout) for t in (out.detach(), *got[:3])]
    d_table = got[3].clone()
    dist.all_reduce(d_table)
    return [*whole, d_table]


def flex_truth(dtype, compute):
    import functools

    import fusedattn

    q, k, v, dout, table, mask = flex_inputs(dtype)
    leaves = [t.to(compute).requires_grad_() for t in (q, k, v)]
    table = table.to(compute).requires_grad_()
    attend = functools.partial(fusedattn.attention, *leaves, backend="reference")
    out = flex_call(attend, table, mask)
    return [out, *torch.autograd.grad(out, [*leaves, table], dout.to(compute))]


def ulysses_worker(rank, world):
    from fusedattn import distributed as cp

    dense = [run_ulysses(cp, *case) for case in CASES]
    return dense, varlen_worker(rank, world), [run_flex(cp, *case) for case in flex_cases(world)]


def check(case, got):
    option, _, _, dtype = case
    want = truth(option, dtype, torch.float64)
    base = truth(option, dtype, getattr(torch, dtype))
    for name, a, r, b in zip(NAMES, got, want, base, strict=False):
        if a is None:  # no lse from the torch backend
            continue
        result = compare_kx(a, r, b, name=f"{case} {name}")
        assert result.ok, result.message


@pytest.mark.parametrize("world", [2, 4])
def test_ulysses_equals_attention_on_the_whole_sequence(world):
    """W = 2 cuts every K/V head count evenly but one; W = 4 repeats 1 and 2 K/V heads. Also
    the packed form (its documents cut by the shards) and, at W = 4, the bf16 error."""
    results = run_group(ulysses_worker, world, timeout=600)
    dense, packed = results[0][0], [r[1] for r in results]
    for case, got in zip(CASES, dense, strict=True):
        check(case, got)
    for case, got in zip(flex_cases(world), results[0][2], strict=True):
        want, base = flex_truth(case[2], torch.float64), flex_truth(case[2], torch.float32)
        for name, a, r, b in zip(("out", "dq", "dk", "dv", "d_table"), got, want, base,
                                 strict=True):  # fmt: skip
            result = compare_kx(a, r, b, name=f"block_mask + score_mod {case} {name}")
            assert result.ok, result.message
    check_varlen(packed)
    if world == 4:
        check_bf16_error(dense[CASES.index(("everything", "zigzag", "reference", "bfloat16"))])


def check_bf16_error(got):
    """Each rank computes whole rows: at W = 4 the bf16 output, lse and dq are one process's
    bit for bit (the reference backend computes each head alone); dk, dv and the per-head
    inputs' gradients are summed over replicated K/V heads and ranks in another order, and
    stay within 1.5x one process's error against float64: the error does not grow with W."""
    one = truth("everything", "bfloat16", torch.bfloat16)
    exact = truth("everything", "bfloat16", torch.float64)
    for name, a, b, r in zip(NAMES, got, one, exact, strict=True):
        if name in ("out", "lse", "dq"):
            assert torch.equal(a, b), name
            continue
        e4 = (a.double() - r.double()).abs().max().item()
        e1 = (b.double() - r.double()).abs().max().item()
        assert e4 <= 1.5 * e1 + 1e-6, f"{name}: {e4:.3g} at 4 ranks, {e1:.3g} in one process"


SHAPES = [(2, 2), (1, 4), (4, 1)]  # (ring, ulysses) grids of the 4 ranks


def usp_worker(rank, world):
    """USP over each (ring, ulysses) grid of the 4 ranks, as a pair of groups and as a
    DeviceMesh; whole-sequence results back."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fusedattn import distributed as cp

    groupings = []
    for R, U in SHAPES:  # every rank creates every group, in the same order
        rows = [dist.new_group(list(range(r * U, (r + 1) * U))) for r in range(R)]
        cols = [dist.new_group(list(range(u, R * U, U))) for u in range(U)]
        mesh = init_device_mesh("cpu", (R, U), mesh_dim_names=("ring", "ulysses"))
        groupings += [(rows[rank // U], cols[rank % U]), mesh]
    results = []
    for group in groupings:
        q, k, v, dout, grads, kw = inputs("alibi_sinks_window")
        kw = {n: x for n, x in kw.items() if n != "alibi_slopes"}  # the ring refuses ALiBi
        shard = lambda t: cp.shard_sequence(t, 2, layout="contiguous")  # noqa: E731
        leaves = [shard(t).requires_grad_() for t in (q, k, v)]
        sinks = grads["sinks"].clone().requires_grad_()
        out, lse = cp.context_parallel_attention(
            *leaves, sinks=sinks, group=group, strategy="usp", return_lse=True,
            backend="reference", layout="contiguous", **kw,
        )  # fmt: skip
        got = torch.autograd.grad(out, [*leaves, sinks], shard(dout))
        whole = [cp.unshard_sequence(t, 2, layout="contiguous") for t in (out, *got[:3])]
        whole.append(cp.unshard_sequence(lse.unsqueeze(-1), 2, layout="contiguous")[..., 0])
        dsinks = got[3].clone()
        dist.all_reduce(dsinks)
        results.append([*whole, dsinks])
    return results


def test_usp_equals_attention_on_the_whole_sequence():
    """W = 4 as 2x2, 1x4 and 4x1, each as a pair of groups and as a DeviceMesh."""
    results = run_group(usp_worker, 4, timeout=600)[0]
    assert len(results) == 2 * len(SHAPES)
    q, k, v, dout, grads, kw = inputs("alibi_sinks_window")
    kw = {n: x for n, x in kw.items() if n != "alibi_slopes"}
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    sinks = grads["sinks"].double().requires_grad_()
    out, lse = reference.attention(*leaves, sinks=sinks, return_lse=True, **kw)
    want = [out, *torch.autograd.grad(out, [*leaves, sinks], dout.double())]
    want.insert(4, lse)
    for got in results:
        for name, a, r in zip(("out", "dq", "dk", "dv", "lse", "dsinks"), got, want, strict=True):
            torch.testing.assert_close(
                a.double(), r.detach().double(), rtol=1e-4, atol=1e-4, msg=name
            )


def packed_batch():
    """Three documents (5, 18 and 13 tokens) packed into 36, the same in every process."""
    cu = torch.tensor([0, 5, 23, 36], dtype=torch.int32)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(36, HQ, D, generator=g)
    k, v = (torch.randn(36, 4, D, generator=g) for _ in range(2))
    dout = torch.randn(36, HQ, D, generator=g)
    return cu, q, k, v, dout, torch.randn(HQ, generator=g)


def varlen_worker(rank, world):
    """Three documents packed into 36 tokens (cut across the shards), causal with sinks."""
    from fusedattn import distributed as cp

    cu, q, k, v, dout, sinks = packed_batch()
    n = 36 // world
    part = slice(rank * n, (rank + 1) * n)
    leaves = [t[part].clone().requires_grad_() for t in (q, k, v)]
    sk = sinks.clone().requires_grad_()
    out, lse = cp.context_parallel_varlen_attention(
        *leaves, cu, cu, 18, 18, is_causal=True, sinks=sk, return_lse=True, backend="reference",
        group=None, enable_gqa=True,
    )  # fmt: skip
    grads = torch.autograd.grad(out, [*leaves, sk], dout[part])
    return out.detach(), lse, *grads


def check_varlen(parts):
    """varlen_attention over the whole packed batch (three documents in 36 tokens), causal with
    sinks, against float64: each rank's rows, its lse and gradients, the sinks' summed."""
    cu, q, k, v, dout, sinks = packed_batch()
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    sk = sinks.double().requires_grad_()
    out, lse = reference.varlen_attention(*leaves, cu, cu, 18, 18, is_causal=True, sinks=sk,
                                          return_lse=True, enable_gqa=True)  # fmt: skip
    dq, dk, dv, ds = torch.autograd.grad(out, [*leaves, sk], dout.double())
    got = [torch.cat([p[i] for p in parts], dim=1 if i == 1 else 0) for i in range(5)]
    got.append(sum(p[5] for p in parts))
    for name, a, r in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got,
                          (out, lse, dq, dk, dv, ds), strict=True):  # fmt: skip
        torch.testing.assert_close(a.double(), r.detach().double(), rtol=1e-4, atol=1e-4, msg=name)


def traffic_worker(rank, world):
    """The collectives one forward runs: the options' agreement (a few int64s), one
    all-to-all of q, k and v, one of the output; nothing of K/V gathered. Then a call with
    dropout, forward and backward."""
    import torch.distributed as dist

    from fusedattn import distributed as cp

    calls = []
    for name in ("all_to_all_single", "all_gather", "all_gather_into_tensor", "broadcast",
                 "all_reduce", "isend", "irecv", "batch_isend_irecv"):  # fmt: skip
        original = getattr(dist, name)

        def counting(*args, _name=name, _original=original, **kwargs):
            first = args[0] if args else None
            size = first.numel() if torch.is_tensor(first) else sum(t.numel() for t in first or [])
            calls.append((_name, size))
            return _original(*args, **kwargs)

        setattr(dist, name, counting)
    q, k, v, _, _, kw = inputs("causal_gqa")
    shard = lambda t: cp.shard_sequence(t, 2)  # noqa: E731
    plain = cp.context_parallel_attention(shard(q), shard(k), shard(v), strategy="ulysses",
                                          backend="reference", **kw)  # fmt: skip
    seen = list(calls)
    # dropout: each rank draws its own heads' masks over whole rows (the ring refuses it)
    leaves = [shard(t).requires_grad_() for t in (q, k, v)]
    dropped = cp.context_parallel_attention(*leaves, strategy="ulysses", dropout_p=0.5,
                                            backend="reference", **kw)  # fmt: skip
    grads = torch.autograd.grad(dropped.sum(), leaves)
    return seen, plain, dropped.detach(), grads


def test_the_forward_sends_one_all_to_all_each_way_and_gathers_no_keys():
    calls, plain, dropped, grads = run_group(traffic_worker, 2, timeout=120)[0]
    kinds = [name for name, _ in calls]
    assert kinds == ["all_gather", "all_to_all_single", "all_to_all_single"], calls
    assert calls[0][1] <= 2 * 20  # the agreement: a few int64s per rank, no tensor data
    assert torch.isfinite(dropped).all() and not torch.allclose(dropped, plain)
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


def bad_worker(rank, world):
    import torch.distributed as dist

    from fusedattn import distributed as cp
    from fusedattn.masks import create_block_mask

    messages = []
    q = torch.randn(1, 1, 4, 8)  # 1 head for 2 ranks (3 heads split 2 + 1: edges test)
    kv = torch.randn(1, 4, 4, 8)
    causal = create_block_mask(lambda b, h, i, j: i >= j, None, None, 8, 8, device="cpu",
                               BLOCK_SIZE=16)  # fmt: skip
    too_short = create_block_mask(lambda b, h, i, j: i >= j, None, None, 4, 4, device="cpu",
                                  BLOCK_SIZE=16)  # fmt: skip
    wrong = torch.zeros(2, 8 + rank, dtype=torch.bool)  # rank 1's padding is the wrong length
    for call in (
        lambda: cp.context_parallel_attention(q, q, q, strategy="ulysses"),
        lambda: cp.context_parallel_attention(kv, kv, kv, strategy="ulysses",
                                              key_padding_mask=wrong[:1]),
        lambda: cp.context_parallel_attention(kv, kv, kv, key_padding_mask=wrong[:1, :8]),
        lambda: cp.context_parallel_attention(kv, kv, kv, strategy="usp"),
        lambda: cp.context_parallel_varlen_attention(
            kv[0].transpose(0, 1), *(kv[0].transpose(0, 1),) * 2,
            *(torch.tensor([0, 7], dtype=torch.int32),) * 2, 7, 7),
        lambda: cp.context_parallel_attention(kv, kv, kv, block_mask=causal),
        lambda: cp.context_parallel_attention(kv, kv, kv, strategy="allgather",
                                              score_mod=lambda s, b, h, i, j: s * 2),
        lambda: cp.context_parallel_attention(kv, kv, kv, strategy="ulysses",
                                              block_mask=too_short),
        lambda: cp.context_parallel_attention(kv, kv, kv, strategy="ulysses",
                                              score_mod=lambda s, b, h, i, j: s.item()),
    ):  # fmt: skip
        try:
            call()
            messages.append(None)
        except (ValueError, TypeError) as exc:
            messages.append(str(exc))
    dist.barrier()  # every rank got here: nothing hung
    return messages


def test_bad_calls_are_refused_on_every_rank_and_never_hang():
    results = run_group(bad_worker, 2, timeout=120)
    for rank, messages in enumerate(results):
        assert "Hq = 1 query heads are fewer than W = 2 ranks" in messages[0]
        assert ("key_padding_mask" in messages[1]) if rank == 1 else (
            "rank(s) [1] of the group refused its inputs" in messages[1])  # fmt: skip
        assert "cannot take key_padding_mask: use strategy='ulysses'" in messages[2]
        assert "group=(ulysses_group, ring_group)" in messages[3]
        assert "7 tokens in the batch" in messages[4]
        assert "strategy 'ring' splits each row's keys" in messages[5]
        assert "cannot take block_mask: use strategy='ulysses'" in messages[5]
        assert "cannot take score_mod: use strategy='ulysses'" in messages[6]
        assert "block_mask was built for (Q_LEN, KV_LEN) = (4, 4)" in messages[7]
        assert ".item()" in messages[8]
