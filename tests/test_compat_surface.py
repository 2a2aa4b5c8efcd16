"""flash-attn compatibility that real code can switch to (issue #50 item 6): `install()` so
unmodified code imports fusedattn, the packed functions, `bert_padding`, `layers.rotary`,
rotary and cache_batch_idx in `flash_attn_with_kvcache`, 0-dim max_seqlen tensors, grad mode
in `flash_attn_with_kvcache`, flash-attention's lse for rows that see no key, and
transformers' own flash-attention path on these functions. Every result against float64
attention. The "third-party" modules below are written here from flash-attention's documented
API (its docstrings), in the three styles found in the wild: an inference engine with paged
caches, a hybrid model's attention layer decoding with rotary, a diffusion transformer
calling flash_attn_func on permuted, non-contiguous inputs."""

import math
import sys
import textwrap

import pytest
import torch

import fusedattn.compat.flash_attn as compat
from fusedattn import reference
from fusedattn.testing import assert_close_kx


@pytest.fixture
def installed():
    compat.install()
    yield
    compat.uninstall()
    for name in [n for n in sys.modules if n == "user_code" or n.startswith("user_code.")]:
        del sys.modules[name]


def run_user_code(source: str) -> dict:
    """Execute `source` (which imports flash_attn, unedited) and return its namespace."""
    namespace = {}
    exec(compile(textwrap.dedent(source), "user_code.py", "exec"), namespace)
    return namespace


def attention64(q, k, v, causal=False, window=(-1, -1), scale=None, dtype=torch.float64):
    """float64 attention (or the same naive computation in `dtype`: the k× rule's baseline),
    (B, T, H, D) layout, bottom-right as flash-attention, GQA."""
    rep = q.shape[2] // k.shape[2]
    q, k, v = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    w = None if tuple(window) == (-1, -1) else tuple(window)
    out = reference.attention(q, k, v, is_causal=causal, window_size=w, scale=scale,
                              causal_alignment="bottom_right")  # fmt: skip
    return out.transpose(1, 2)


def assert_kx(got, q, k, v, **kw):
    """got against float64 attention under the k× rule (DESIGN.md), the baseline the same
    naive computation in the inputs' dtype."""
    want = attention64(q, k, v, **kw)
    base = attention64(q, k, v, dtype=q.dtype, **kw)
    assert_close_kx(got, want, base)


def rotate64(x, positions, base=10000.0, interleaved=False, rotary_dim=None):
    """Rotary embedding in float64 from its definition (complex multiplication by e^{i p w})."""
    D = x.shape[-1]
    rd = D if rotary_dim is None else rotary_dim
    freq = 1.0 / base ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    angle = positions.double()[..., None] * freq  # (..., rd / 2)
    xr = x[..., :rd].double()
    if interleaved:
        pairs = torch.complex(xr[..., 0::2], xr[..., 1::2])
    else:
        pairs = torch.complex(xr[..., : rd // 2], xr[..., rd // 2 :])
    rot = pairs * torch.polar(torch.ones_like(angle), angle)  # positions per (…, head)
    if interleaved:
        out = torch.stack((rot.real, rot.imag), -1).flatten(-2)
    else:
        out = torch.cat((rot.real, rot.imag), -1)
    return torch.cat((out, x[..., rd:].double()), -1)


def tables(seqlen, rd, base=10000.0, dtype=torch.float32):
    freq = 1.0 / base ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd)
    angle = torch.outer(torch.arange(seqlen, dtype=torch.float32), freq)
    return angle.cos().to(dtype), angle.sin().to(dtype)


# ---- install(): unmodified code imports fusedattn ----------------------------------------------


def test_install_makes_flash_attn_and_its_submodules_importable(installed):
    ns = run_user_code(
        """
        import flash_attn
        from flash_attn import flash_attn_func, flash_attn_qkvpacked_func
        from flash_attn.flash_attn_interface import flash_attn_varlen_kvpacked_func
        from flash_attn.bert_padding import pad_input, unpad_input, index_first_axis
        from flash_attn.layers.rotary import RotaryEmbedding, apply_rotary_emb
        version = flash_attn.__version__
        """
    )
    assert ns["version"] == compat.__version__ and ns["flash_attn_func"] is compat.flash_attn_func
    compat.uninstall()
    with pytest.raises(ImportError):
        run_user_code("import flash_attn")


def test_install_refuses_to_shadow_a_flash_attn_already_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", type(sys)("flash_attn"))
    with pytest.raises(RuntimeError, match="already imported"):
        compat.install()


# ---- the packed functions ----------------------------------------------------------------------


def test_packed_functions_equal_the_unpacked_ones_with_gradients_into_the_pack():
    torch.manual_seed(0)
    qkv = torch.randn(2, 7, 3, 4, 16, requires_grad=True)
    out = compat.flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = qkv.unbind(2)
    assert_close_kx(
        out, attention64(q, k, v, causal=True), attention64(q, k, v, causal=True).float()
    )
    (grad,) = torch.autograd.grad(out.sum(), qkv)
    assert grad.shape == qkv.shape and grad.abs().sum() > 0
    q = torch.randn(2, 5, 6, 16)
    kv = torch.randn(2, 7, 2, 3, 16)  # GQA: 6 query heads over 3 kv heads
    out = compat.flash_attn_kvpacked_func(q, kv, window_size=(2, 1))
    want = attention64(q, kv[:, :, 0], kv[:, :, 1], window=(2, 1))
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    packed = compat.flash_attn_varlen_qkvpacked_func(qkv[0].detach(), cu, 4, causal=True)
    for a, b in ((0, 3), (3, 7)):
        one = compat.flash_attn_qkvpacked_func(qkv[:1, a:b].detach(), causal=True)[0]
        torch.testing.assert_close(packed[a:b], one, rtol=1e-5, atol=1e-5)
    cu_k = torch.tensor([0, 4, 7], dtype=torch.int32)
    out = compat.flash_attn_varlen_kvpacked_func(q[0, :5], kv[0], torch.tensor([0, 2, 5], dtype=torch.int32), cu_k,
                                                 torch.tensor(3), torch.tensor(4), causal=True)  # fmt: skip
    want = attention64(q[:, 2:5][:1], kv[:1, 4:7, 0], kv[:1, 4:7, 1], causal=True)[0]
    torch.testing.assert_close(out[2:5].double(), want, rtol=1e-5, atol=1e-5)


def test_max_seqlen_may_be_a_0_dim_tensor_as_transformers_passes_it():
    q = torch.randn(7, 2, 8)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    a = compat.flash_attn_varlen_func(
        q, q, q, cu, cu, torch.tensor(4), torch.tensor(4), causal=True
    )
    b = compat.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, causal=True)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_row_that_sees_no_key_has_flash_attentions_lse():
    """Causal with Tq > Tk (bottom-right): the first Tq - Tk queries see nothing; their output
    is 0 and their lse +inf, flash-attention's value (fusedattn's own API keeps -inf)."""
    q, k = torch.randn(1, 5, 2, 8), torch.randn(1, 2, 2, 8)
    out, lse, _ = compat.flash_attn_func(q, k, k, causal=True, return_attn_probs=True)
    assert (
        (out[0, :3] == 0).all() and torch.isinf(lse[0, :, :3]).all() and (lse[0, :, :3] > 0).all()
    )
    assert torch.isfinite(lse[0, :, 3:]).all()
    cache = torch.randn(1, 8, 2, 8)
    _, lse = compat.flash_attn_with_kvcache(q[:, :1], cache, cache, cache_seqlens=0,
                                            return_softmax_lse=True)  # fmt: skip
    assert (lse == float("inf")).all()


def test_with_kvcache_runs_without_autograd_under_grad_mode():
    """transformers' paged path calls it with grad mode on and parameters that require grad;
    flash-attention runs it (no backward): so does compat, writing the cache."""
    q = torch.randn(1, 1, 2, 8, requires_grad=True)
    k_new = torch.randn(1, 1, 2, 8, requires_grad=True)
    cache = torch.zeros(1, 4, 2, 8)
    out = compat.flash_attn_with_kvcache(q, cache, cache.clone(), k_new, k_new, cache_seqlens=1)
    assert not out.requires_grad and out.shape == (1, 1, 2, 8)


def paged(lengths=(5, 7), page=4, pages=4, requires_grad=False):
    """Packed queries (one per key of each sequence) over a paged cache holding them."""
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(8, page, 2, 8, generator=g, requires_grad=requires_grad)
    v_cache = torch.randn(8, page, 2, 8, generator=g, requires_grad=requires_grad)
    q = torch.randn(sum(lengths), 2, 8, generator=g, requires_grad=requires_grad)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    table = torch.arange(2 * pages, dtype=torch.int32).view(2, pages)
    return q, k_cache, v_cache, cu, table


def test_paged_varlen_runs_its_forward_under_grad_mode_and_refuses_the_backward():
    """flash-attention's own tests call flash_attn_varlen_func(..., block_table=...) with
    inputs that require grad under grad mode: the forward runs (it was refused as inference
    only); a backward through it raises, naming why, as a RuntimeError and a ValueError."""
    q, kc, vc, cu, table = paged(requires_grad=True)
    out = compat.flash_attn_varlen_func(q, kc, vc, cu, cu, 7, 7, causal=True, block_table=table)
    with torch.no_grad():
        want = compat.flash_attn_varlen_func(q, kc, vc, cu, cu, 7, 7, causal=True,
                                             block_table=table)  # fmt: skip
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="block_table has no backward") as raised:
        out.sum().backward()
    assert isinstance(raised.value, ValueError)
    out, lse, _ = compat.flash_attn_varlen_func(q, kc, vc, cu, cu, 7, 7, block_table=table,
                                                return_attn_probs=True)  # fmt: skip
    assert out.requires_grad and not lse.requires_grad


def test_compat_errors_are_runtime_errors_as_flash_attentions_and_name_the_block_table():
    """flash-attention raises RuntimeError for bad input; code catching it must catch
    compat's too (they stay ValueError/TypeError as well). A sequence longer than its block
    table can hold names the block table."""
    q, kc, vc, cu, table = paged()
    long = torch.tensor([0, 5, 5 + 17], dtype=torch.int32)  # 17 keys, the table holds 16
    with pytest.raises(RuntimeError, match="block_table holds 4 pages of 4") as raised:
        compat.flash_attn_varlen_func(q, kc, vc, cu, long, 7, 17, block_table=table)
    assert isinstance(raised.value, ValueError)
    with pytest.raises(RuntimeError, match="block_table holds 4 pages of 4"):
        compat.flash_attn_with_kvcache(q[:2, None], kc, vc, cache_seqlens=17, block_table=table)
    with pytest.raises(RuntimeError, match="softmax_scale") as raised:
        compat.flash_attn_func(q[None], q[None], q[None], softmax_scale="x")
    assert isinstance(raised.value, TypeError)
    with pytest.raises(RuntimeError, match="must be float16, bfloat16, float32 or float64"):
        compat.flash_attn_qkvpacked_func(torch.zeros(1, 3, 3, 2, 8, dtype=torch.int32))


# ---- rotary embedding ------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "gptj"])
def test_apply_rotary_emb_is_the_rotation_it_defines(interleaved):
    from fusedattn.compat.flash_attn.layers.rotary import apply_rotary_emb

    x = torch.randn(2, 6, 3, 16)
    cos, sin = tables(32, 8)  # rotary_dim 8 of head dim 16: the rest passes through
    offsets = torch.tensor([0, 5], dtype=torch.int32)
    got = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    positions = torch.arange(6)[None] + offsets[:, None]
    want = rotate64(x, positions[..., None].expand(2, 6, 3), interleaved=interleaved, rotary_dim=8)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    packed = apply_rotary_emb(x.flatten(0, 1), cos, sin, interleaved=interleaved,
                              cu_seqlens=torch.tensor([0, 6, 12], dtype=torch.int32),
                              seqlen_offsets=offsets)  # fmt: skip
    torch.testing.assert_close(packed, got.flatten(0, 1))
    x_leaf = x.clone().requires_grad_()
    (grad,) = torch.autograd.grad(apply_rotary_emb(x_leaf, cos, sin).square().sum(), x_leaf)
    torch.testing.assert_close(grad, 2 * x)  # a rotation keeps norms: d|Rx|^2/dx = 2x


def test_rotary_embedding_module_rotates_q_and_k_in_place():
    from fusedattn.compat.flash_attn.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(16)
    qkv = torch.randn(2, 5, 3, 4, 16)
    before = qkv.clone()
    out = rope(qkv, seqlen_offset=3)
    assert out is qkv
    positions = (torch.arange(5) + 3)[None, :, None].expand(2, 5, 4)
    for i in (0, 1):
        torch.testing.assert_close(qkv[:, :, i].double(), rotate64(before[:, :, i], positions),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
    assert torch.equal(qkv[:, :, 2], before[:, :, 2])  # v untouched
    q, kv = torch.randn(2, 5, 4, 16), torch.randn(2, 5, 2, 2, 16)
    v_before = kv[:, :, 1].clone()
    rope(q, kv)
    assert torch.equal(kv[:, :, 1], v_before)
    xpos = RotaryEmbedding(16, scale_base=512)
    xpos(torch.randn(1, 5, 3, 2, 16))
    assert xpos._cos_k_cached is not None and xpos._cos_k_cached.shape == (5, 8)


@pytest.mark.parametrize("causal", [True, False])
def test_with_kvcache_rotates_q_and_the_new_keys_at_the_cache_positions(causal):
    """The new k at positions cache_seqlens[b] + i, q too when causal (else every query at
    cache_seqlens[b]): equal to rotating them first and calling without rotary."""
    torch.manual_seed(0)
    B, S, H, D = 2, 24, 2, 16
    q, k_new, v_new = torch.randn(B, 3, H, D), torch.randn(B, 3, H, D), torch.randn(B, 3, H, D)
    caches = torch.randn(B, S, H, D), torch.randn(B, S, H, D)
    lengths = torch.tensor([4, 11], dtype=torch.int32)
    cos, sin = tables(S, D)
    got_caches = caches[0].clone(), caches[1].clone()
    got = compat.flash_attn_with_kvcache(q, *got_caches, k_new, v_new, rotary_cos=cos,
                                         rotary_sin=sin, cache_seqlens=lengths, causal=causal,
                                         rotary_interleaved=False)  # fmt: skip
    positions = lengths[:, None] + torch.arange(3)
    k_rot = rotate64(k_new, positions[..., None].expand(B, 3, H)).float()
    q_pos = positions if causal else lengths[:, None].expand(B, 3)
    q_rot = rotate64(q, q_pos[..., None].expand(B, 3, H)).float()
    want_caches = caches[0].clone(), caches[1].clone()
    want = compat.flash_attn_with_kvcache(q_rot, *want_caches, k_rot, v_new,
                                          cache_seqlens=lengths, causal=causal)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_caches[0], want_caches[0], rtol=1e-5, atol=1e-5)


def test_with_kvcache_rotates_a_left_padded_cache_at_its_slots():
    """With cache_leftpad, flash-attention's kernel reads the rotary tables at the cache slots
    (cache_seqlens[b] + i, the padding counted; its tests rotate the reference at
    seqlen_offsets=cache_seqlens): equal to rotating first, and to the same call on the cache
    without its padding when q and k are rotated there."""
    torch.manual_seed(0)
    B, S, H, D = 2, 24, 2, 16
    q, k_new, v_new = torch.randn(B, 2, H, D), torch.randn(B, 2, H, D), torch.randn(B, 2, H, D)
    caches = torch.randn(B, S, H, D), torch.randn(B, S, H, D)
    lengths, leftpad = (
        torch.tensor([9, 14], dtype=torch.int32),
        torch.tensor([3, 0], dtype=torch.int32),
    )
    cos, sin = tables(S, D)
    got_caches = caches[0].clone(), caches[1].clone()
    got = compat.flash_attn_with_kvcache(q, *got_caches, k_new, v_new, rotary_cos=cos,
                                         rotary_sin=sin, cache_seqlens=lengths,
                                         cache_leftpad=leftpad, causal=True,
                                         rotary_interleaved=False)  # fmt: skip
    positions = (lengths[:, None] + torch.arange(2))[..., None].expand(B, 2, H)
    k_rot, q_rot = rotate64(k_new, positions).float(), rotate64(q, positions).float()
    want_caches = caches[0].clone(), caches[1].clone()
    want = compat.flash_attn_with_kvcache(q_rot, *want_caches, k_rot, v_new,
                                          cache_seqlens=lengths, cache_leftpad=leftpad,
                                          causal=True)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_caches[0], want_caches[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(got_caches[0][0, :3], caches[0][0, :3])  # the padding is not written


def test_window_size_as_flash_attentions_tests_pass_it():
    """flash-attention's tests draw the window as `torch.randint(0, seqlen_k, (2,))`: a tensor
    pair, or a tuple of 0-dim tensors, is the same window as the ints."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 9, 2, 16) for _ in range(3))
    window = torch.randint(0, 9, (2,))
    want = compat.flash_attn_func(q, k, v, window_size=tuple(int(w) for w in window))
    for form in (window, tuple(window), list(window)):
        torch.testing.assert_close(compat.flash_attn_func(q, k, v, window_size=form), want)
    with pytest.raises(TypeError, match="integer tensor of two elements"):
        compat.flash_attn_func(q, k, v, window_size=torch.tensor([1.0, 2.0]))


def test_cache_batch_idx_reads_and_appends_the_rows_it_names():
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(5, 16, 2, 8), torch.randn(5, 16, 2, 8)
    idx = torch.tensor([3, 0], dtype=torch.int32)
    q, k_new, v_new = (torch.randn(2, 1, 2, 8) for _ in range(3))
    lengths = torch.tensor([6, 9], dtype=torch.int32)
    kc, vc = k_cache.clone(), v_cache.clone()
    got = compat.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lengths,
                                         cache_batch_idx=idx, causal=True)  # fmt: skip
    rows_k, rows_v = k_cache[idx.long()].clone(), v_cache[idx.long()].clone()
    want = compat.flash_attn_with_kvcache(q, rows_k, rows_v, k_new, v_new, cache_seqlens=lengths,
                                          causal=True)  # fmt: skip
    torch.testing.assert_close(got, want)
    assert torch.equal(kc[idx.long()], rows_k) and torch.equal(vc[idx.long()], rows_v)
    untouched = [1, 2, 4]
    assert torch.equal(kc[untouched], k_cache[untouched])


# ---- torch.compile -----------------------------------------------------------------------------


def _compat_calls():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 9, n, 16, generator=g) for n in (4, 2, 2))
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 10, 15], dtype=torch.int32)
    qp = torch.randn(8, 4, 16, generator=g)
    pages_k, pages_v = (torch.randn(8, 4, 2, 16, generator=g) for _ in range(2))
    table = torch.randperm(8, generator=g)[:6].view(3, 2).to(torch.int32)
    slopes = torch.rand(3, 4, generator=g) * 0.5
    cache_k, cache_v = (torch.randn(3, 16, 2, 16, generator=g) for _ in range(2))
    q1, k1, v1 = (torch.randn(2, 1, n, 16, generator=g) for n in (4, 2, 2))
    lengths, rows = torch.tensor([6, 9], dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32)
    cos, sin = tables(16, 8)
    return {
        "flash_attn_func": lambda: compat.flash_attn_func(
            q, k, v, causal=True, window_size=(5, 0), return_attn_probs=True)[:2],
        "flash_attn_varlen_func paged alibi": lambda: compat.flash_attn_varlen_func(
            qp, pages_k, pages_v, cu_q, cu_k, 5, 7, alibi_slopes=slopes, block_table=table),
        "flash_attn_with_kvcache rotary cache_batch_idx": lambda: compat.flash_attn_with_kvcache(
            q1, cache_k.clone(), cache_v.clone(), k1, v1, rotary_cos=cos, rotary_sin=sin,
            cache_seqlens=lengths, cache_batch_idx=rows, causal=True, rotary_interleaved=False),
    }  # fmt: skip


@pytest.mark.parametrize("name", list(_compat_calls()))
def test_the_functions_compile_whole_to_the_eager_result(name):
    """torch.compile(fullgraph=True) of the compat functions: 0 graph breaks, eager's output
    (an int max_seqlen: a 0-dim tensor is read to the host, which fullgraph refuses). The
    paged varlen call with ALiBi and no window: its bottom-right positions were lost in the
    custom op once (tests/test_paged_prefill.py)."""
    call = _compat_calls()[name]
    with torch.no_grad():
        want = call()
        torch._dynamo.reset()
        explained = torch._dynamo.explain(call)()
        assert explained.graph_break_count == 0, explained.break_reasons
        torch._dynamo.reset()
        got = torch.compile(call, fullgraph=True, backend="aot_eager")()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


# ---- bert_padding ------------------------------------------------------------------------------


def test_unpad_and_pad_round_trip_with_gradients():
    from fusedattn.compat.flash_attn.bert_padding import (
        index_first_axis,
        pad_input,
        unpad_input,
        unpad_input_for_concatenated_sequences,
    )

    x = torch.randn(3, 5, 4, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])
    tokens, indices, cu, longest, used = unpad_input(x, mask)
    assert tokens.shape == (8, 4) and cu.tolist() == [0, 3, 8, 8] and longest == 5
    assert used.tolist() == [3, 5, 0] and cu.dtype == torch.int32
    back = pad_input(tokens, indices, 3, 5)
    assert torch.equal(back, x * mask[..., None])
    (grad,) = torch.autograd.grad(back.sum(), x)
    assert torch.equal(grad, mask[..., None].float().expand_as(x))
    torch.testing.assert_close(index_first_axis(x.flatten(0, 1), indices), tokens)
    lengths = torch.tensor([[2, 3, 0, 0, 0], [5, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    tokens, _, cu, longest = unpad_input_for_concatenated_sequences(x, lengths)
    assert cu.tolist() == [0, 2, 5, 10, 11] and longest == 5 and tokens.shape == (11, 4)


# ---- code written against flash-attn, run unmodified after install() ---------------------------

PAGED_ENGINE = """
import torch
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

class PagedEngine:
    '''Chunked prefill into a paged cache, a prefix-cache hit, then decoding.'''

    def __init__(self, pages, page_size, heads_k, head_dim):
        self.k = torch.zeros(pages, page_size, heads_k, head_dim)
        self.v = torch.zeros(pages, page_size, heads_k, head_dim)
        self.page_size = page_size

    def write(self, table, start, k, v):
        for i in range(k.shape[0]):
            pos = start + i
            page = table[pos // self.page_size]
            self.k[page, pos % self.page_size] = k[i]
            self.v[page, pos % self.page_size] = v[i]

    def prefill(self, q, cu_q, cu_k, max_q, max_k, table):
        return flash_attn_varlen_func(q, self.k, self.v, cu_q, cu_k, max_q, max_k, causal=True,
                                      block_table=table)

    def decode(self, q, k, v, lengths, table):
        return flash_attn_with_kvcache(q, self.k, self.v, k, v, cache_seqlens=lengths,
                                       block_table=table, causal=True)
"""


def test_a_paged_inference_engine_runs_unmodified(installed):
    torch.manual_seed(0)
    Engine = run_user_code(PAGED_ENGINE)["PagedEngine"]
    H, Hk, D, page = 4, 2, 16, 4
    engine = Engine(16, page, Hk, D)
    table = torch.tensor([[5, 1, 9, 2, 12], [7, 3, 0, 14, 6]], dtype=torch.int32)
    full_k, full_v = torch.randn(2, 13, Hk, D), torch.randn(2, 13, Hk, D)
    q_all = torch.randn(2, 13, H, D)
    cached = [6, 2]  # a prefix-cache hit: these keys are in the pages already
    for b in range(2):
        engine.write(table[b], 0, full_k[b, : cached[b] + 4], full_v[b, : cached[b] + 4])
    # chunked prefill: 4 new queries per sequence over cached + new keys
    q = torch.cat([q_all[b, cached[b] : cached[b] + 4] for b in range(2)])
    cu_q = torch.tensor([0, 4, 8], dtype=torch.int32)
    lengths_k = torch.tensor([cached[0] + 4, cached[1] + 4])
    cu_k = torch.cat([torch.zeros(1), lengths_k.cumsum(0)]).to(torch.int32)
    out = engine.prefill(q, cu_q, cu_k, 4, int(lengths_k.max()), table)
    for b in range(2):
        n = cached[b] + 4
        assert_kx(out[None, 4 * b : 4 * b + 4], q_all[b : b + 1, cached[b] : n],
                  full_k[b : b + 1, :n], full_v[b : b + 1, :n], causal=True)  # fmt: skip
    # one decode step appending the next key
    lengths = lengths_k.to(torch.int32)
    step = engine.decode(
        q_all[:, [9, 9]][:, :1], full_k[:, 10:11], full_v[:, 10:11], lengths, table
    )
    for b in range(2):
        n = int(lengths[b]) + 1
        keys = torch.cat([full_k[b, : n - 1], full_k[b, 10:11]])
        values = torch.cat([full_v[b, : n - 1], full_v[b, 10:11]])
        assert_kx(step[b : b + 1], q_all[b : b + 1, 9:10], keys[None], values[None], causal=True)


HYBRID_LAYER = """
import torch
from flash_attn import flash_attn_with_kvcache
from flash_attn.layers.rotary import RotaryEmbedding

class HybridAttention(torch.nn.Module):
    '''The attention layer of a hybrid state-space model: rotary on q and k, a contiguous
    cache, decoding one token at a time with flash_attn_with_kvcache doing the rotation.'''

    def __init__(self, dim, heads, max_len):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.rotary = RotaryEmbedding(self.head_dim, interleaved=False)
        self.rotary._update_cos_sin_cache(max_len, dtype=torch.float32)

    def step(self, x, k_cache, v_cache, lengths):
        B = x.shape[0]
        q, k, v = self.qkv(x).view(B, 1, 3, self.heads, self.head_dim).unbind(2)
        return flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, rotary_cos=self.rotary._cos_cached,
            rotary_sin=self.rotary._sin_cached, cache_seqlens=lengths, causal=True,
            rotary_interleaved=False)
"""


def test_a_hybrid_models_rotary_decoding_runs_unmodified(installed):
    """Decoding token by token with rotary inside flash_attn_with_kvcache equals float64
    causal attention over the rotated sequence."""
    torch.manual_seed(0)
    layer = run_user_code(HYBRID_LAYER)["HybridAttention"](32, 2, 16)
    B, T = 2, 6
    x = torch.randn(B, T, 32)
    caches = torch.zeros(B, 16, 2, 16), torch.zeros(B, 16, 2, 16)
    lengths = torch.zeros(B, dtype=torch.int32)
    with torch.no_grad():
        outs = []
        for t in range(T):
            outs.append(layer.step(x[:, t : t + 1], *caches, lengths))
            lengths += 1
        q, k, v = layer.qkv(x).view(B, T, 3, 2, 16).unbind(2)
    positions = torch.arange(T)[None, :, None].expand(B, T, 2)
    q_rot, k_rot = rotate64(q, positions).float(), rotate64(k, positions).float()
    assert_kx(torch.cat(outs, 1), q_rot, k_rot, v, causal=True)


DIFFUSION_BLOCK = """
import torch
from flash_attn import flash_attn_func

def joint_attention(x, heads):
    '''A diffusion transformer's joint attention: q, k, v split from a (B, H, T, 3 D)
    projection and permuted to flash-attention's (B, T, H, D): non-contiguous views.'''
    q, k, v = x.chunk(3, dim=-1)
    q, k, v = (t.permute(0, 2, 1, 3) for t in (q, k, v))
    return flash_attn_func(q, k, v, softmax_scale=q.shape[-1] ** -0.5)
"""


def test_a_diffusion_transformers_permuted_inputs_run_unmodified(installed):
    attend = run_user_code(DIFFUSION_BLOCK)["joint_attention"]
    x = torch.randn(2, 4, 9, 3 * 16)
    out = attend(x, 4)
    q, k, v = (t.permute(0, 2, 1, 3) for t in x.chunk(3, dim=-1))
    assert not q.is_contiguous()
    assert_kx(out, q, k, v)


# ---- transformers' own flash-attention path on these functions ---------------------------------

transformers = pytest.importorskip("transformers")


@pytest.fixture
def transformers_flash_path(monkeypatch):
    """transformers' _flash_attention_forward with fusedattn's flash-attention functions in
    place of flash-attn's (its loader asks for an installed flash-attn distribution and CUDA,
    neither of which install() can provide)."""
    from transformers import modeling_flash_attention_utils as fa_utils

    from fusedattn.compat.flash_attn import bert_padding

    def ours(implementation, attention_wrapper=None, allow_all_kernels=False):
        return (compat.flash_attn_func, compat.flash_attn_varlen_func,
                compat.flash_attn_with_kvcache, bert_padding.pad_input, bert_padding.unpad_input)  # fmt: skip

    monkeypatch.setattr(fa_utils, "_lazy_imports", ours)
    monkeypatch.setattr(fa_utils, "_loaded_implementation", None)
    yield fa_utils._flash_attention_forward
    fa_utils._loaded_implementation = None


def test_transformers_flash_attention_forward_padded_and_padding_free(transformers_flash_path):
    forward = transformers_flash_path
    torch.manual_seed(0)
    B, T, H, D = 2, 7, 4, 16
    q, k, v = (torch.randn(B, T, H, D) for _ in range(3))
    # a right-padded batch through unpad_input / the varlen function / pad_input
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 5:] = 0
    out = forward(q, k, v, mask, T, True, attn_implementation="flash_attention_2")
    assert_kx(out[:1], q[:1], k[:1], v[:1], causal=True)
    assert_kx(out[1:, :5], q[1:, :5], k[1:, :5], v[1:, :5], causal=True)
    # padding-free packed training: position_ids restart per sequence, max lengths as 0-dim
    # tensors (it refused those before)
    packed = [t.reshape(1, B * T, H, D) for t in (q, k, v)]
    position_ids = torch.cat([torch.arange(3), torch.arange(11)])[None]
    out = forward(*packed, None, B * T, True, position_ids=position_ids,
                  attn_implementation="flash_attention_2")  # fmt: skip
    for a, b in ((0, 3), (3, 14)):
        assert_kx(out[:, a:b], *(t[:, a:b] for t in packed), causal=True)


def test_rotary_tables_as_transformers_llama_builds_them_match(installed):
    """apply_rotary_emb with cos/sin tables in the model's dtype, bf16 q: within bf16's
    rounding of the float64 rotation."""
    from flash_attn.layers.rotary import apply_rotary_emb

    x = torch.randn(1, 8, 2, 64).bfloat16()
    cos, sin = tables(8, 64, dtype=torch.bfloat16)
    got = apply_rotary_emb(x, cos, sin)
    want = rotate64(x, torch.arange(8)[None, :, None].expand(1, 8, 2))
    assert (got.double() - want).abs().max() < 4 * 2**-8 * want.abs().max() + math.ulp(1.0)
