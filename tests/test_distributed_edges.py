"""Context parallelism where users step off the tested path (issue #82), on 4 gloo processes in
one spawn, against the reference attention on the whole sequence in float64:

- USP honours the layout (zigzag, the default of shard_sequence, was silently off by 1.65);
- USP refuses groupings against its convention (strided Ulysses groups, as yunchang builds
  them with use_ulysses_low=False; a mesh whose names are swapped), naming the convention;
- shards of a sequence that W does not divide: every rank's error names the ranks' shapes;
- uneven heads under Ulysses (7 heads on 4 ranks, DeepSpeed's split), with GQA and the packed
  form, forward and backward;
- context_parallel_varlen_attention takes enable_gqa;
- float64 under the ring and USP is float64-accurate (partials merged in float64);
- the ring's lse is differentiable; the Ulysses lse refuses a backward by name."""

import pytest
import torch
from distributed_helpers import run_group

from fusedattn import reference

pytestmark = pytest.mark.slow
T, D = 16, 8


def _whole(seed, Hq, Hkv, dtype=torch.float64, T=T):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, Hq, T, D, generator=g, dtype=dtype)
    k, v = (torch.randn(2, Hkv, T, D, generator=g, dtype=dtype) for _ in range(2))
    dout = torch.randn(2, Hq, T, D, generator=g, dtype=dtype)
    return q, k, v, dout


def _run(cp, group, strategy, layout, seed, Hq, Hkv, dtype=torch.float64, lse_loss=False, **kw):
    """The whole sequence's out and dq, dk, dv from this rank's call (gathered)."""
    q, k, v, dout = _whole(seed, Hq, Hkv, dtype)
    shard = lambda t: cp.shard_sequence(t, 2, layout=layout)  # noqa: E731
    leaves = [shard(t).requires_grad_() for t in (q, k, v)]
    out, lse = cp.context_parallel_attention(
        *leaves, group=group, strategy=strategy, layout=layout, return_lse=True,
        backend="reference", enable_gqa=Hq != Hkv, **kw,
    )  # fmt: skip
    loss = (out * shard(dout)).sum()
    if lse_loss:
        loss = loss + (lse * shard(dout[..., 0])).sum()
    grads = torch.autograd.grad(loss, leaves)
    whole = [cp.unshard_sequence(t, 2, layout=layout) for t in (out.detach(), *grads)]
    return [*whole, cp.unshard_sequence(lse.detach().unsqueeze(-1), 2, layout=layout)[..., 0]]


def _truth(seed, Hq, Hkv, dtype=torch.float64, lse_loss=False, **kw):
    q, k, v, dout = _whole(seed, Hq, Hkv, dtype)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    out, lse = reference.attention(*leaves, return_lse=True, enable_gqa=Hq != Hkv, **kw)
    loss = (out * dout.double()).sum()
    if lse_loss:
        loss = loss + (lse.double() * dout[..., 0].double()).sum()
    return [out.detach(), *torch.autograd.grad(loss, leaves), lse.detach()]


def _refusal(call) -> str | None:
    try:
        call()
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None


def edges_worker(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fusedattn import distributed as cp

    rows = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    cols = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
    swapped = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ulysses", "ring"))
    usp = (rows[rank // 2], cols[rank % 2])
    results = {}
    causal = dict(is_causal=True)
    # 3: USP in both layouts (float64: 10: merged in float64), as groups and as a mesh
    for layout in ("zigzag", "contiguous"):
        results[f"usp-{layout}"] = _run(cp, usp, "usp", layout, 1, 4, 2, **causal)
    results["usp-mesh-zigzag"] = _run(cp, mesh, "usp", "zigzag", 1, 4, 2, **causal)
    results["ring-float64"] = _run(cp, None, "ring", "zigzag", 1, 4, 2, **causal)
    # 2: the ring's lse differentiable (a loss of out and lse)
    results["ring-lse"] = _run(cp, None, "ring", "zigzag", 2, 4, 4, lse_loss=True, **causal)
    # 6: uneven heads (7 on 4 ranks), MHA and GQA (6 over 2 K/V heads), zigzag and contiguous
    results["uneven-7"] = _run(cp, None, "ulysses", "zigzag", 3, 7, 7, **causal)
    results["uneven-6-gqa"] = _run(cp, None, "ulysses", "contiguous", 4, 6, 2,
                                   window_size=(5, 0))  # fmt: skip
    results["uneven-usp"] = _run(cp, usp, "usp", "zigzag", 5, 3, 3, **causal)
    q, k, v, _ = _whole(0, 4, 4)
    part = lambda t: cp.shard_sequence(t, 2)  # noqa: E731
    messages = {
        # 4: strided Ulysses groups and a mesh with its names swapped
        "strided": _refusal(lambda: cp.context_parallel_attention(
            part(q), part(k), part(v), group=(cols[rank % 2], rows[rank // 2]), strategy="usp",
            backend="reference")),
        "swapped": _refusal(lambda: cp.context_parallel_attention(
            part(q), part(k), part(v), group=swapped, strategy="usp", backend="reference")),
        # 5: 3 or 2 positions a rank (a sequence of 10 on 4 ranks)
        "ragged": _refusal(lambda: cp.context_parallel_attention(
            q[:, :, : 3 if rank < 2 else 2], k[:, :, : 3 if rank < 2 else 2],
            v[:, :, : 3 if rank < 2 else 2], strategy="ulysses", layout="contiguous",
            backend="reference")),
        "few-heads": _refusal(lambda: cp.context_parallel_attention(
            part(q[:, :3]), part(k[:, :3]), part(v[:, :3]), strategy="ulysses",
            backend="reference")),
    }  # fmt: skip
    # 2: the Ulysses lse refuses a backward through it by name
    leaves = [part(t).requires_grad_() for t in (q, k, v)]
    out, lse = cp.context_parallel_attention(*leaves, strategy="ulysses", return_lse=True,
                                             backend="reference")  # fmt: skip
    try:
        torch.autograd.grad(out.sum() + lse.sum(), leaves)
        messages["ulysses-lse"] = None
    except RuntimeError as exc:
        messages["ulysses-lse"] = str(exc)
    # 10: the packed form with enable_gqa (6 query heads over 2 K/V heads: uneven too)
    cu = torch.tensor([0, 5, 23, 32], dtype=torch.int32)
    g = torch.Generator().manual_seed(9)
    pq = torch.randn(32, 6, D, generator=g, dtype=torch.float64)
    pk, pv = (torch.randn(32, 2, D, generator=g, dtype=torch.float64) for _ in range(2))
    share = slice(rank * 8, (rank + 1) * 8)
    packed = [t[share].clone().requires_grad_() for t in (pq, pk, pv)]
    pout = cp.context_parallel_varlen_attention(*packed, cu, cu, 18, 18, is_causal=True,
                                                enable_gqa=True, backend="reference")  # fmt: skip
    pgrads = torch.autograd.grad(pout.sum(), packed)
    messages["varlen-no-gqa"] = _refusal(lambda: cp.context_parallel_varlen_attention(
        *[t.detach() for t in packed], cu, cu, 18, 18, backend="reference"))  # fmt: skip
    dist.barrier()  # every rank got here: nothing hung
    return results, messages, (pout.detach(), *pgrads)


def test_context_parallel_edges():
    ranks = run_group(edges_worker, 4, timeout=600)
    results, _, _ = ranks[0]
    causal = dict(is_causal=True)
    want = {
        "usp-zigzag": _truth(1, 4, 2, **causal),
        "usp-contiguous": _truth(1, 4, 2, **causal),
        "usp-mesh-zigzag": _truth(1, 4, 2, **causal),
        "ring-float64": _truth(1, 4, 2, **causal),
        "ring-lse": _truth(2, 4, 4, lse_loss=True, **causal),
        "uneven-7": _truth(3, 7, 7, **causal),
        "uneven-6-gqa": _truth(4, 6, 2, window_size=(5, 0)),
        "uneven-usp": _truth(5, 3, 3, **causal),
    }
    for name, truth in want.items():
        for part, a, b in zip(("out", "dq", "dk", "dv", "lse"), results[name], truth,
                              strict=True):  # fmt: skip
            # float64 throughout: float32 merging was 5e-7 off
            err = (a.double() - b.double()).abs().max().item()
            limit = 1e-6 if part == "lse" else 1e-11  # the lse returned in fp32
            assert err < limit, f"{name} {part}: {err:.3g}"
    for rank, (_, msgs, _) in enumerate(ranks):
        assert "Ulysses groups of consecutive ranks" in msgs["strided"], (rank, msgs)
        assert "got the Ulysses group [" in msgs["strided"]
        assert "Ulysses groups of consecutive ranks" in msgs["swapped"], (rank, msgs)
        assert "the ranks' shards differ (rank 0: q (2, 4, 3, 8)" in msgs["ragged"], msgs
        assert "rank 3: q (2, 4, 2, 8)" in msgs["ragged"]
        assert "are fewer than W = 4 ranks" in msgs["few-heads"]
        assert "returns an lse without a gradient" in msgs["ulysses-lse"]
        assert "pass enable_gqa=True" in msgs["varlen-no-gqa"]
    # the packed form: each rank's rows against the whole batch's varlen_attention
    cu = torch.tensor([0, 5, 23, 32], dtype=torch.int32)
    g = torch.Generator().manual_seed(9)
    pq = torch.randn(32, 6, D, generator=g, dtype=torch.float64)
    pk, pv = (torch.randn(32, 2, D, generator=g, dtype=torch.float64) for _ in range(2))
    leaves = [t.requires_grad_() for t in (pq, pk, pv)]
    out = reference.varlen_attention(*leaves, cu, cu, 18, 18, is_causal=True, enable_gqa=True)
    wants = [out.detach(), *torch.autograd.grad(out.sum(), leaves)]
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        got = torch.cat([r[2][i] for r in ranks])
        assert (got - wants[i]).abs().max() < 1e-11, name
