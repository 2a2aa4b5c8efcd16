"""Every argument of every public function and module, given a value of the wrong type or kind,
gets a TypeError or ValueError whose message names it (issue #59: `layer_norm(x, 8.0)` raised
"'float' object is not iterable" from inside a plan's key, naming nothing).

The table holds, per public callable, a valid call and for each argument the bad values a
user might pass: another type (a float for an int, a string, a list, None where a value is
required), or a value of the right type out of its domain. A call is made as a user would:
modules are built and then called (an argument torch's own module takes at construction and
uses later may be named at either point). Module constructor flags that torch's modules take
by truthiness (bias=0, batch_first=None) are not errors in torch and are left out.
"""

import functools

import pytest
import torch

import fusedattn
from fusedattn.compat import flash_attn

F32 = torch.float32


def dense_call():
    q, k, v = (torch.randn(2, 2, 5, 8) for _ in range(3))
    return fusedattn.attention, dict(q=q, k=k, v=v)


def varlen_call():
    q, k, v = (torch.randn(7, 2, 8) for _ in range(3))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    return fusedattn.varlen_attention, dict(
        q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4
    )


def kvcache_call():
    q = torch.randn(2, 1, 2, 8)
    k_cache, v_cache = torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8)
    return fusedattn.attention_with_kvcache, dict(
        q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=torch.tensor([3, 4], dtype=torch.int32)
    )


def norm_call(fn, **extra):
    def call():
        return fn, dict(x=torch.randn(3, 8), normalized_shape=(8,), **extra)

    return call


def softmax_call():
    return fusedattn.softmax, dict(x=torch.randn(3, 8))


NOT_A_TENSOR = [1.0, "x", [1.0, 2.0]]
NOT_A_BOOL = ["yes", 1.0, None, 2]
NOT_A_FLOAT = ["0.5", [0.5], torch.tensor(0.5)]
NOT_AN_INT = [2.5, "2", [2]]
NOT_A_BACKEND = [3, None, "fastest"]
NOT_A_WINDOW = [3, "ab", (1.5, 2), [1], (1, 2, 3), (-5, 0)]
ATTENTION_VARIANTS = dict(
    window_size=NOT_A_WINDOW,
    softcap=[*NOT_A_FLOAT, -1.0, float("inf")],
    alibi_slopes=[*NOT_A_TENSOR, torch.ones(2, dtype=torch.float64), torch.ones(5)],
    sinks=[*NOT_A_TENSOR, torch.ones(5), torch.ones(2, dtype=torch.int32)],
    return_lse=NOT_A_BOOL,
    backend=NOT_A_BACKEND,
)

# callable -> {argument: bad values}
# fmt: off
TABLE = {
    "attention": (dense_call, dict(
        q=[*NOT_A_TENSOR, None, torch.randn(2, 5, 8)], k=[*NOT_A_TENSOR, None],
        v=[*NOT_A_TENSOR, None], attn_mask=[*NOT_A_TENSOR, torch.ones(3, 3)],
        dropout_p=[*NOT_A_FLOAT, None, 1.5], is_causal=NOT_A_BOOL,
        scale=[*NOT_A_FLOAT, float("nan")], enable_gqa=NOT_A_BOOL,
        key_padding_mask=[*NOT_A_TENSOR, torch.zeros(2, 5)],
        causal_alignment=[3, None, "middle"], **ATTENTION_VARIANTS,
    )),
    "varlen_attention": (varlen_call, dict(
        q=[*NOT_A_TENSOR, None], k=[*NOT_A_TENSOR, None], v=[*NOT_A_TENSOR, None],
        cu_seqlens_q=[*NOT_A_TENSOR, None, torch.tensor([0, 3, 7])],
        cu_seqlens_k=[*NOT_A_TENSOR, None, torch.tensor([0.0, 3.0, 7.0])],
        max_seqlen_q=[*NOT_AN_INT, None, -1], max_seqlen_k=[*NOT_AN_INT, None],
        dropout_p=[*NOT_A_FLOAT, None], is_causal=NOT_A_BOOL, scale=NOT_A_FLOAT,
        enable_gqa=NOT_A_BOOL, causal_alignment=[3, None, "middle"],
        block_table=[*NOT_A_TENSOR, torch.zeros(2, 1)], **ATTENTION_VARIANTS,
    )),
    "attention_with_kvcache": (kvcache_call, dict(
        q=[*NOT_A_TENSOR, None], k_cache=[*NOT_A_TENSOR, None], v_cache=[*NOT_A_TENSOR, None],
        k=[*NOT_A_TENSOR, torch.randn(2, 1, 2, 4)], v=[*NOT_A_TENSOR],
        cache_seqlens=[2.5, "3", [3, 4], None, torch.tensor([3.0, 4.0])],
        block_table=[*NOT_A_TENSOR, torch.zeros(2, 1)],
        cache_leftpad=[*NOT_A_TENSOR, torch.zeros(2)], scale=NOT_A_FLOAT,
        is_causal=NOT_A_BOOL, num_splits=[*NOT_AN_INT, None, -1], **ATTENTION_VARIANTS,
    )),
    "layer_norm": (norm_call(fusedattn.layer_norm), dict(
        x=[*NOT_A_TENSOR, None], normalized_shape=[8.0, "8", None, (8.0,), 0, -8, [[8]], (9,)],
        weight=[*NOT_A_TENSOR, torch.ones(7)], bias=[*NOT_A_TENSOR, torch.ones(7)],
        eps=[*NOT_A_FLOAT, None, -1.0], backend=NOT_A_BACKEND,
    )),
    "rms_norm": (norm_call(fusedattn.rms_norm), dict(
        x=[*NOT_A_TENSOR, None], normalized_shape=[8.0, "8", None, (8.0,), 0, -8, [[8]]],
        weight=[*NOT_A_TENSOR, torch.ones(7)], eps=[*NOT_A_FLOAT, -1.0],
        backend=NOT_A_BACKEND,
    )),
    "softmax": (softmax_call, dict(
        x=[*NOT_A_TENSOR, None], dim=[*NOT_AN_INT, None, 5],
        mask=[*NOT_A_TENSOR, torch.ones(4, 8)], scale=NOT_A_FLOAT, is_causal=NOT_A_BOOL,
        backend=NOT_A_BACKEND,
    )),
}
# fmt: on


def cases():
    for name, (_make, arguments) in TABLE.items():
        for argument, values in arguments.items():
            for i, value in enumerate(values):
                yield pytest.param(name, argument, value, id=f"{name}-{argument}-{i}")


def expect_named(call, argument):
    with pytest.raises((TypeError, ValueError)) as raised:
        call()
    assert argument in str(raised.value), f"{type(raised.value).__name__}: {raised.value}"


@pytest.mark.parametrize(("name", "argument", "value"), cases())
def test_a_bad_argument_of_a_public_function_is_named(name, argument, value):
    make, _ = TABLE[name]
    fn, kwargs = make()
    fn(**kwargs)  # the valid call runs
    kwargs[argument] = value
    if argument == "k" and name == "attention_with_kvcache":
        kwargs["v"] = torch.randn(2, 1, 2, 8)
    if argument == "v" and name == "attention_with_kvcache":
        kwargs["k"] = torch.randn(2, 1, 2, 8)
    expect_named(functools.partial(fn, **kwargs), argument)


# ---- modules: built, then called -------------------------------------------------------------


def mha(**kw):
    args = dict(embed_dim=8, num_heads=2)
    args.update(kw)
    return fusedattn.MultiheadAttention(**args)


def mha_forward(module=None, **kw):
    x = torch.randn(2, 3, 8)
    args = dict(query=x, key=x, value=x)
    args.update(kw)
    return (module or mha())(**args)


MODULE_CASES = [
    # (what, argument, call)
    *[("MultiheadAttention", "embed_dim", functools.partial(mha, embed_dim=v))
      for v in (8.0, "8", None, 0)],
    *[("MultiheadAttention", "num_heads", functools.partial(mha, num_heads=v))
      for v in (2.0, "2", None, 3)],
    *[("MultiheadAttention", "dropout", functools.partial(mha, dropout=v))
      for v in ("0.1", None, 1.5)],
    *[("MultiheadAttention", "kdim", functools.partial(mha, kdim=v)) for v in (4.0, "4", 0)],
    *[("MultiheadAttention", "vdim", functools.partial(mha, vdim=v)) for v in (4.0, "4")],
    *[("MultiheadAttention", "backend", lambda v=v: mha_forward(mha(backend=v)))
      for v in (3, None, "fastest")],
    *[("MultiheadAttention", name, functools.partial(mha_forward, **{name: v}))
      for name in ("query", "key", "value") for v in (1.0, "x", None)],
    *[("MultiheadAttention", "key_padding_mask",
       functools.partial(mha_forward, key_padding_mask=v))
      for v in (1.0, "x", torch.zeros(2, 4, dtype=torch.bool))],
    *[("MultiheadAttention", "attn_mask", functools.partial(mha_forward, attn_mask=v))
      for v in (1.0, "x", torch.zeros(4, 4))],
    *[("MultiheadAttention", "is_causal", functools.partial(mha_forward, is_causal=v))
      for v in ("yes", 2)],
    *[("LayerNorm", "normalized_shape", functools.partial(fusedattn.LayerNorm, v))
      for v in (8.0, "8", None, (8.0,))],
    *[("LayerNorm", "eps", lambda v=v: fusedattn.LayerNorm(8, eps=v)(torch.randn(2, 8)))
      for v in ("x", None, -1.0)],
    *[("LayerNorm", "backend", lambda v=v: fusedattn.LayerNorm(8, backend=v)(torch.randn(2, 8)))
      for v in (3, None, "fastest")],
    *[("LayerNorm", "x", lambda v=v: fusedattn.LayerNorm(8)(v)) for v in (1.0, "x", None)],
    *[("RMSNorm", "normalized_shape", functools.partial(fusedattn.RMSNorm, v))
      for v in (8.0, "8", None, (8.0,))],
    *[("RMSNorm", "eps", lambda v=v: fusedattn.RMSNorm(8, eps=v)(torch.randn(2, 8)))
      for v in ("x", -1.0)],
    *[("RMSNorm", "x", lambda v=v: fusedattn.RMSNorm(8)(v)) for v in (1.0, "x", None)],
    *[("Softmax", "dim", lambda v=v: fusedattn.Softmax(v)(torch.randn(2, 8)))
      for v in (1.5, "1", 5)],
    *[("Softmax", "backend", lambda v=v: fusedattn.Softmax(1, backend=v)(torch.randn(2, 8)))
      for v in (3, "fastest")],
    *[("Softmax", "x", lambda v=v: fusedattn.Softmax(1)(v)) for v in (1.0, "x", None)],
    *[("swap_modules", "model", functools.partial(fusedattn.swap_modules, v))
      for v in (1.0, "x", None, [torch.nn.LayerNorm(4)])],
    *[("swap_modules", "backend",
       functools.partial(fusedattn.swap_modules, torch.nn.LayerNorm(4), backend=v))
      for v in (3, None, "fastest")],
    *[("available_backends", "device", functools.partial(fusedattn.available_backends, v))
      for v in (1.5, "gpu0", [0])],
]  # fmt: skip


@pytest.mark.parametrize(
    ("what", "argument", "call"),
    [pytest.param(*c, id=f"{c[0]}-{c[1]}-{i}") for i, c in enumerate(MODULE_CASES)],
)
def test_a_bad_argument_of_a_module_is_named(what, argument, call):
    expect_named(call, argument)


# ---- flash-attn compatible functions ---------------------------------------------------------


def fa_qkv():
    return (torch.randn(2, 5, 2, 8) for _ in range(3))


COMPAT_CASES = [
    *[("flash_attn_func", "softmax_scale",
       lambda v=v: flash_attn.flash_attn_func(*fa_qkv(), softmax_scale=v)) for v in ("x", [1])],
    *[("flash_attn_func", "causal", lambda v=v: flash_attn.flash_attn_func(*fa_qkv(), causal=v))
      for v in ("yes", 2)],
    *[("flash_attn_func", "window_size",
       lambda v=v: flash_attn.flash_attn_func(*fa_qkv(), window_size=v))
      for v in (3, "ab", (1.5, 2), (1,))],
    *[("flash_attn_func", "dropout_p",
       lambda v=v: flash_attn.flash_attn_func(*fa_qkv(), dropout_p=v)) for v in ("x", None)],
    *[("flash_attn_varlen_func", "max_seqlen_q",
       lambda v=v: flash_attn.flash_attn_varlen_func(
           *(t[0] for t in fa_qkv()), torch.tensor([0, 5], dtype=torch.int32),
           torch.tensor([0, 5], dtype=torch.int32), v, 5)) for v in (2.5, "5", None)],
    *[("flash_attn_with_kvcache", "cache_seqlens",
       lambda v=v: flash_attn.flash_attn_with_kvcache(
           torch.randn(2, 1, 2, 8), torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8),
           cache_seqlens=v)) for v in (2.5, "3", [3, 4])],
]  # fmt: skip


@pytest.mark.parametrize(
    ("what", "argument", "call"),
    [pytest.param(*c, id=f"{c[0]}-{c[1]}-{i}") for i, c in enumerate(COMPAT_CASES)],
)
def test_a_bad_argument_of_a_compat_function_is_named(what, argument, call):
    expect_named(call, argument)


# ---- context parallelism: one rank of a gloo group in this process ---------------------------


@pytest.fixture(scope="module")
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def cp_call(**kw):
    from fusedattn import distributed as cp

    q, k, v = (torch.randn(1, 2, 8, 8) for _ in range(3))
    return cp.context_parallel_attention(q, k, v, **kw)


def shard_call(**kw):
    from fusedattn import distributed as cp

    args = dict(x=torch.randn(2, 8, 4), dim=1)
    args.update(kw)
    return cp.shard_sequence(**args)


CP_CASES = [
    *[("is_causal", dict(is_causal=v)) for v in ("yes", None, 2)],
    *[("scale", dict(scale=v)) for v in NOT_A_FLOAT],
    *[("window_size", dict(window_size=v)) for v in NOT_A_WINDOW],
    *[("softcap", dict(softcap=v)) for v in ("x", None, -1.0)],
    *[("sinks", dict(sinks=v)) for v in (*NOT_A_TENSOR, torch.ones(5))],
    *[("layout", dict(layout=v)) for v in (3, None, "spiral")],
    *[("strategy", dict(strategy=v)) for v in (3, None, "broadcast")],
    *[("dropout_p", dict(dropout_p=v)) for v in ("x", 0.5)],
    *[("return_lse", dict(return_lse=v)) for v in ("yes", None)],
    *[("backend", dict(backend=v)) for v in (3, None, "cuda")],
]


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize(
    ("argument", "kwargs"), [pytest.param(*c, id=f"{c[0]}-{i}") for i, c in enumerate(CP_CASES)]
)
def test_a_bad_argument_of_context_parallel_attention_is_named(argument, kwargs):
    cp_call()  # the valid call runs
    expect_named(functools.partial(cp_call, **kwargs), argument)


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize(
    ("argument", "kwargs"),
    [pytest.param(a, {a: v}, id=f"{a}-{i}") for i, (a, v) in enumerate(
        [("x", 1.0), ("x", None), ("dim", 1.5), ("dim", "1"), ("dim", 5), ("layout", "spiral"),
         ("layout", None)])],
)  # fmt: skip
def test_a_bad_argument_of_shard_sequence_is_named(argument, kwargs):
    shard_call()
    expect_named(functools.partial(shard_call, **kwargs), argument)


@pytest.mark.usefixtures("one_rank_group")
def test_context_parallel_blocks_go_through_the_backends_refusals(monkeypatch):
    """backend="triton" on CPU tensors without TRITON_INTERPRET=1 is refused as every op
    refuses it (it crashed inside Triton: "0 active drivers"), before anything is sent."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(fusedattn.BackendUnavailableError, match="TRITON_INTERPRET=1 is not set"):
        cp_call(backend="triton", is_causal=True)
    with pytest.raises(fusedattn.BackendUnavailableError, match="softcap"):
        cp_call(backend="torch", softcap=5.0)  # torch's SDPA has no softcap
