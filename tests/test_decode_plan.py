"""attention_with_kvcache's plans (ops/decode_plan.py): a call of known metadata skips the
validation and the launch preparation, and must still give what the full path gives, refuse
what it refuses, and check what it checks."""

import pytest
import torch
from test_decode import make_cache

import fusedattn
from fusedattn.ops import decode_plan

BACKENDS = ["reference", "torch", pytest.param("triton", marks=pytest.mark.kernels)]


@pytest.fixture(autouse=True)
def no_plans():
    decode_plan.PLANS.clear()
    yield
    decode_plan.PLANS.clear()


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
