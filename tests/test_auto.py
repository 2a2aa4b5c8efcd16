"""`auto`'s per-call routing from a measured table, checked on CPU with synthetic tables and
CSVs: the key of a call, the order it gives, refusals falling through, the generator's rules
(torch = the fastest SDPA backend, a margin, stale rows excluded), and that the key the
generator writes is the key a call with those shapes looks up."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from kx_check import attention_inputs

from fusedattn.masks import Window
from fusedattn.ops.core import auto, backends

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.device("cuda")


def qkv(D=128, T=4096, dtype=torch.bfloat16, grad=False):
    return [torch.randn(1, 2, T, D, dtype=dtype, requires_grad=grad) for _ in range(3)]


def test_call_keys_read_only_shapes_and_flags():
    q, k, v = qkv()
    kpm = torch.zeros(1, 4096, dtype=torch.bool)
    inputs = attention_inputs(q, k, v, key_padding_mask=kpm, window=Window(-1, 0))
    assert auto.call_key("attention", inputs) == (
        "fwd",
        "bfloat16",
        128,
        True,
        "key_padding",
        "<=4k",
    )
    # buckets at the measured 256, 512, 1k, 2k and 4k keys (issue #70), each its own row
    for T, bucket in ((200, "<=256"), (512, "<=512"), (1000, "<=1k"), (2048, "<=2k")):
        assert auto.call_key("attention", attention_inputs(*qkv(T=T)))[5] == bucket
    q, k, v = qkv(D=80, T=9000, grad=True)
    inputs = attention_inputs(q, k, v, attn_mask=torch.ones(9000, 9000, dtype=torch.bool))
    assert auto.call_key("attention", inputs) == ("fwd+bwd", "bfloat16", 128, False, "bool", ">4k")
    with torch.no_grad():  # no backward will run
        assert auto.call_key("attention", inputs)[0] == "fwd"
    for extra, kind in ((dict(softcap=5.0), "variant"), (dict(window=Window(128, 0)), "window"),
                        (dict(sinks=torch.zeros(2)), "variant")):  # fmt: skip
        assert auto.call_key("attention", attention_inputs(*qkv(), **extra))[4] == kind
    x = torch.randn(8, 4096)
    sm = dict(x=x, dim=1, mask=None, scale=None, is_causal=False)
    assert auto.call_key("softmax", sm) == ("fwd", "float32", "none", "<=4k")
    keep = torch.ones(8, 4096, dtype=torch.bool)
    assert auto.call_key("softmax", sm | dict(mask=keep)) == ("fwd", "float32", "bool", "<=4k")
    assert auto.call_key("softmax", sm | dict(mask=keep.float()))[2] == "other"
    assert auto.call_key("softmax", sm | dict(is_causal=True))[2] == "other"
    norm = dict(x=x, normalized_shape=(4096,), weight=None, eps=1e-5)
    assert auto.call_key("rms_norm", norm) == ("fwd", "float32", "<=4k")


@pytest.fixture
def table(monkeypatch):
    """A synthetic measured table for an sm_90 card, seen from this CPU machine."""
    table = {"sm_90": {"attention": {
        ("fwd", "bfloat16", 128, True, "key_padding", "<=4k"): ("triton", "torch"),
        ("fwd", "float32", 128, False, "none", "<=4k"): ("cuda", "torch"),
    }}}  # fmt: skip
    monkeypatch.setattr(auto, "TABLE", table)
    monkeypatch.setattr(auto, "capability", lambda index: "sm_90")
    return table


def test_measured_buckets_lead_and_the_rest_keep_the_default_order(table, monkeypatch):
    kpm = torch.zeros(1, 4096, dtype=torch.bool)
    hit = attention_inputs(*qkv(), key_padding_mask=kpm, window=Window(-1, 0))
    assert backends.auto_order("attention", CUDA, hit) == ("triton", "torch", "cuda", "reference")
    miss = attention_inputs(*qkv(D=64), key_padding_mask=kpm, window=Window(-1, 0))
    assert backends.auto_order("attention", CUDA, miss) == backends.AUTO_ORDER["cuda"]["attention"]
    assert backends.auto_order("attention", torch.device("cpu"), hit) == ("torch", "reference")
    monkeypatch.setattr(auto, "capability", lambda index: "sm_80")  # a card never measured
    assert backends.auto_order("attention", CUDA, hit) == backends.AUTO_ORDER["cuda"]["attention"]


def test_fp8_calls_try_triton_first_on_a_gpu(table):
    """torch has no fp8 attention (its backend dequantizes to float32): an fp8 forward or
    paged prefill leads with Triton on a GPU until a benchmark row says otherwise; on the
    CPU the default order stays."""
    q, k, v = (t.to(torch.float8_e4m3fn) for t in qkv())
    inputs = attention_inputs(q, k, v)
    assert backends.auto_order("attention", CUDA, inputs)[0] == "triton"
    assert backends.auto_order("attention", torch.device("cpu"), inputs) == ("torch", "reference")
    cuda = backends.refusals("attention", "cuda", CUDA, inputs)
    assert any("no fp8 path" in reason for reason in cuda)


def test_a_measured_backend_that_refuses_the_call_falls_through(table):
    # cuda is measured first for this fp32 bucket, but refuses fp32: auto takes torch
    inputs = attention_inputs(*qkv(dtype=torch.float32))
    assert backends.auto_order("attention", CUDA, inputs)[0] == "cuda"
    assert backends.select("attention", "auto", CUDA, inputs).backend == "torch"


def test_routing_traces_without_graph_breaks(table):
    torch._dynamo.reset()
    q = torch.randn(1, 2, 16, 128, dtype=torch.bfloat16)
    kpm = torch.zeros(1, 16, dtype=torch.bool)

    def f(q):
        inputs = attention_inputs(q, q, q, key_padding_mask=kpm, window=Window(-1, 0))
        return torch.tensor(len(backends.auto_order("attention", CUDA, inputs))) + q.sum()

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q), f(q))


# ---- the generator ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def generator():
    spec = importlib.util.spec_from_file_location(
        "build_auto_table", ROOT / "scripts/build_auto_table.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_auto_table"] = module
    spec.loader.exec_module(module)
    return module


def write_rows(path, rows):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import harness

    env = {"device": "NVIDIA H200"}
    harness.write_csv([harness.make_row(env, **r) for r in rows], path / "attention.csv")


def case(impl, ms, mode="fwd", mask="key_padding", causal=True, D=128, T=4096, ok="yes"):
    return dict(op="attention", mode=mode, impl=impl, dtype="bfloat16", B=4, H=16, Tq=T, Tk=T,
                D=D, causal=causal, mask=mask, ms=ms, **{"pass": ok})  # fmt: skip


def test_generator_orders_by_speed_against_fusedattns_torch_backend_with_a_margin(
    generator, tmp_path
):
    """torch is fusedattn's torch backend as a call reaches it (fusedattn-torch rows), not a
    pinned SDPA backend on a pre-merged mask: SDPA rows order nothing (issue #70)."""
    write_rows(tmp_path, [
        case("fusedattn-torch", 1.5), case("sdpa-efficient", 0.5), case("sdpa-math", 9.0),
        case("fusedattn-triton", 1.0), case("fusedattn-cuda", 1.48),  # within the 3% margin
        case("naive", 20.0),
        case("fusedattn-torch", 1.0, mask="none"), case("fusedattn-triton", 0.5, mask="none", ok="no: wrong"),
        case("fusedattn-torch", 1.0, mode="bwd"), case("fusedattn-triton", 0.1, mode="bwd"),
        # softcap rows: no call has that kind (auto keys softcap calls as "variant"): no key
        case("fusedattn-torch", 1.0, mask="softcap"), case("fusedattn-triton", 0.1, mask="softcap"),
        # a key where only SDPA was timed: not decided (the default order serves it)
        case("sdpa-flash", 2.0, T=512), case("fusedattn-triton", 1.0, T=512),
    ])  # fmt: skip
    table = generator.build([tmp_path], set(), 0.03)
    keys = table["sm_90"]["attention"]
    assert keys[("fwd", "bfloat16", 128, True, "key_padding", "<=4k")] == ("triton", "torch")
    assert keys[("fwd", "bfloat16", 128, True, "none", "<=4k")] == (
        "torch",
    )  # failed rows do not count
    assert not any(k[0] == "bwd" for k in keys)  # auto never asks for bwd alone
    assert not any(k[4] == "softcap" for k in keys)
    assert not any(k[5] == "<=512" for k in keys)
    stale = generator.build([tmp_path], {("fusedattn-triton", "attention")}, 0.03)
    assert stale["sm_90"]["attention"][("fwd", "bfloat16", 128, True, "key_padding", "<=4k")] == (
        "torch",
    )
    text = generator.render(table, ["x"], {("fusedattn-triton", "attention")}, 0.03)
    namespace = {}
    exec(compile(text, "auto_table.py", "exec"), namespace)  # the written module loads
    assert (
        namespace["TABLE"] == table and "1 keys put a fusedattn kernel ahead" in namespace["SOURCE"]
    )


def test_a_generated_key_is_the_key_of_a_call_with_those_shapes(generator, tmp_path, monkeypatch):
    write_rows(tmp_path, [case("fusedattn-torch", 2.0), case("fusedattn-cuda", 1.0)])
    monkeypatch.setattr(auto, "TABLE", generator.build([tmp_path], set(), 0.03))
    monkeypatch.setattr(auto, "capability", lambda index: "sm_90")
    q, k, v = qkv(T=4096)
    kpm = torch.zeros(1, 4096, dtype=torch.bool)
    inputs = attention_inputs(q, k, v, key_padding_mask=kpm, window=Window(-1, 0))
    assert backends.auto_order("attention", CUDA, inputs)[:2] == ("cuda", "torch")


def test_the_committed_table_is_what_the_committed_results_give(generator):
    """auto_table.py is regenerated whenever results change: rebuilding it from its own
    sources and exclusions gives the same table."""
    source = auto.TABLE_SOURCE
    folders = [ROOT / s.strip() for s in source.split(" (")[0].split(",")] if source else []
    exclude = set()
    if "excluded as stale: none" not in source and source:
        stale = source.split("excluded as stale: ")[1].split(";")[0]
        exclude = {tuple(x.strip().rstrip(")").split(" (")) for x in stale.split(",")}
    bound = generator.SDPA_BOUND_NOTE in source
    assert generator.build(folders, exclude, 0.03, bound) == auto.TABLE


def test_the_sdpa_bound_stands_in_for_torch_only_where_no_fusedattn_torch_row_is(
    generator, tmp_path
):
    write_rows(tmp_path, [
        case("sdpa-cudnn", 2.0), case("sdpa-flash", 1.2), case("fusedattn-triton", 1.0),
        case("fusedattn-torch", 0.9, T=512), case("sdpa-flash", 0.5, T=512),
        case("fusedattn-triton", 0.7, T=512),
    ])  # fmt: skip
    keys = generator.build([tmp_path], set(), 0.03, sdpa_bound=True)["sm_90"]["attention"]
    assert keys[("fwd", "bfloat16", 128, True, "key_padding", "<=4k")] == ("triton", "torch")
    assert keys[("fwd", "bfloat16", 128, True, "key_padding", "<=512")] == ("triton", "torch")
    assert generator.SDPA_BOUND_NOTE in generator.render({}, ["x"], set(), 0.03, True)


def test_info_prints_the_table_in_force():
    import fusedattn.info as info

    text = info.auto_table_text()
    assert text.startswith("auto: ") and "other calls: cuda: torch > triton" in text
    if auto.TABLE:  # each op's rows under a header naming the key's fields
        assert "mode  " in text and "backends, fastest first" in text


# ---- decoding (attention_with_kvcache) -------------------------------------------------------


def decode_inputs(B=1, S=4096, Tq=1, page=None, **kw):
    """The inputs dict the public attention_with_kvcache hands to dispatch (captured there)."""
    import fusedattn

    captured = {}

    def capture(op, backend, device, inputs):
        captured.update(inputs)
        raise StopIteration

    q = torch.randn(B, Tq, 4, 64, dtype=torch.bfloat16)
    if page is None:
        k_cache, table = torch.randn(B, S, 2, 64, dtype=torch.bfloat16), None
    else:
        k_cache = torch.randn(B * S // page, page, 2, 64, dtype=torch.bfloat16)
        table = torch.arange(B * S // page, dtype=torch.int32).view(B, -1)
    with pytest.MonkeyPatch.context() as patch, pytest.raises(StopIteration):
        patch.setattr(backends, "select", capture)
        fusedattn.attention_with_kvcache(q, k_cache, k_cache, cache_seqlens=S // 2,
                                         block_table=table, **kw)  # fmt: skip
    return captured


def test_decode_call_keys_read_only_shapes():
    key = auto.call_key("attention_with_kvcache", decode_inputs())
    assert key == ("fwd", "bfloat16", 64, "contiguous", "1", "1", "<=8k", "plain")
    # a paged cache's capacity is pages per sequence x page size; Tq > 1 is bottom-right causal
    paged = decode_inputs(B=8, S=32768, Tq=4, page=256, is_causal=True)
    assert auto.call_key("attention_with_kvcache", paged) == (
        "fwd", "bfloat16", 64, "paged", ">1", "<=8", "<=32k", "plain",
    )  # fmt: skip
    big = decode_inputs(B=64, S=65536, page=16)
    assert auto.call_key("attention_with_kvcache", big)[5:7] == (">8", ">32k")
    for extra in (dict(softcap=30.0), dict(sinks=torch.zeros(4)), dict(window_size=(128, 0)),
                  dict(alibi_slopes=torch.ones(4))):  # fmt: skip
        inputs = decode_inputs(**extra)
        assert auto.call_key("attention_with_kvcache", inputs)[-1] == "variant", extra


def decode_case(impl, ms, B=1, L=32768, Tq=1, layout="contiguous", ok="yes"):
    return dict(op="decode", mode="fwd", impl=impl, dtype="bfloat16", B=B, H=32, Tq=Tq, Tk=L,
                D=64, causal=Tq > 1, mask=layout, ms=ms, **{"pass": ok})  # fmt: skip


def test_generator_orders_decode_against_fusedattns_torch_backend(generator, tmp_path):
    """On a decode, auto's torch backend is fusedattn-torch (gather + masked SDPA): the SDPA,
    naive, prefill, Flex and FlashInfer rows time a dense cache and order nothing."""
    write_rows(tmp_path, [
        decode_case("fusedattn-torch", 1.0), decode_case("fusedattn-triton", 0.4),
        decode_case("sdpa-flash", 0.1), decode_case("fusedattn-triton-prefill", 0.05),
        decode_case("flashinfer", 0.05), decode_case("naive", 9.0),
        # paged16 and paged256 share the "paged" bucket: medians over both
        decode_case("fusedattn-torch", 2.0, layout="paged16"),
        decode_case("fusedattn-triton", 2.5, layout="paged16"),
        decode_case("fusedattn-torch", 2.0, layout="paged256"),
        decode_case("fusedattn-triton", 2.5, layout="paged256"),
        # B=8 Tq=4: torch faster; a failed Triton row does not count
        decode_case("fusedattn-torch", 1.0, B=8, Tq=4), decode_case("fusedattn-triton", 0.9, B=8, Tq=4),
        decode_case("fusedattn-torch", 1.0, B=64), decode_case("fusedattn-triton", 0.1, B=64, ok="no: wrong"),
        # no fusedattn-torch row: nothing to decide, however fast SDPA was
        decode_case("sdpa-flash", 1.0, L=1024), decode_case("fusedattn-triton", 0.5, L=1024),
    ])  # fmt: skip
    keys = generator.build([tmp_path], set(), 0.03)["sm_90"]["attention_with_kvcache"]
    key = ("fwd", "bfloat16", 64, "contiguous", "1", "1", "<=32k", "plain")
    assert keys == {
        key: ("triton", "torch"),
        (*key[:3], "paged", *key[4:]): ("torch",),
        (*key[:4], ">1", "<=8", *key[6:]): ("triton", "torch"),
        (*key[:5], ">8", *key[6:]): ("torch",),
    }


def test_a_generated_decode_key_is_the_key_of_a_decode_call(generator, tmp_path, monkeypatch):
    write_rows(tmp_path, [decode_case("fusedattn-torch", 0.5, L=4096),
                          decode_case("fusedattn-triton", 1.0, L=4096)])  # fmt: skip
    monkeypatch.setattr(auto, "TABLE", generator.build([tmp_path], set(), 0.03))
    monkeypatch.setattr(auto, "capability", lambda index: "sm_90")
    order = backends.auto_order("attention_with_kvcache", CUDA, decode_inputs(S=4096))
    assert order == ("torch", "triton", "reference")
    # a call in a bucket never measured keeps the default order (Triton first on a GPU)
    other = backends.auto_order("attention_with_kvcache", CUDA, decode_inputs(S=4096, softcap=30.0))
    default = backends.AUTO_ORDER["cuda"]["attention_with_kvcache"]
    assert other == default and default[0] == "triton"


def test_decode_routing_traces_without_graph_breaks(table):
    torch._dynamo.reset()
    inputs = decode_inputs(page=16)

    def f(q):
        order = backends.auto_order("attention_with_kvcache", CUDA, inputs | dict(q=q))
        return torch.tensor(len(order)) + q.sum()

    q = inputs["q"]
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="eager")(q), f(q))
