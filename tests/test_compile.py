"""Every public op is captured whole by torch.compile (issue #49 items 1 and 2): zero graph
breaks (torch._dynamo.explain) and the eager result, on the triton, torch and auto backends,
decoding included (attention_with_kvcache as two custom ops, the append's caches declared
mutated); Hugging Face generation with a static cache and the forward compiled with
fullgraph=True gives eager's tokens, with the decode kernel inside the compiled graph."""

import pytest
import torch

import fusedattn
from fusedattn.masks import create_block_mask

BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.kernels), "auto"]


def _attention_cases():
    q, k, v = (torch.randn(2, 4, 9, 16) for _ in range(3))
    kpm = torch.zeros(2, 9, dtype=torch.bool)
    kpm[1, 6:] = True
    bias, slopes, sinks = torch.randn(9, 9), torch.rand(4), torch.randn(4)
    bm = create_block_mask(lambda b, h, i, j: (j <= i) & ((i - j) % 4 != 1), None, None, 9, 9,
                           BLOCK_SIZE=(16, 32))  # fmt: skip
    return {  # name -> (call(backend), tensors that get gradients, backends that refuse it)
        "plain": (lambda b: fusedattn.attention(q, k, v, backend=b), (q, k, v), ()),
        "causal+padding": (
            lambda b: fusedattn.attention(q, k, v, is_causal=True, key_padding_mask=kpm,
                                          backend=b), (q, k, v), (),
        ),
        "float mask+window": (
            lambda b: fusedattn.attention(q, k, v, bias, window_size=(3, 0),
                                          backend=b), (q, k, v), (),
        ),
        "bottom-right window+alibi": (
            lambda b: fusedattn.attention(q[:, :, :5], k, v, window_size=(2, 1),
                                          alibi_slopes=slopes,
                                          causal_alignment="bottom_right", backend=b),
            (q, k, v), (),
        ),
        "sinks": (lambda b: fusedattn.attention(q, k, v, sinks=sinks, backend=b),
                  (q, k, v), ()),
        "softcap+lse": (
            lambda b: torch.cat([t.flatten() for t in fusedattn.attention(
                q, k, v, softcap=3.0, return_lse=True, backend=b)]),
            (q, k, v), ("torch",),
        ),
        # the torch backend's dense form of the mask once branched on its values (issue #82)
        "block mask": (lambda b: fusedattn.attention(q, k, v, block_mask=bm, backend=b),
                       (q, k, v), ()),
    }  # fmt: skip


def _packed_and_rowwise_cases():
    q, k, v = (torch.randn(12, 4, 16) for _ in range(3))
    cu = torch.tensor([0, 5, 5, 12], dtype=torch.int32)
    x, w, bias = torch.randn(6, 40), torch.randn(40), torch.randn(40)
    w2 = torch.randn(7, 40)
    cu_q, sinks, keep = (
        torch.tensor([0, 3, 3, 9], dtype=torch.int32),
        torch.randn(4),
        torch.rand(6, 6) > 0.3,
    )
    return {
        "varlen bottom-right window+sinks": (
            lambda b: fusedattn.varlen_attention(q[:9], k, v, cu_q, cu, 6, 7,
                                                 window_size=(4, 0), sinks=sinks,
                                                 causal_alignment="bottom_right", backend=b),
            (q, k, v), (),
        ),
        "layer_norm": (lambda b: fusedattn.layer_norm(x, (40,), w, bias, backend=b),
                       (x, w, bias), ()),
        "rms_norm": (lambda b: fusedattn.rms_norm(x, (40,), w, backend=b), (x, w), ()),
        "linear": (lambda b: fusedattn.linear(x, w2, bias[:7], backend=b), (x, w2, bias), ()),
        "softmax masked causal": (
            lambda b: fusedattn.softmax(x[:, :6], mask=keep, scale=0.5,
                                        is_causal=True, backend=b), (x,), (),
        ),
    }  # fmt: skip


CASES = _attention_cases() | _packed_and_rowwise_cases()


def _compiled_equals_eager(fn, leaves, compiler="aot_eager"):
    """0 graph breaks; the fullgraph-compiled forward and gradients equal eager's."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)()
    assert explained.graph_break_count == 0, explained.break_reasons
    grads = [t.requires_grad_() for t in leaves]
    want = fn()
    want_grads = torch.autograd.grad(want, grads, torch.ones_like(want))
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend=compiler)()
    got_grads = torch.autograd.grad(got, grads, torch.ones_like(got))
    for t in grads:
        t.requires_grad_(False)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(CASES))
def test_every_op_compiles_whole_to_the_eager_result(case, backend):
    call, leaves, refused_by = CASES[case]
    if backend in refused_by:
        with pytest.raises(fusedattn.BackendUnavailableError):
            call(backend)
        return
    torch.manual_seed(0)
    _compiled_equals_eager(lambda: call(backend), leaves)


def test_modules_compile_whole_to_the_eager_result():
    torch.manual_seed(0)
    mha = fusedattn.MultiheadAttention(32, 4, batch_first=True)
    ln, rms, sm = fusedattn.LayerNorm(32), fusedattn.RMSNorm(32), fusedattn.Softmax(-1)
    x = torch.randn(2, 7, 32)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, 5:] = True

    def model():
        h = mha(x, x, x, key_padding_mask=pad, need_weights=False)[0]
        return sm(rms(ln(h)))

    _compiled_equals_eager(model, [x])


# ---- decoding: the append and the attention as two custom ops -----------------------------


def _decode_inputs(paged: bool, Tnew: int):
    B, S, Hkv, Hq, D, page = 2, 32, 2, 4, 16, 8
    g = torch.Generator().manual_seed(0)
    if paged:
        kc, vc = (torch.randn(9, page, Hkv, D, generator=g) for _ in range(2))
        table = torch.randperm(9, generator=g)[:8].view(2, 4).to(torch.int32)
    else:
        kc, vc = (torch.randn(B, S, Hkv, D, generator=g) for _ in range(2))
        table = None
    q = torch.randn(B, 2, Hq, D, generator=g)
    new = [torch.randn(B, Tnew, Hkv, D, generator=g) for _ in range(2)] if Tnew else [None] * 2
    seq = torch.tensor([3, 20], dtype=torch.int32)
    return q, kc, vc, new, seq, table


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("Tnew", [0, 2])
def test_a_decode_step_compiles_whole_and_writes_the_cache_as_eager(backend, paged, Tnew):
    """attention_with_kvcache with its in-place append: 0 graph breaks, the custom ops in the
    graph (the append declaring its caches mutated), and the eager output and caches."""
    q, kc, vc, (k, v), seq, table = _decode_inputs(paged, Tnew)

    def step(q, kc, vc, k, v, seq):
        return fusedattn.attention_with_kvcache(
            q, kc, vc, k, v, cache_seqlens=seq, block_table=table, is_causal=True,
            window_size=(6, 0), backend=backend,
        )  # fmt: skip

    eager_caches = kc.clone(), vc.clone()
    want = step(q, *eager_caches, k, v, seq)
    torch._dynamo.reset()
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    explained = torch._dynamo.explain(step)(q, kc.clone(), vc.clone(), k, v, seq)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend=recording)(q, kc, vc, k, v, seq)
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert "fusedattn.kvcache_attention" in targets
    assert ("fusedattn.kvcache_append" in targets) == bool(Tnew)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(kc, eager_caches[0]) and torch.equal(vc, eager_caches[1])
    # functionalized (what Inductor sees): the same result and caches
    kc2, vc2 = kc.clone(), vc.clone()
    _, kc, vc, _, _, _ = _decode_inputs(paged, Tnew)
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, kc, vc, k, v, seq)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)


def test_the_decode_ops_check_values_inside_their_implementation():
    """Host reads of the lengths cannot be traced: the value checks run in the ops' real
    implementations, so a compiled call still raises the CPU's ValueError, caches intact."""
    q, kc, vc, (k, v), _, _ = _decode_inputs(False, 2)
    before = kc.clone()
    step = torch.compile(
        lambda seq: fusedattn.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seq,
                                                     backend="torch"),
        fullgraph=True, backend="aot_eager",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 31"):
        step(torch.tensor([3, 31], dtype=torch.int32))
    assert torch.equal(kc, before)


# ---- Hugging Face: static-cache generation with the forward compiled --------------------------

transformers = pytest.importorskip("transformers")
hf = pytest.importorskip("fusedattn.integrations.huggingface")


@pytest.fixture(scope="module", autouse=True)
def registered():
    hf.register("fusedattn-triton", backend="triton")


def _generation_models():
    import test_huggingface as models

    return models


@pytest.mark.slow
@pytest.mark.kernels
# Both ways of compiling on Llama; each other model's variant (window, softcap, sinks) one way
# (the ways differ in how generate is told, not in what the variants' ops trace: 76 -> 48 s)
@pytest.mark.parametrize(
    "config,how",
    [("llama", "forward"), ("llama", "generation_config"), ("mistral", "forward"),
     ("gemma2", "generation_config"), ("gpt_oss", "forward")],
)  # fmt: skip
def test_static_cache_generation_with_the_forward_compiled_gives_eagers_tokens(config, how):
    """Left-padded batch, greedy, static cache: the forward compiled with fullgraph=True (by
    hand, or by generate itself through a CompileConfig, which it does on CUDA by default),
    the tokens of HF's eager attention, and every decode step's attention the Triton decode
    op inside the compiled graph (Mistral's window, Gemma 2's softcap, GPT-OSS's sinks)."""
    models = _generation_models()

    def make():
        made = getattr(models, f"{config}_config")()
        if config == "gpt_oss":  # its eager experts loop over the experts hit: not traceable
            made._experts_implementation = "batched_mm"
        return made

    eager = models.eager_twin(make())
    ours = models.causal_lm(make(), "fusedattn-triton", eager.state_dict())
    ids, mask = models.padded_batch(8)
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
              cache_implementation="static")  # fmt: skip
    want = eager.generate(ids, **kw)
    graphs = []

    def recording(gm, example_inputs, **_options):  # generate passes its CompileConfig's mode
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    if how == "forward":
        ours.forward = torch.compile(ours.forward, fullgraph=True, backend=recording)
    else:
        config = transformers.CompileConfig(fullgraph=True, backend=recording)
        config._compile_all_devices = True  # generate compiles on CUDA only by default
        kw["compile_config"] = config
    got = ours.generate(ids, **kw)
    assert torch.equal(got, want)
    decode_graphs = [
        gm for gm in graphs
        if any(str(n.target) == "fusedattn.kvcache_attention" for n in gm.graph.nodes)
    ]  # fmt: skip
    assert decode_graphs, "no compiled graph holds the decode op"
    node = next(n for n in decode_graphs[0].graph.nodes
                if str(n.target) == "fusedattn.kvcache_attention")  # fmt: skip
    schema = torch.ops.fusedattn.kvcache_attention.default._schema
    backend_at = [a.name for a in schema.arguments].index("backend")
    assert node.args[backend_at] == "triton"


@pytest.mark.kernels
def test_a_compiled_decode_step_of_a_model_has_no_graph_break():
    """The decode step of a tiny Llama on fusedattn's Triton decode path: one graph, 0
    breaks (it broke at an import and at Triton's launcher binding on every layer)."""
    models = _generation_models()
    model = models.causal_lm(models.llama_config(), "fusedattn-triton")
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    ids = torch.randint(3, 100, (1, 4))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        step = dict(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True,
                    cache_position=torch.tensor([4]))  # fmt: skip
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model.forward)(**step)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
