"""Batch invariance (issue #73): under fusedattn.batch_invariant a sequence's attention gives
the same bits (torch.equal) whatever its batch, its chunking, its cache's layout; the norms
and softmax a row's bits whatever M. Triton under the interpreter here (the `invariant`
preset of scripts/gpu_check.sh runs this file on a GPU's compiled kernels).

The split size under the switch is 64 keys on the CPU (4 of the interpreter's 16-key tiles),
so caches of 90-160 keys cross several splits."""

from __future__ import annotations

import random

import pytest
import torch

import fusedattn
from fusedattn import invariance

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("kernel_device")]

Hq, Hkv, D = 4, 2, 16


@pytest.fixture
def invariant():
    with fusedattn.batch_invariant():
        yield


def _rand(*shape, g):
    return torch.randn(*shape, generator=g, device="cpu").to(torch.get_default_device())


def _cache(lengths, capacity, page_size, g, fill):
    """K/V caches holding each sequence's keys: contiguous (page_size 0) or paged, pages shuffled
    (the same values either way: fill[b] is sequence b's (L, Hkv, D) keys and values)."""
    B = len(lengths)
    if not page_size:
        k = _rand(B, capacity, Hkv, D, g=g)
        v = _rand(B, capacity, Hkv, D, g=g)
        for b, (kb, vb) in enumerate(fill):
            k[b, : kb.shape[0]], v[b, : vb.shape[0]] = kb, vb
        return k, v, None
    per_seq = -(-capacity // page_size)
    order = list(range(B * per_seq))
    random.Random(len(lengths)).shuffle(order)
    table = torch.tensor(order, dtype=torch.int32).view(B, per_seq).to(torch.get_default_device())
    k = _rand(B * per_seq, page_size, Hkv, D, g=g)
    v = _rand(B * per_seq, page_size, Hkv, D, g=g)
    for b, (kb, vb) in enumerate(fill):
        for pos in range(kb.shape[0]):
            page = table[b, pos // page_size]
            k[page, pos % page_size], v[page, pos % page_size] = kb[pos], vb[pos]
    return k, v, table


def _decode(q, fill, lengths, capacity, page_size, g, **kw):
    k, v, table = _cache(lengths, capacity, page_size, g, fill)
    seqlens = torch.tensor(lengths, dtype=torch.int32).to(q.device)
    return fusedattn.attention_with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=table,
                                            return_lse=True, backend="triton", **kw)  # fmt: skip


def _batch_case(seed, others, page_size, Tq=1):
    """The target sequence alone, then at a random place among `others` sequences of other
    lengths: its outputs and lse."""
    g = torch.Generator().manual_seed(seed)
    L = 90 + seed
    target = (_rand(L, Hkv, D, g=g), _rand(L, Hkv, D, g=g))
    q_target = _rand(1, Tq, Hq, D, g=g)
    rng = random.Random(seed)
    lengths = [rng.randint(1, 140) for _ in range(others)]
    fills = [(_rand(n, Hkv, D, g=g), _rand(n, Hkv, D, g=g)) for n in lengths]
    at = rng.randint(0, others)
    lengths.insert(at, L)
    fills.insert(at, target)
    qs = _rand(others + 1, Tq, Hq, D, g=g)
    qs[at] = q_target[0]
    kw = dict(is_causal=True, softcap=20.0, sinks=_rand(Hq, g=g))
    alone = _decode(q_target, [target], [L], 144, page_size, g, **kw)
    batch = _decode(qs, fills, lengths, 160 if page_size != 3 else 144, page_size, g, **kw)
    return alone, (batch[0][at : at + 1], batch[1][at : at + 1])


# the paged layouts among the slow tests (make test-fast: the contiguous one)
@pytest.mark.parametrize(
    "page_size", [0, *(pytest.param(n, marks=pytest.mark.slow) for n in (1, 3, 16))]
)
def test_decoding_gives_a_sequence_the_same_bits_in_any_batch_and_layout(invariant, page_size):
    """(a), (b), (d): alone or among 1-31 others, anywhere in the batch; contiguous or paged at
    any page size (and a capacity of other size): the same out and lse, bit for bit. (31
    others on two layouts: a batch of 32 costs the interpreter 15 s.)"""
    cases = ((0, 1), (1, 7)) + (((2, 31),) if page_size in (0, 3) else ())
    for seed, others in cases:
        (out_a, lse_a), (out_b, lse_b) = _batch_case(seed, others, page_size, Tq=2)
        assert torch.equal(out_a, out_b), f"{others} others: out differs"
        assert torch.equal(lse_a, lse_b), f"{others} others: lse differs"
    contiguous = _batch_case(3, 0, 0)[0]
    paged = _batch_case(3, 0, page_size)[0]
    assert torch.equal(contiguous[0], paged[0]) and torch.equal(contiguous[1], paged[1])


def test_the_split_count_following_the_batch_breaks_it_and_num_splits_is_refused(invariant):
    """Mutation check: with the switch off (splits chosen per call from the batch), the same
    comparisons differ somewhere; under it a caller's num_splits is refused before any launch."""
    with fusedattn.batch_invariant(False):
        differ = any(
            not torch.equal(a[0], b[0])
            for a, b in (_batch_case(seed, others, 0) for seed, others in ((0, 1), (1, 7)))
        )
    assert differ, "the comparison cannot tell batch-dependent splits apart"
    q = torch.zeros(1, 1, Hq, D)
    k = torch.zeros(1, 64, Hkv, D)
    with pytest.raises(ValueError, match=r"num_splits=4: fusedattn\.batch_invariant is on"):
        fusedattn.attention_with_kvcache(q, k, k, cache_seqlens=10, num_splits=4)


def test_one_prefill_chunks_and_token_by_token_give_each_query_the_same_bits(invariant):
    """(c): a prompt's causal attention as one packed varlen prefill (with other prompts), as a
    paged prefill in chunks of 5, 17 and the rest with the earlier chunks in the cache, and
    one token at a time through attention_with_kvcache: each query's bits agree."""
    g = torch.Generator().manual_seed(11)
    L = 90
    q, k, v = _rand(L, Hq, D, g=g), _rand(L, Hkv, D, g=g), _rand(L, Hkv, D, g=g)
    other = [_rand(40, h, D, g=g) for h in (Hq, Hkv, Hkv)]
    # one prefill, packed after another prompt
    cu = torch.tensor([0, 40, 40 + L], dtype=torch.int32).to(q.device)
    packed = [torch.cat([o, t]) for o, t in zip(other, (q, k, v), strict=True)]
    # equal prefix sums in two tensors, as vLLM and flash-attn callers pass them (the path was
    # once chosen by identity: another object took the varlen kernel's bits, issue #82)
    whole, whole_lse = fusedattn.varlen_attention(*packed, cu, cu, L, L, is_causal=True,
                                                  enable_gqa=True, return_lse=True)  # fmt: skip
    whole, whole_lse = whole[40:], whole_lse[:, 40:]
    # chunks through a paged cache (page size 8)
    page, pages = 8, -(-L // 8)
    table = torch.arange(pages, dtype=torch.int32).flip(0)[None].to(q.device)
    kc = torch.zeros(pages, page, Hkv, D)
    vc = torch.zeros(pages, page, Hkv, D)
    for pos in range(L):
        kc[table[0, pos // page], pos % page], vc[table[0, pos // page], pos % page] = (
            k[pos],
            v[pos],
        )
    start = 0
    for size in (5, 17, L - 22):
        stop = start + size
        cu_q = torch.tensor([0, size], dtype=torch.int32).to(q.device)
        cu_k = torch.tensor([0, stop], dtype=torch.int32).to(q.device)
        out, lse = fusedattn.varlen_attention(
            q[start:stop], kc, vc, cu_q, cu_k, size, stop, is_causal=True, enable_gqa=True,
            causal_alignment="bottom_right", block_table=table, return_lse=True,
        )  # fmt: skip
        assert torch.equal(out, whole[start:stop]), f"chunk {start}:{stop}"
        assert torch.equal(lse, whole_lse[:, start:stop])
        start = stop
    # token by token, contiguous cache holding every key
    kfull, vfull = k[None], v[None]
    for i in (0, 15, 16, 63, 64, L - 1):
        out, lse = fusedattn.attention_with_kvcache(q[i][None, None], kfull, vfull,
                                                    cache_seqlens=i + 1, is_causal=True,
                                                    return_lse=True)  # fmt: skip
        assert torch.equal(out[0, 0], whole[i]), f"token {i}"
        assert torch.equal(lse[0, :, 0], whole_lse[:, i])


def test_attention_gives_a_batch_row_the_same_bits_alone_and_padded_in_a_batch(invariant):
    """attention(): a sequence alone, and as one row of a right-padded batch with key padding
    among longer ones: its rows' bits agree (one program per batch row, head, query block)."""
    g = torch.Generator().manual_seed(5)
    L, T = 70, 97
    x = [_rand(1, h, L, D, g=g) for h in (Hq, Hkv, Hkv)]
    batch = [_rand(3, h, T, D, g=g) for h in (Hq, Hkv, Hkv)]
    for t, one in zip(batch, x, strict=True):
        t[1, :, :L] = one[0]
    pad = torch.zeros(3, T, dtype=torch.bool)
    pad[1, L:] = True
    kw = dict(is_causal=True, enable_gqa=True, return_lse=True)
    alone, alone_lse = fusedattn.attention(*x, **kw)
    got, got_lse = fusedattn.attention(*batch, key_padding_mask=pad, **kw)
    assert torch.equal(got[1:2, :, :L], alone) and torch.equal(got_lse[1:2, :, :L], alone_lse)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "softmax"])
def test_a_rows_norm_and_softmax_bits_do_not_depend_on_m(invariant, op):
    g = torch.Generator().manual_seed(2)
    N = 200
    rows = _rand(37, N, g=g)
    w, b = _rand(N, g=g), _rand(N, g=g)
    call = {
        "rms_norm": lambda x: fusedattn.rms_norm(x, (N,), w, 1e-6),
        "layer_norm": lambda x: fusedattn.layer_norm(x, (N,), w, b, 1e-5),
        "softmax": lambda x: fusedattn.softmax(x, -1),
    }[op]
    every = call(rows)
    for i in (0, 5, 36):
        assert torch.equal(call(rows[i : i + 1]), every[i : i + 1])
        assert torch.equal(call(rows[i:]), every[i:])


def test_the_switch_refuses_torch_and_cuda_and_auto_takes_triton(invariant):
    q = torch.randn(1, 2, 8, 16)
    for backend in ("torch", "cuda"):
        with pytest.raises(fusedattn.BackendUnavailableError, match="batch_invariant is on"):
            fusedattn.attention(q, q, q, backend=backend)
        with pytest.raises(fusedattn.BackendUnavailableError, match="batch_invariant is on"):
            fusedattn.rms_norm(q, (16,), None, 1e-6, backend=backend)
    want = fusedattn.attention(q, q, q, backend="triton")
    assert torch.equal(fusedattn.attention(q, q, q), want)


def test_the_switch_is_global_a_context_manager_and_an_environment_variable(monkeypatch):
    import subprocess
    import sys

    assert not invariance.enabled()
    with fusedattn.batch_invariant():
        assert invariance.enabled()
        with fusedattn.batch_invariant(False):
            assert not invariance.enabled()
        assert invariance.enabled()
    assert not invariance.enabled()
    fusedattn.batch_invariant(True)
    assert invariance.enabled()
    fusedattn.batch_invariant(False)
    code = "import fusedattn.invariance as i; print(i.enabled())"
    env = {**__import__("os").environ, "FUSEDATTN_BATCH_INVARIANT": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "True", out.stderr
