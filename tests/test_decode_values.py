"""attention_with_kvcache's bad calls write nothing (issue #50, items 2 and 3): a refused call
or an invalid length / left padding / block-table value raises before the append, the caches
bit-identical afterwards, on every backend; and the Triton kernels, which skip the value check
on a GPU (no host sync), never read or write outside the caches, the block table or the
lengths whatever the values (checked under the interpreter with poisoned neighbours)."""

import pytest
import torch
from test_decode import make_cache

import fusedattn
from fusedattn.masks import NO_WINDOW
from fusedattn.ops.decode import api as decode_ops
from fusedattn.ops.decode import reference_backend, triton_backend
from fusedattn.ops.shared import decode_launch

pytest.importorskip("fusedattn.triton_kernels.decode")
ALL_BACKENDS = ["reference", "torch", pytest.param("triton", marks=pytest.mark.kernels)]


def decode_call(dtype=torch.float32, B=2, S=24, Hq=4, Hkv=2, D=8, Tnew=2, paged=False):
    """(q, k_cache, v_cache, k, v, kwargs) of a valid call with an append."""
    q = torch.randn(B, 1, Hq, D).to(dtype)
    kc, vc, bt = make_cache(B, S, Hkv, D, D, dtype, "paged" if paged else "contiguous", 4, 0.0)
    k, v = (torch.randn(B, Tnew, Hkv, D).to(dtype) for _ in range(2))
    kw = dict(cache_seqlens=torch.tensor([5, 11], dtype=torch.int32), block_table=bt)
    return q, kc, vc, k, v, kw


def assert_refused_and_untouched(error, match, q, kc, vc, k, v, **kw):
    before = kc.clone(), vc.clone()
    with pytest.raises(error, match=match):
        fusedattn.attention_with_kvcache(q, kc, vc, k, v, **kw)
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1]), "the cache was written"


REFUSALS = [  # (backend, dtype, head dim, extra keywords, the reason's words)
    ("torch", torch.float32, 8, dict(softcap=2.0), "softcap"),
    ("torch", torch.float32, 8, dict(return_lse=True), "log-sum-exp"),
    ("torch", torch.bfloat16, 8, dict(alibi_slopes=torch.ones(4)), "ALiBi"),
    ("torch", torch.bfloat16, 8, dict(sinks=torch.zeros(4)), "sinks"),
    pytest.param("triton", torch.float64, 8, {}, "float64", marks=pytest.mark.kernels),
    pytest.param("triton", torch.float32, 264, {}, "head dims up to", marks=pytest.mark.kernels),
]


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("backend,dtype,D,extra,match", REFUSALS)
def test_a_refused_call_writes_nothing(backend, dtype, D, extra, match, paged):
    """Every refusal of the chosen backend is decided before the new keys are appended
    (393 of 549 torch refusals and 19 of 40 Triton ones left the cache modified)."""
    q, kc, vc, k, v, kw = decode_call(dtype, D=D, paged=paged)
    assert_refused_and_untouched(fusedattn.BackendUnavailableError, match, q, kc, vc, k, v,
                                 backend=backend, **kw, **extra)  # fmt: skip


def bad_values(paged):
    """(name, keyword overrides, the message's words) of invalid values for decode_call's
    cache of 24 positions per sequence with an append of 2."""
    cases = [
        ("seqlens past the room", dict(cache_seqlens=torch.tensor([5, 23], dtype=torch.int32)),
         r"cache_seqlens\[1\] = 23 is outside \[0, 22\]"),
        ("seqlens far past the capacity", dict(cache_seqlens=torch.tensor([90, 1], dtype=torch.int32)),
         r"cache_seqlens\[0\] = 90"),
        ("seqlens -1", dict(cache_seqlens=torch.tensor([5, -1], dtype=torch.int32)),
         r"cache_seqlens\[1\] = -1"),
        ("leftpad -1", dict(cache_leftpad=torch.tensor([-1, 0], dtype=torch.int32)),
         r"cache_leftpad\[0\] = -1"),
        ("leftpad past the keys", dict(cache_leftpad=torch.tensor([0, 14], dtype=torch.int32)),
         r"cache_leftpad\[1\] = 14 is outside \[0, cache_seqlens\[1\] \+ Tnew\] = \[0, 13\]"),
    ]  # fmt: skip
    if paged:  # "pages": the cache's page count, one past the last page
        for value in (-1, "pages", 2**30):
            cases.append((f"page {value}", dict(page=(1, 2, value)), r"block_table\[1, 2\] = "))
    return cases


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_invalid_values_raise_before_anything_is_written(backend, paged, kernel_device,
                                                        monkeypatch):  # fmt: skip
    """cache_seqlens outside [0, capacity - Tnew], cache_leftpad outside [0, cache_seqlens +
    Tnew], a block-table entry outside [0, num_pages) for a page the sequence uses: a
    ValueError on the CPU whatever the backend, the caches bit-identical (before: accepted
    and different answers per backend, a wrapped write into the last slot, a partial write
    then IndexError, a page clamped to the last one, a SIGSEGV in the Triton interpreter).
    On a GPU the Triton kernels check the values only when FUSEDATTN_CHECK_VALUES=1 asks
    (no host sync by default; the unchecked run is the last test of this file)."""
    monkeypatch.setenv(decode_ops.CHECK_VALUES_ENV, "1")
    for name, bad, match in bad_values(paged):
        q, kc, vc, k, v, kw = decode_call(paged=paged)
        if "page" in bad:
            b, p, value = bad.pop("page")
            kw["block_table"][b, p] = kc.shape[0] if value == "pages" else value
            match += str(int(kw["block_table"][b, p]))
        kw |= bad
        assert_refused_and_untouched(ValueError, match, q, kc, vc, k, v, backend=backend, **kw)
        before = kc.clone()  # the reference's public twin checks the same values
        with pytest.raises(ValueError, match=match):
            fusedattn.reference.attention_with_kvcache(q, kc, vc, k, v, **kw)
        assert torch.equal(kc, before), name


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_the_value_checks_read_on_the_host_whatever_the_default_device(backend, kernel_device,
                                                                      monkeypatch):  # fmt: skip
    """A paged call while the default device is another one (a GPU user's
    torch.set_default_device("cuda") with the tensors elsewhere; "meta" stands in for it on
    the CPU): the checks build their host tensors beside the values they read. Found on the
    H200: the block-table check's page index followed the default device, and every paged
    call under torch.device("cuda") failed with "Expected all tensors to be on the same
    device" while the tensors were copied to the host. The Triton kernels on a GPU check only
    when asked (FUSEDATTN_CHECK_VALUES=1): asked here."""
    monkeypatch.setenv(decode_ops.CHECK_VALUES_ENV, "1")
    q, kc, vc, k, v, kw = decode_call(paged=True)
    want = fusedattn.attention_with_kvcache(q, kc.clone(), vc.clone(), k, v, backend=backend,
                                            **kw)  # fmt: skip
    with torch.device("meta"):
        got = fusedattn.attention_with_kvcache(q, kc.clone(), vc.clone(), k, v,
                                               backend=backend, **kw)  # fmt: skip
    assert got.device == q.device and torch.equal(got, want)


def test_a_page_past_the_sequence_is_not_checked():
    """Only the pages a sequence reads or writes are checked: a table row may hold anything
    past them (engines leave unused entries unset)."""
    q, kc, vc, k, v, kw = decode_call(paged=True)
    kw["block_table"][0, 3:] = -7  # sequence 0: 5 + 2 keys, pages 0 and 1 of 4 slots
    fusedattn.attention_with_kvcache(q, kc, vc, k, v, backend="reference", **kw)


def test_the_value_check_switch():
    """On a GPU the Triton path reads no value to the host unless FUSEDATTN_CHECK_VALUES=1;
    the CPU and the torch / reference backends always check."""
    env = decode_ops.CHECK_VALUES_ENV
    assert decode_ops.values_checked(False, "triton", {})
    assert decode_ops.values_checked(True, "torch", {})
    assert decode_ops.values_checked(True, "reference", {})
    assert not decode_ops.values_checked(True, "triton", {})
    assert decode_ops.values_checked(True, "triton", {env: "1"})
    assert not decode_ops.values_checked(True, "triton", {env: "0"})


# ---- the Triton kernels with invalid values: nothing outside their tensors is touched --------


def guarded_case(paged: bool, page_size: int = 4):
    """Caches and a block table that are views into larger buffers whose outside is poison:
    NaN rows and slots around a contiguous cache; NaN pages before and after a paged cache,
    and one NaN page inside it that no sequence owns and that the block table's neighbours
    (the entries around its rows) name. A read outside a tensor shows as NaN in the output, a
    write as a changed neighbour. Returns (q, k_cache, v_cache, block_table, (the buffers),
    the NaN page inside the cache or None)."""
    B, S, Hkv, D = 2, 16, 2, 16
    g = torch.Generator().manual_seed(0)
    device = torch.get_default_device()  # a GPU's grid runs this on the GPU
    with torch.device("cpu"):  # made on the CPU (its generator), then moved
        return _guarded(B, S, Hkv, D, g, paged, page_size, device)


def _guarded(B, S, Hkv, D, g, paged, page_size, device):
    poison = table = None
    if paged:
        pages = B * S // page_size + 1  # the sequences' pages and the NaN page
        poison = pages // 2
        big_k = torch.randn(pages + 2, page_size, Hkv, D, generator=g)
        big_v = torch.randn(pages + 2, page_size, Hkv, D, generator=g)
        for i in (0, 1 + poison, pages + 1):
            big_k[i], big_v[i] = float("nan"), float("nan")
        kc, vc = big_k[1:-1], big_v[1:-1]
        owned = torch.tensor([p for p in range(pages) if p != poison], dtype=torch.int32)
        table = torch.full((B + 2, S // page_size + 2), poison, dtype=torch.int32)
        table[1:-1, 1:-1] = owned[torch.randperm(pages - 1, generator=g)].view(B, -1)
        bt = table[1:-1, 1:-1]
    else:
        big_k = torch.full((B + 1, S + 8, Hkv, D), float("nan"))
        big_v = torch.full((B + 1, S + 8, Hkv, D), float("nan"))
        big_k[:B, 4 : 4 + S] = torch.randn(B, S, Hkv, D, generator=g)
        big_v[:B, 4 : 4 + S] = torch.randn(B, S, Hkv, D, generator=g)
        kc, vc = big_k[:B, 4 : 4 + S], big_v[:B, 4 : 4 + S]
        bt = None
    q = torch.randn(B, 1, 4, D, generator=g)
    q, big_k, big_v = (t.to(device) for t in (q, big_k, big_v))
    if paged:  # the views again, into the moved buffers (the table's neighbours kept)
        kc, vc = big_k[1:-1], big_v[1:-1]
        bt = table.to(device)[1:-1, 1:-1]
    else:
        kc, vc = big_k[:B, 4 : 4 + S], big_v[:B, 4 : 4 + S]
    return q, kc, vc, bt, (big_k, big_v), poison


def run_triton_unchecked(q, kc, vc, bt, seqlens, leftpad=None, num_splits=2):
    """The Triton backend as a GPU runs it: no value check in front."""
    window = NO_WINDOW
    seq = torch.tensor(seqlens, dtype=torch.int32)
    lp = None if leftpad is None else torch.tensor(leftpad, dtype=torch.int32)
    return triton_backend.attention(q, kc, vc, seq, bt, lp, None, None, window, 0.0, None, None,
                              num_splits, True)  # fmt: skip


BAD_VALUES = [  # (cache_seqlens, cache_leftpad, a block-table entry to spoil: (b, p, value))
    ([16, 40], None, None),  # past the capacity: the row's table would be read past its end
    ([2**30, 5], None, None),
    ([-1, -(2**30)], None, None),
    ([10, 12], [-3, 20], None),  # leftpad before 0, and past the sequence's end
    ([16, 16], None, (0, 1, -1)),
    ([16, 16], None, (1, 2, 2**30)),
    ([16, 9], None, (1, 0, 9999)),
    ([16, 40], None, (0, 3, -(2**31))),
]


def with_layouts(cases):
    """Each case with a contiguous and a paged cache; a spoilt block-table entry paged only."""
    return [
        (paged, *case) for case in cases for paged in (False, True) if paged or case[-1] is None
    ]


@pytest.mark.usefixtures("kernel_device")
@pytest.mark.kernels
@pytest.mark.parametrize("paged,seqlens,leftpad,spoil", with_layouts(BAD_VALUES))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_the_decode_kernel_reads_nothing_outside_its_tensors(paged, seqlens, leftpad, spoil,
                                                             num_splits):  # fmt: skip
    """Whatever the values, the output is finite (no poison reached it) and equals the
    reference's over the values clamped into range, as the kernel reads them: lengths to
    [0, capacity], leftpad to [0, length], a block-table entry to [0, num_pages)."""
    q, kc, vc, bt, _, poison = guarded_case(paged)
    if spoil is not None:
        b, p, value = spoil
        bt[b, p] = value
    out, _ = run_triton_unchecked(q, kc, vc, bt, seqlens, leftpad, num_splits)
    assert torch.isfinite(out).all()
    capacity = kc.shape[1] if bt is None else bt.shape[1] * kc.shape[1]
    ends = [min(max(s, 0), capacity) for s in seqlens]
    starts = (
        [0] * 2
        if leftpad is None
        else [min(max(p, 0), e) for p, e in zip(leftpad, ends, strict=True)]
    )
    clamped = None if bt is None else bt.clamp(0, kc.shape[0] - 1)
    assert clamped is None or not (clamped == poison).any()  # a clamped entry is a real page
    want = reference_backend.attention(
        q.double(), kc.double(), vc.double(), torch.tensor(ends, dtype=torch.int32), clamped,
        torch.tensor(starts, dtype=torch.int32), None, None, NO_WINDOW, 0.0, None, None, 0, True,
    )  # fmt: skip
    torch.testing.assert_close(out.double(), want[0], rtol=1e-4, atol=1e-4)


APPEND_BAD_VALUES = [  # (cache_seqlens, a block-table entry to spoil)
    ([15, 2**30], None),
    ([-2, -(2**30)], None),
    ([14, 3], (1, 0, -1)),
    ([2, 14], (1, 3, 77)),
]


@pytest.mark.usefixtures("kernel_device")
@pytest.mark.kernels
@pytest.mark.parametrize("paged,seqlens,spoil", with_layouts(APPEND_BAD_VALUES))
def test_the_append_kernel_writes_nothing_outside_the_cache(paged, seqlens, spoil):
    """Positions outside [0, capacity) and pages outside the cache are dropped, never
    written elsewhere: every element of the larger buffers but the valid new positions keeps
    its bits (NaN poison included)."""
    _, kc, vc, bt, (big_k, big_v), _ = guarded_case(paged)
    if spoil is not None:
        b, p, value = spoil
        bt[b, p] = value
    Tnew = 3
    k, v = torch.randn(2, Tnew, 2, 16), torch.randn(2, Tnew, 2, 16)
    seq = torch.tensor(seqlens, dtype=torch.int32)
    want_k, want_v = big_k.clone(), big_v.clone()
    cache_of = (lambda t: t[1:-1]) if paged else (lambda t: t[:2, 4:-4])  # as guarded_case
    capacity = kc.shape[1] if bt is None else bt.shape[1] * kc.shape[1]
    for b in range(2):  # the valid positions only
        for t in range(Tnew):
            pos = seqlens[b] + t
            if not 0 <= pos < capacity:
                continue
            row, slot = (b, pos) if bt is None else (int(bt[b, pos // 4]), pos % 4)
            if 0 <= row < kc.shape[0]:
                cache_of(want_k)[row, slot], cache_of(want_v)[row, slot] = k[b, t], v[b, t]
    decode_launch.append(kc, vc, k, v, seq, bt, kernel=True)
    assert torch.equal(big_k.isnan(), want_k.isnan()) and torch.equal(big_v.isnan(), want_v.isnan())
    assert torch.equal(big_k.nan_to_num(), want_k.nan_to_num())
    assert torch.equal(big_v.nan_to_num(), want_v.nan_to_num())


@pytest.mark.gpu
@pytest.mark.usefixtures("kernel_device")
def test_on_a_gpu_bad_values_run_unchecked_and_the_switch_checks_them(monkeypatch):
    """No sync by default: a length past the capacity runs (clamped; the process's CUDA
    context survives, as the synchronize after it shows); FUSEDATTN_CHECK_VALUES=1 raises
    the CPU's ValueError and writes nothing."""
    q, kc, vc, k, v, kw = decode_call(paged=True)
    kw["cache_seqlens"] = torch.tensor([5, 2**30], dtype=torch.int32)
    out = fusedattn.attention_with_kvcache(q, kc, vc, k, v, backend="triton", **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    monkeypatch.setenv(decode_ops.CHECK_VALUES_ENV, "1")
    assert_refused_and_untouched(ValueError, r"cache_seqlens\[1\]", q, kc, vc, k, v,
                                 backend="triton", **kw)  # fmt: skip
