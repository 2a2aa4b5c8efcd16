"""Plans of the eager calls (ops/core/plans.py; attention_with_kvcache's in test_decode_plan.py): a
call of known metadata skips validation, dispatch and launch preparation, and must give what
the full path gives, forward and backward, with each call's own masks, padding and dropout
seed; a wrapped or re-registered backend implementation is what runs."""

import pytest
import torch
from dispatch_probe import count_dispatches

import fusedattn
from fusedattn.ops.attention import plans as attention_plans
from fusedattn.ops.core import plans
from fusedattn.ops.rowwise import plans as rowwise_plans

BACKENDS = ["reference", "torch", pytest.param("triton", marks=pytest.mark.kernels)]


@pytest.fixture(autouse=True)
def no_plans():
    caches = (
        attention_plans.PLANS,
        rowwise_plans.LAYER_NORM,
        rowwise_plans.RMS_NORM,
        rowwise_plans.SOFTMAX,
    )
    for cache in caches:
        cache.clear()
    yield
    for cache in caches:
        cache.clear()


def attention_call(seed, backend, **kw):
    """One call's fresh tensors (the same metadata for every seed) and its outputs and grads."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 4, 9, 16, generator=g).requires_grad_() for _ in range(3))
    kpm = torch.rand(2, 9, generator=g) < 0.3
    kpm[:, 0] = False
    mask = torch.randn(9, 9, generator=g)
    args = dict(key_padding_mask=kpm, **kw)
    if args.pop("float_mask", False):
        args["attn_mask"] = mask
    torch.manual_seed(seed)  # dropout's stream
    out = fusedattn.attention(q, k, v, backend=backend, **args)
    grads = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape, generator=g))
    return out, grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "variant",
    [dict(is_causal=True), dict(float_mask=True, window_size=(3, 0)),
     dict(sinks=torch.randn(4), causal_alignment="bottom_right", is_causal=True)],
    ids=["causal", "float_mask_window", "sinks"],
)  # fmt: skip
def test_planned_attention_calls_equal_the_full_path(backend, variant):
    """Three steps of one metadata with new values (padding, mask) each time: the planned
    calls give the full path's bits, forward and gradients."""
    for seed in range(3):
        planned = attention_call(seed, backend, **dict(variant))
        assert len(attention_plans.PLANS.plans) == 1
        attention_plans.PLANS.clear()
        full = attention_call(seed, backend, **dict(variant))
        assert torch.equal(planned[0], full[0])
        for a, b in zip(planned[1], full[1], strict=True):
            assert torch.equal(a, b)


@pytest.mark.kernels
def test_a_planned_triton_call_with_dropout_draws_each_calls_seed():
    outs = [attention_call(seed, "triton", dropout_p=0.3)[0] for seed in (0, 1, 0)]
    assert not torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.kernels
def test_the_backward_of_a_plan_follows_the_output_gradients_layout():
    """The output gradient is the one tensor a plan's key does not see: its strides name the
    bound backward launchers, so a transposed gradient after a contiguous one is read right."""
    q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
    dense = torch.randn(1, 2, 8, 16)
    transposed = dense.transpose(1, 2).contiguous().transpose(1, 2)
    grads = []
    for do in (dense, transposed, dense):
        out = fusedattn.attention(q, k, v, backend="triton")
        grads.append(torch.autograd.grad(out, (q, k, v), do))
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[2], strict=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_planned_norms_and_softmax_equal_the_full_path(backend):
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(40, generator=g), torch.randn(40, generator=g)
    keep = torch.rand(7, 40, generator=g) > 0.2
    ops = {
        "layer_norm": lambda x: fusedattn.layer_norm(x, (40,), w, b, backend=backend),
        "rms_norm": lambda x: fusedattn.rms_norm(x, 40, w, backend=backend),
        "softmax": lambda x: fusedattn.softmax(x, -1, mask=keep, scale=0.5, backend=backend),
        "softmax_dim0": lambda x: fusedattn.softmax(x.t(), 0, backend=backend),
    }
    for name, op in ops.items():
        for grad in (False, True):
            xs = [torch.randn(7, 40, generator=g).requires_grad_(grad) for _ in range(3)]
            for x in xs:
                with torch.set_grad_enabled(grad):
                    planned = op(x)
                for cache in (
                    rowwise_plans.LAYER_NORM,
                    rowwise_plans.RMS_NORM,
                    rowwise_plans.SOFTMAX,
                ):
                    cache.clear()
                with torch.set_grad_enabled(grad):
                    full = op(x)
                assert torch.equal(planned, full), (name, grad)


def test_a_wrapped_implementation_is_what_runs():
    """count_dispatches wraps every registered implementation: plans made before it are not
    used inside it (its counts see every call), nor its own after it."""
    q = torch.randn(1, 2, 8, 16)
    x = torch.randn(4, 32)
    for _ in range(2):
        fusedattn.attention(q, q, q)
        fusedattn.layer_norm(x, 32)
    with count_dispatches() as counts:
        for _ in range(3):
            fusedattn.attention(q, q, q)
            fusedattn.layer_norm(x, 32)
    assert counts[("attention", "torch")] == 3 and counts[("layer_norm", "torch")] == 3
    fusedattn.attention(q, q, q)  # the registry restored: the wrapper's plan is not used


def test_bypassed_plans_send_every_call_through_select(monkeypatch):
    """Inside plans.bypassed() every call of every planned op reaches backends.select (what
    scripts/profile_model.py counts), and no plan is made; after it plans serve again."""
    from fusedattn.ops.core import backends

    q = torch.randn(1, 2, 8, 16)
    x = torch.randn(4, 32)
    k_cache = torch.zeros(1, 16, 2, 16)
    lens = torch.tensor([4], dtype=torch.int32)
    calls = {
        "attention": lambda: fusedattn.attention(q, q, q),
        "layer_norm": lambda: fusedattn.layer_norm(x, 32),
        "rms_norm": lambda: fusedattn.rms_norm(x, 32),
        "softmax": lambda: fusedattn.softmax(x, -1),
        "attention_with_kvcache": lambda: fusedattn.attention_with_kvcache(
            q[:, :, :1].transpose(1, 2), k_cache, k_cache, cache_seqlens=lens
        ),
    }
    selected = []
    select = backends.select

    def recording(op, backend, device, inputs):
        selected.append(op)
        return select(op, backend, device, inputs)

    for call in calls.values():  # plans made for every op
        call(), call()
    monkeypatch.setattr(backends, "select", recording)
    for call in calls.values():
        call()
    assert selected == [], "planned calls skip select"
    with plans.bypassed():
        for call in calls.values():
            call(), call()
    assert sorted(selected) == sorted(2 * list(calls)), selected


# ---- block-mask and score_mod calls (plans.FlexPlan) -----------------------------------------


def flex_call(seed, variant, **kw):
    """One block-mask / score_mod call of fixed metadata with new values each seed: a new
    mask object (its window, hence its partial blocks, differs; lopsided, so that its two
    orientations differ), a new learnable table, new q, k, v. -> ((out, lse or None), grads
    of q, k, v and the table)."""
    g = torch.Generator().manual_seed(seed)
    T = 40
    q, k, v = (torch.randn(1, 2, T, 16, generator=g).requires_grad_() for _ in range(3))
    table = torch.randn(2, 2 * T - 1, generator=g).requires_grad_()
    args = dict(kw)
    if variant in ("mask", "both"):
        width = 3 + 7 * seed
        args["block_mask"] = fusedattn.masks.create_block_mask(
            lambda b, h, i, j: (i - j <= width) & (j - i <= 5), None, None, T, T, device="cpu",
            BLOCK_SIZE=16,
        )  # fmt: skip
    if variant in ("mod", "both"):

        def relative(score, b, h, q_idx, kv_idx):
            return score + table[h, q_idx - kv_idx + T - 1]

        args["score_mod"] = relative
    if args.pop("float_mask", False):
        args["attn_mask"] = torch.randn(T, T, generator=g)
    torch.manual_seed(seed)  # dropout's stream
    out = fusedattn.attention(q, k, v, backend="triton", **args)
    lse = None
    if isinstance(out, tuple):
        out, lse = out
    loss = (out * torch.randn(out.shape, generator=g)).sum()
    if lse is not None:
        loss = loss + (lse * torch.randn(lse.shape, generator=g)).sum()
    leaves = (q, k, v, table) if variant != "mask" else (q, k, v)
    return (out, lse), torch.autograd.grad(loss, leaves)


@pytest.mark.kernels
@pytest.mark.parametrize(
    "variant, kw",
    [pytest.param("mask", dict(key_padding_mask=None), marks=pytest.mark.slow),
     ("mod", dict(float_mask=True, return_lse=True)),  # the one in make test-fast (4 s)
     pytest.param("both", dict(is_causal=True, dropout_p=0.2, return_lse=True),
                  marks=pytest.mark.slow)],
    ids=["block_mask", "score_mod_float_mask_lse", "both_causal_dropout_lse"],
)  # fmt: skip
def test_planned_flex_calls_equal_the_full_path(variant, kw):
    """Two steps through one plan after the call that made it, each with a new mask object
    (other partial blocks), a new learnable table and new inputs: the planned calls (the
    kernels handed each call's lists and captures; a launcher that kept its first values
    fails the second step) give the full path's bits, forward, lse and every gradient (the
    table's by the dq kernel's atomics)."""
    flex_call(0, variant, **kw)  # makes the plan
    planned = [flex_call(seed, variant, **kw) for seed in (1, 2)]
    assert len(attention_plans.PLANS.plans) == 1
    with plans.bypassed():
        full = [flex_call(seed, variant, **kw) for seed in (1, 2)]
    for p, f in zip(planned, full, strict=True):
        for a, b in zip((*p[0], *p[1]), (*f[0], *f[1]), strict=True):
            assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.kernels
def test_a_flex_plan_skips_the_checks_and_is_keyed_on_what_it_decides(monkeypatch):
    """A planned call runs no argument check and no backend selection; a capture of another
    layout, grad mode, or a block mask beside an attn_mask (merged densely each call) is not
    served by it."""
    from fusedattn.ops.attention import api

    T = 32
    q = torch.randn(1, 2, T, 16)
    table = torch.randn(2, 2 * T)
    mask = fusedattn.masks.create_block_mask(lambda b, h, i, j: i >= j, None, None, T, T,
                                             device="cpu", BLOCK_SIZE=16)  # fmt: skip

    def mod_over(t):
        return lambda s, b, h, i, j: s * t[h, i - j + T]

    def call(t=table, **kw):
        return fusedattn.attention(q, q, q, score_mod=mod_over(t), block_mask=mask,
                                   backend="triton", **kw)  # fmt: skip

    call()
    checked = []
    check = api._checked_inputs
    monkeypatch.setattr(api, "_checked_inputs", lambda *a, **k: checked.append(1) or check(*a, **k))
    expected = call(torch.randn(2, 2 * T))
    assert checked == [] and len(attention_plans.PLANS.plans) == 1
    call(table.t().contiguous().t())  # the capture's strides: a new plan
    call(table.requires_grad_())  # requires_grad: a new plan
    assert len(checked) == 2 and len(attention_plans.PLANS.plans) == 3
    call(attn_mask=torch.ones(T, T, dtype=torch.bool))  # with a block mask: never planned
    call(attn_mask=torch.ones(T, T, dtype=torch.bool))
    assert len(checked) == 4 and len(attention_plans.PLANS.plans) == 3
    assert expected.shape == q.shape


@pytest.mark.kernels
def test_a_flex_plan_made_without_determinism_does_not_serve_it():
    """The captures' gradient refusal under torch.use_deterministic_algorithms(True) is a
    decision of the key's: a plan made before the switch does not let a many-term capture
    through after it."""
    T = 16
    q = torch.randn(1, 2, T, 16, requires_grad=True)
    table = torch.randn(2 * T, requires_grad=True)

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx + T]  # each entry: many (q, kv) terms

    for _ in range(2):
        fusedattn.attention(q, q, q, score_mod=relative, backend="triton").sum().backward()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(ValueError, match="use_deterministic_algorithms"):
            fusedattn.attention(q, q, q, score_mod=relative, backend="triton")
    finally:
        torch.use_deterministic_algorithms(previous)


@pytest.mark.kernels
def test_a_flex_plans_backward_follows_which_captures_want_a_gradient():
    """One plan's backwards asked for different leaves (with and without the learnable
    table, whose gradient the dq kernel adds whenever it requires grad): each as the full
    path's."""
    T = 24
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, T, 16, generator=g).requires_grad_() for _ in range(3))
    table = torch.randn(2, 2 * T, generator=g).requires_grad_()

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + T]

    def grads(leaves):
        out = fusedattn.attention(q, k, v, score_mod=relative, backend="triton")
        return torch.autograd.grad(out.pow(2).sum(), leaves)

    planned = [grads(leaves) for leaves in ((q,), (q, table), (k, v), (table,))]
    assert len(attention_plans.PLANS.plans) == 1
    with plans.bypassed():
        full = [grads(leaves) for leaves in ((q,), (q, table), (k, v), (table,))]
    for p, f in zip(planned, full, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(p, f, strict=True))
