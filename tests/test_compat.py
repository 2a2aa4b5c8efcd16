"""fusedattn.compat.flash_attn (issue #32): flash-attention 2's signatures and return values, a
small module written against flash_attn's API run by changing its import only, and clear
errors for what fusedattn cannot honour."""

import inspect
import textwrap

import pytest
import torch

from fusedattn import reference
from fusedattn.compat import flash_attn as compat

# flash-attention 2's signatures (flash_attn/flash_attn_interface.py), parameter for parameter,
# then flash-attention 3's fp8 descales (hopper/flash_attn_interface.py), by keyword
FA3_DESCALES = ", *, q_descale=None, k_descale=None, v_descale=None)"
FA2_SIGNATURES = {
    "flash_attn_func": "(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, "
    "window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False, "
    "return_attn_probs=False" + FA3_DESCALES,
    "flash_attn_varlen_func": "(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, "
    "max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), "
    "softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, "
    "block_table=None" + FA3_DESCALES,
    "flash_attn_with_kvcache": "(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, "
    "rotary_sin=None, cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, "
    "block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
    "rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False"
    + FA3_DESCALES,
}


@pytest.mark.parametrize("name", FA2_SIGNATURES)
def test_signatures_are_flash_attention_2s(name):
    sig = inspect.signature(getattr(compat, name))
    plain = sig.replace(parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()])
    assert str(plain) == FA2_SIGNATURES[name]


# A module written against flash_attn's API: a decoder attention layer that trains with
# flash_attn_func, runs packed batches with flash_attn_varlen_func and decodes with
# flash_attn_with_kvcache.
USER_MODULE = textwrap.dedent(
    """
    import torch
    from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache


    class Attention(torch.nn.Module):
        def __init__(self, dim, heads, kv_heads):
            super().__init__()
            self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
            self.q = torch.nn.Linear(dim, dim)
            self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)

        def project(self, x):
            B, T, _ = x.shape
            q = self.q(x).view(B, T, self.heads, self.head_dim)
            k, v = self.kv(x).view(B, T, 2, self.kv_heads, self.head_dim).unbind(2)
            return q, k, v

        def forward(self, x):
            q, k, v = self.project(x)
            return flash_attn_func(q, k, v, causal=True).flatten(2)

        def packed(self, x, cu_seqlens, max_seqlen):
            q, k, v = (t[0] for t in self.project(x[None]))
            return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen,
                                          max_seqlen, causal=True).flatten(1)

        def decode(self, x, k_cache, v_cache, cache_seqlens):
            q, k, v = self.project(x)
            return flash_attn_with_kvcache(q, k_cache, v_cache, k, v,
                                           cache_seqlens=cache_seqlens, causal=True).flatten(2)
    """
)


def load_user_module():
    """USER_MODULE with its import line changed to fusedattn's, and nothing else."""
    source = USER_MODULE.replace(
        "from flash_attn import", "from fusedattn.compat.flash_attn import"
    )
    assert source.count("fusedattn") == 1
    namespace = {}
    exec(compile(source, "user_module.py", "exec"), namespace)
    return namespace["Attention"]


def causal_reference(q, k, v):
    """(B, T, H, D) layout, float64, GQA by repeating heads."""
    rep = q.shape[2] // k.shape[2]
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return reference.attention(q, k, v, is_causal=True).transpose(1, 2)


def test_a_flash_attn_module_runs_by_changing_its_import():
    torch.manual_seed(0)
    layer = load_user_module()(32, 4, 2)
    x = torch.randn(2, 9, 32, requires_grad=True)
    out = layer(x)
    q, k, v = layer.project(x)
    torch.testing.assert_close(
        out.double(), causal_reference(q, k, v).flatten(2), atol=1e-5, rtol=1e-5
    )
    out.sum().backward()  # trains: gradients reach the projections
    assert layer.q.weight.grad is not None and torch.isfinite(x.grad).all()

    # packed: sequences of 4 and 5 tokens equal the two run alone
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    tokens = torch.randn(9, 32)
    packed = layer.packed(tokens, cu, 5)
    for a, b in ((0, 4), (4, 9)):
        torch.testing.assert_close(packed[a:b], layer(tokens[None, a:b])[0], atol=1e-5, rtol=1e-5)

    # decode: prefill 6 tokens into a cache, then one step; equals the causal pass over all 7
    with torch.no_grad():
        seq = torch.randn(1, 7, 32)
        k_cache = torch.zeros(1, 16, 2, 8)
        v_cache = torch.zeros(1, 16, 2, 8)
        lengths = torch.zeros(1, dtype=torch.int32)
        layer.decode(seq[:, :6], k_cache, v_cache, lengths)
        step = layer.decode(seq[:, 6:], k_cache, v_cache, lengths + 6)
        torch.testing.assert_close(step, layer(seq)[:, 6:], atol=1e-5, rtol=1e-5)


def test_return_values_and_layouts_are_flash_attentions():
    q, k, v = (torch.randn(2, 5, 4, 8) for _ in range(3))
    out, lse, probs = compat.flash_attn_func(q, k, v, return_attn_probs=True)
    # without dropout flash-attention's third value is an empty tensor (it was None here)
    assert out.shape == (2, 5, 4, 8) and lse.shape == (2, 4, 5) and probs.shape == (0,)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    out, lse, probs = compat.flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 3, 3,
                                                    return_attn_probs=True)  # fmt: skip
    assert out.shape == (5, 4, 8) and lse.shape == (4, 5) and probs.shape == (0,)
    out, lse = compat.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=5,
                                              return_softmax_lse=True)  # fmt: skip
    assert out.shape == (2, 1, 4, 8) and lse.shape == (2, 4, 1)
    full = compat.flash_attn_with_kvcache(q[:, :1], k, v)  # cache_seqlens=None: every slot
    torch.testing.assert_close(full, out)


def test_causal_and_windows_are_bottom_right_as_in_flash_attention():
    """seqlen_q = 2, seqlen_k = 5, causal: query 0 sees keys 0..3, query 1 all five (the
    example of flash-attention's docstring)."""
    q = torch.randn(1, 2, 1, 8)
    k, v = torch.randn(1, 5, 1, 8), torch.eye(5, 8)[None, :, None]
    out = compat.flash_attn_func(q, k, v.expand(1, 5, 1, 8).contiguous(), causal=True)
    weights = out[0, :, 0, :5]
    assert (weights[0, 4] == 0) and (weights[0, :4] > 0).all() and (weights[1] > 0).all()
    out = compat.flash_attn_func(q, k, v.expand(1, 5, 1, 8).contiguous(), window_size=(1, 0))
    weights = out[0, :, 0, :5]  # query 0 at position 3: keys 2, 3; query 1 at 4: keys 3, 4
    assert (weights[0, 2:4] > 0).all() and weights[0, [0, 1, 4]].abs().max() == 0
    assert (weights[1, 3:5] > 0).all() and weights[1, :3].abs().max() == 0


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda q: compat.flash_attn_with_kvcache(q, q, q, k=q, v=q, cache_seqlens=0, rotary_cos=q[0, :, 0]), "both rotary_cos and rotary_sin"),
        (lambda q: compat.flash_attn_with_kvcache(q, q, q, cache_batch_idx=torch.zeros(1, dtype=torch.int32), block_table=torch.zeros(1, 1, dtype=torch.int32)), "cache_batch_idx with a block_table"),
        (lambda q: compat.flash_attn_with_kvcache(q, q, q, k=q, v=q), "needs cache_seqlens"),
        (lambda q: compat.flash_attn_func(q, q, q, dropout_p=0.1, return_attn_probs=True), "dropout pattern"),
        (lambda q: compat.flash_attn_varlen_func(q[0], q[0], q[0], *(torch.tensor([0, 3], dtype=torch.int32),) * 2, torch.ones(2), 3), "max_seqlen_q must be"),
    ],
    ids=["rotary_half", "batch_idx_and_pages", "append_without_lengths", "probs_with_dropout", "max_seqlen_vector"],
)  # fmt: skip
def test_what_cannot_be_honoured_is_refused_by_name(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(torch.randn(1, 3, 2, 8))
