"""attention_with_kvcache's plans (ops/decode_plan.py): a call of known metadata skips the
validation and the launch preparation, and must still give what the full path gives, refuse
what it refuses, and check what it checks."""

import pytest
import torch
from test_decode import make_cache

import fusedattn
from fusedattn.ops.decode import plans as decode_plan

BACKENDS = ["reference", "torch", pytest.param("triton", marks=pytest.mark.kernels)]


@pytest.fixture(autouse=True)
def no_plans():
    decode_plan.PLANS.clear()
    decode_plan.MASKED.clear()
    yield
    decode_plan.PLANS.clear()
    decode_plan.MASKED.clear()


def step_inputs(seed, paged=False):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 2, 4, 16, generator=g)
    k, v = torch.randn(2, 1, 2, 16, generator=g), torch.randn(2, 1, 2, 16, generator=g)
    lengths = torch.randint(3, 40, (2,), generator=g, dtype=torch.int32)
    return q, k, v, lengths


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["contiguous", "hf", "paged"])
def test_a_planned_call_equals_the_full_path(backend, layout):
    """Steps of one metadata with new values each time: the planned calls (every call but the
    first) give the bits of the full path run with no plan, and write the same caches."""
    planned_caches = make_cache(2, 48, 2, 16, 16, torch.float32, layout, 8, fill=0.0)
    fresh_caches = tuple(t.clone() if t is not None else None for t in planned_caches)
    kw = dict(block_table=planned_caches[2], is_causal=True, window_size=(20, 0),
              sinks=torch.randn(4), return_lse=backend != "torch", backend=backend)  # fmt: skip
    for step in range(4):
        q, k, v, lengths = step_inputs(step)
        got = fusedattn.attention_with_kvcache(q, *planned_caches[:2], k, v,
                                               cache_seqlens=lengths, **kw)  # fmt: skip
        assert (len(decode_plan.PLANS.plans) == 1) and step >= 0
        decode_plan.PLANS.clear()  # the full path for the same call
        want = fusedattn.attention_with_kvcache(q, *fresh_caches[:2], k, v, cache_seqlens=lengths,
                                                **kw)  # fmt: skip
        for a, b in zip(got if isinstance(got, tuple) else (got,),
                        want if isinstance(want, tuple) else (want,), strict=True):  # fmt: skip
            assert torch.equal(a, b), step
        assert torch.equal(planned_caches[0], fresh_caches[0])
        assert torch.equal(planned_caches[1], fresh_caches[1])


def test_an_int_cache_seqlens_is_part_of_the_key():
    q = step_inputs(0)[0]
    kc, vc = torch.randn(2, 48, 2, 16), torch.randn(2, 48, 2, 16)
    a = fusedattn.attention_with_kvcache(q, kc, vc, cache_seqlens=10)
    b = fusedattn.attention_with_kvcache(q, kc, vc, cache_seqlens=30)
    assert len(decode_plan.PLANS.plans) == 2 and not torch.equal(a, b)
    decode_plan.PLANS.clear()
    torch.testing.assert_close(fusedattn.attention_with_kvcache(q, kc, vc, cache_seqlens=30), b)


def test_a_planned_call_still_refuses_what_the_full_path_refuses():
    """Grad mode and requires_grad are in the key: a call planned under no_grad with sinks
    that require grad is refused once grad mode is on (inference only)."""
    q, k, v, lengths = step_inputs(0)
    kc, vc = torch.randn(2, 48, 2, 16), torch.randn(2, 48, 2, 16)
    sinks = torch.zeros(4, requires_grad=True)
    with torch.no_grad():
        fusedattn.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lengths, sinks=sinks)
    with pytest.raises(ValueError, match="inference only"):
        fusedattn.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lengths, sinks=sinks)
    with pytest.raises(TypeError, match="must have the dtype"):  # a new key: validated
        fusedattn.attention_with_kvcache(q.double(), kc, vc, cache_seqlens=lengths)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_planned_call_still_checks_the_values(backend):
    q, k, v, lengths = step_inputs(0)
    kc, vc = torch.randn(2, 48, 2, 16), torch.randn(2, 48, 2, 16)
    with torch.no_grad():
        fusedattn.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=lengths, backend=backend)
        before = kc.clone()
        with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 48 is outside \[0, 47\]"):
            fusedattn.attention_with_kvcache(q, kc, vc, k, v, backend=backend,
                                             cache_seqlens=torch.tensor([3, 48], dtype=torch.int32))  # fmt: skip
    assert torch.equal(kc, before) and len(decode_plan.PLANS.plans) == 1


def test_strides_and_alignment_are_part_of_the_key():
    """The same shapes through another layout (a transposed cache) or an offset view (another
    16-byte alignment, which Triton specialises on) make a new plan, never reuse one."""
    q, _, _, lengths = step_inputs(0)
    kc = torch.randn(2, 48, 2, 16)
    fusedattn.attention_with_kvcache(q, kc, kc, cache_seqlens=lengths)
    hf = kc.transpose(1, 2).contiguous().transpose(1, 2)
    fusedattn.attention_with_kvcache(q, hf, hf, cache_seqlens=lengths)
    shifted = torch.randn(2 * 48 * 2 * 16 + 1)[1:].view(2, 48, 2, 16)
    fusedattn.attention_with_kvcache(q, shifted, shifted, cache_seqlens=lengths)
    assert len(decode_plan.PLANS.plans) == 3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "padding mask"])
def test_the_hugging_face_decode_step_is_planned(backend, masked):
    """The Hugging Face integration's decode step (decode_with_key_mask, over its (B, Hkv, S,
    D) cache read in place): steps of one metadata run one plan (issue #59: a padded step ran
    seven device ops and the whole validation outside any plan), each with its own mask's
    bounds and holes, giving the bits of the full path and the reference's answer."""
    from fusedattn import reference
    from fusedattn.ops.decode.api import decode_with_key_mask

    g = torch.Generator().manual_seed(0)
    S = 24
    cache_k = torch.randn(2, 2, S, 16, generator=g).transpose(1, 2)  # HF's cache, in place
    cache_v = torch.randn(2, 2, S, 16, generator=g).transpose(1, 2)
    sinks = torch.randn(4, generator=g)
    for step in range(3):
        q = torch.randn(2, 1, 4, 16, generator=g)
        key_mask = None
        if masked:  # left padding, a hole, and unfilled slots at the end, other each step
            key_mask = torch.zeros(2, S, dtype=torch.bool)
            key_mask[0, 2 + step : 15 + step] = True
            key_mask[1, : 9 + step] = True
            key_mask[1, 4] = False
        kw = dict(is_causal=True, sinks=sinks, backend=backend)
        got = decode_with_key_mask(q, cache_k, cache_v, key_mask, **kw)
        assert len(decode_plan.MASKED.plans) == 1
        decode_plan.MASKED.clear()
        want = decode_with_key_mask(q, cache_k, cache_v, key_mask, **kw)  # the full path
        assert torch.equal(got, want), step
        visible = torch.ones(2, S, dtype=torch.bool) if key_mask is None else key_mask
        for b in range(2):
            keys = visible[b].nonzero().flatten()
            truth = reference.attention(
                q[b : b + 1].transpose(1, 2).double(), cache_k[b : b + 1, keys].transpose(1, 2).double(),
                cache_v[b : b + 1, keys].transpose(1, 2).double(), sinks=sinks.double(),
                enable_gqa=True,
            )  # fmt: skip
            torch.testing.assert_close(got[b : b + 1].double(), truth.transpose(1, 2), atol=2e-6,
                                       rtol=2e-6)  # fmt: skip
