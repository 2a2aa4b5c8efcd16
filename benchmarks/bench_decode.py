"""Decoding over a KV cache: fusedattn.attention_with_kvcache against SDPA, the naive path,
FlexAttention's decoding path, fusedattn's own prefill kernel and FlashInfer, in GB/s of K/V
read and % of the copy bandwidth measured in the same run (issue #32).

    python benchmarks/bench_decode.py [--quick] [--out DIR]

Llama-3-8B's attention heads (Hq 32, Hkv 8, D 128), bf16; batch 1, 8 and 64; caches of 1k to
128k keys (what fits); contiguous and paged caches (page 16 as vLLM, 256 as Hugging Face);
one new query (plain decoding) and four (speculative decoding, bottom-right causal). Decoding
is memory-bound: the floor is reading each sequence's K/V once, B·L·Hkv·(D + Dv)·2 bytes, at
the copy rate. The baselines read a contiguous (B, Hkv, L, D) cache (what SDPA takes): the SDPA
backends one at a time, the naive path (small caches), FlexAttention under torch.compile with a
length mask (where it compiles), fusedattn's prefill kernel with bottom-right causal, and
FlashInfer's decode wrapper where it is installed (skipped with a line where not). Paged rows
time fusedattn's kernels and its torch backend (which gathers the pages). The last rows time
`generate` (tokens/s) of a 2-layer model with Llama-3-8B's layer shapes and random weights,
attn_implementation "fusedattn" against "sdpa". On a GPU, "-graph" rows replay
fusedattn's decode kernel and SDPA's flash and cuDNN backends from a CUDA graph (the kernels'
time without the host's, as a serving stack runs a step).

op is "decode" (mask = the cache layout: contiguous, paged16, paged256) or "generate"; Tk is
the cache length; the CSV's ms is per call.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools

import harness
import torch

import fusedattn
from fusedattn import reference

HQ, HKV, D = 32, 8, 128


def cases(quick: bool, device: torch.device) -> list[tuple[int, int, int, str]]:
    """(B, L, Tq, layout)."""
    if device.type != "cuda":
        return [(2, 256, 1, "contiguous"), (2, 256, 4, "contiguous"), (2, 256, 1, "paged16")]
    lengths = (8192, 32768) if quick else (1024, 8192, 32768, 131072)
    out = []
    for B in (1, 8, 64):
        for L in lengths:
            if B * L * HKV * D * 2 * 2 > 24 * 2**30:  # 24 GB of K/V: the baselines need more
                continue
            out.append((B, L, 1, "contiguous"))
            if not quick or L == 32768:
                out += [(B, L, 1, "paged16"), (B, L, 1, "paged256"), (B, L, 4, "contiguous")]
    return out


def make_cache(B, L, layout, device, dtype, heads=HKV, dim=D):
    """(k_cache, v_cache, block_table): every sequence L keys long; a paged cache's pages in
    a shuffled order (a real pool is fragmented)."""
    if layout == "contiguous":
        k = torch.randn(B, L, heads, dim, device=device, dtype=dtype)
        return k, torch.randn_like(k), None
    page = int(layout.removeprefix("paged"))
    pages = B * -(-L // page)
    order = torch.randperm(pages, device=device).to(torch.int32)
    k = torch.randn(pages, page, heads, dim, device=device, dtype=dtype)
    return k, torch.randn_like(k), order.view(B, -1)


def dense(k_cache, block_table, B, L):
    """(B, Hkv, L, D) contiguous copy of the cache, for the baselines."""
    if block_table is None:
        return k_cache[:B, :L].transpose(1, 2).contiguous()
    return k_cache[block_table.long()].flatten(1, 2)[:, :L].transpose(1, 2).contiguous()


def baselines(q, k, v, Tq, device, quick=False) -> dict:
    """{impl: fn()} over the dense (B, Hkv, L, D) cache, each giving (B, Tq, Hq, Dv): SDPA's
    backends, naive, Flex, FlashInfer, fusedattn's prefill kernel. Flex compiles per shape
    (tens of seconds): --quick times it at batch 1 and one new query only."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    L = k.shape[2]
    qh = q.transpose(1, 2)  # (B, Hq, Tq, D)
    mask = None
    if Tq > 1:  # bottom-right causal: SDPA's is_causal is top-left
        mask = torch.ones(Tq, L, dtype=torch.bool, device=device).tril(L - Tq)
    impls = {}

    def sdpa(backend):
        def run():
            with sdpa_kernel(backend):
                out = torch.nn.functional.scaled_dot_product_attention(
                    qh, k, v, attn_mask=mask, enable_gqa=True
                )
            return out.transpose(1, 2)

        return run

    if device.type == "cuda":
        for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
            impls[f"sdpa-{name.split('_')[0].lower()}"] = sdpa(getattr(SDPBackend, name))
    else:
        impls["sdpa"] = sdpa(SDPBackend.MATH)
    if L <= 8192:
        impls["naive"] = lambda: reference.attention(
            qh, k, v, is_causal=Tq > 1, enable_gqa=True, causal_alignment="bottom_right"
        ).transpose(1, 2)
    for backend in harness.kernel_backends("attention", device):
        impls[f"fusedattn-{backend}-prefill"] = lambda b=backend: fusedattn.attention(
            qh, k, v, is_causal=Tq > 1, enable_gqa=True, causal_alignment="bottom_right",
            backend=b,
        ).transpose(1, 2)  # fmt: skip
    if device.type == "cuda" and (not quick or (q.shape[0] == 1 and Tq == 1)):
        flex = flex_decoding(qh, k, v, Tq)
        if flex is not None:
            impls["flex-compiled"] = flex
        infer = flashinfer_decode(q, k, v, Tq)
        if infer is not None:
            impls["flashinfer"] = infer
    return impls


GRAPHED = ("fusedattn-triton", "sdpa-flash", "sdpa-cudnn")  # the "-graph" rows


def graphed(impls: dict, B, L, Tq, layout) -> dict:
    """ "<impl>-graph": fusedattn's decode kernel and SDPA's fastest backends replayed from a
    CUDA graph, as serving stacks run a decode step: the kernels' time without the host's
    (at batch 1 the eager calls are bound by host time per call). Impls that fail to run or
    to capture are left out with a line."""
    out = {}
    for name in GRAPHED:
        if name not in impls:
            continue
        try:
            with torch.inference_mode():
                impls[name]()  # eager first: a refusal is not a capture failure
                out[f"{name}-graph"] = harness.cuda_graph(impls[name])
        except (RuntimeError, ValueError) as exc:
            print(f"  decode {name}-graph: not run for B={B} L={L} Tq={Tq} {layout}: "
                  f"{str(exc).splitlines()[0][:100]}")  # fmt: skip
    return out


def flex_decoding(qh, k, v, Tq):
    """FlexAttention under torch.compile (its decoding kernel for short query blocks), or None
    with the reason printed."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        L = k.shape[2]

        def bottom_right(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + (L - Tq)

        block_mask = create_block_mask(bottom_right, None, None, Tq, L, device=qh.device)
        compiled = torch.compile(flex_attention)

        def run():
            return compiled(qh, k, v, block_mask=block_mask, enable_gqa=True).transpose(1, 2)

        run()
        return run
    except Exception as exc:  # a baseline that does not run is reported, not fatal
        print(f"  decode flex-compiled: not run: {str(exc).splitlines()[0][:120]}")
        return None


def flashinfer_decode(q, k, v, Tq):
    """FlashInfer's single-request decode per sequence where it is installed; None (said once)
    where not."""
    if importlib.util.find_spec("flashinfer") is None:
        if not getattr(flashinfer_decode, "said", False):
            print("  decode flashinfer: not installed on this machine: skipped")
            flashinfer_decode.said = True
        return None
    if Tq != 1 or q.shape[0] != 1:
        return None
    try:
        import flashinfer

        kh, vh = k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()  # (L, H, D)

        def run():
            return flashinfer.single_decode_with_kv_cache(q[0, 0], kh, vh)[None, None]

        run()
        return run
    except Exception as exc:  # as above
        print(f"  decode flashinfer: not run: {str(exc).splitlines()[0][:120]}")
        return None


def decode_rows(quick, device, env) -> list[dict]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    heads, dim = (HKV, D) if device.type == "cuda" else (2, 64)
    hq = HQ if device.type == "cuda" else 4
    backends = ["torch", *harness.kernel_backends("attention_with_kvcache", device)]
    rows = []
    for B, L, Tq, layout in cases(quick, device):
        torch.manual_seed(0)
        k_cache, v_cache, table = make_cache(B, L, layout, device, dtype, heads, dim)
        q = torch.randn(B, Tq, hq, dim, device=device, dtype=dtype)
        kv_bytes = B * L * heads * 2 * dim * k_cache.element_size()
        kw = dict(cache_seqlens=L, block_table=table, is_causal=Tq > 1)
        impls = {
            f"fusedattn-{b}": functools.partial(
                fusedattn.attention_with_kvcache, q, k_cache, v_cache, backend=b, **kw
            )
            for b in backends
        }
        if layout == "contiguous":
            k, v = dense(k_cache, table, B, L), dense(v_cache, table, B, L)
            impls |= baselines(q, k, v, Tq, device, quick)
        if device.type == "cuda":
            impls |= graphed(impls, B, L, Tq, layout)
        first = dict(q=q[:1], k=k_cache, v=v_cache, table=None if table is None else table[:1])
        with torch.inference_mode():
            truth = reference.attention_with_kvcache(
                first["q"].double(), *(dense_first(first, L, dtype=torch.float64)),
                cache_seqlens=L, is_causal=Tq > 1,
            )  # fmt: skip
            base = reference.attention_with_kvcache(
                first["q"], *dense_first(first, L), cache_seqlens=L, is_causal=Tq > 1
            )
        fields = dict(op="decode", mode="fwd", dtype=str(dtype)[6:], B=B, H=hq, Tq=Tq, Tk=L,
                      D=dim, causal=Tq > 1, mask=layout)  # fmt: skip
        for name, fn in impls.items():
            try:
                with torch.inference_mode():
                    out = fn()
                    verdict = harness.correctness(out[:1], truth, base)
                    ms, spread = harness.time_stats(fn, device=device)
            except (RuntimeError, ValueError) as exc:  # e.g. SDPA flash refuses a mask
                print(f"  decode {name}: not run for B={B} L={L} Tq={Tq} {layout}: "
                      f"{str(exc).splitlines()[0][:100]}")  # fmt: skip
                continue
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                rows.append(harness.make_row(env, impl=name, note="out of memory", **fields))
                harness.stream(rows[-1])
                continue
            speed = harness.gbps(kv_bytes, ms)
            copy = env.get("copy_gbps")
            row = harness.make_row(
                env, impl=name, ms=ms, gbps=speed, spread=spread,
                pct_of_copy=100.0 * speed / copy if copy else None,
                note=harness.noisy(spread).lstrip("; ") or None, **fields, **{"pass": verdict},
            )  # fmt: skip
            harness.progress(row)
            rows.append(row)
        del k_cache, v_cache, impls
        if device.type == "cuda":
            torch.cuda.empty_cache()
    harness.add_speedups(rows)
    return rows


def dense_first(first, L, dtype=None):
    """The first sequence's (k, v) cache as a contiguous (1, L, Hkv, D) pair."""
    pair = []
    for cache in (first["k"], first["v"]):
        t = dense(cache, first["table"], 1, L).transpose(1, 2)
        pair.append(t if dtype is None else t.to(dtype))
    return pair


def generate_rows(quick, device, env) -> list[dict]:
    """tokens/s of greedy generation, 2 layers with Llama-3-8B's layer shapes (random weights):
    fusedattn's integration against SDPA."""
    import transformers

    import fusedattn.integrations.huggingface as fa_hf

    fa_hf.register()
    on_gpu = device.type == "cuda"
    config = transformers.LlamaConfig(
        vocab_size=128256 if on_gpu else 1000, hidden_size=4096 if on_gpu else 128,
        intermediate_size=14336 if on_gpu else 256, num_hidden_layers=2,
        num_attention_heads=HQ if on_gpu else 4, num_key_value_heads=HKV if on_gpu else 2,
        max_position_embeddings=8192, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    dtype = torch.bfloat16 if on_gpu else torch.float32
    B, prompt, new = (8, 2048, 128) if on_gpu and not quick else (2, 64, 16)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device, dtype).eval()
    ids = torch.randint(3, config.vocab_size, (B, prompt), device=device)
    rows = []
    for (impl, attn), static in itertools.product(GENERATE_IMPLS, (False, True)):
        model.set_attn_implementation(attn)
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        name = impl
        if static:  # the static cache with the forward compiled, as generate does on CUDA
            kw |= dict(cache_implementation="static", compile_config=compile_config(on_gpu))
            name += "-static-compiled"
        torch._dynamo.reset()

        def run(kw=kw):
            with torch.inference_mode():
                return model.generate(ids, **kw)

        ms, spread = harness.time_stats(run, device=device, reps=3)
        row = harness.make_row(
            env, op="generate", mode="infer", impl=name, dtype=str(dtype)[6:], B=B,
            H=config.num_attention_heads, Tq=new, Tk=prompt + new,
            D=config.hidden_size // config.num_attention_heads, ms=ms,
            tokens_per_s=B * new / (ms * 1e-3), spread=spread,
            note=harness.noisy(spread).lstrip("; ") or None,
        )  # fmt: skip
        harness.progress(row)
        rows.append(row)
    return rows


GENERATE_IMPLS = (("sdpa", "sdpa"), ("fusedattn", "fusedattn"))  # (row name, attn_implementation)


def compile_config(on_gpu: bool):
    """generate's own compile of static-cache decoding: on a GPU mode="reduce-overhead" (CUDA
    graphs, what generate uses there by default) with fullgraph; on a CPU the same trace with
    dynamo's eager backend, a smoke form of the row (no timing meaning)."""
    import transformers

    if on_gpu:
        return transformers.CompileConfig(fullgraph=True, mode="reduce-overhead")
    config = transformers.CompileConfig(fullgraph=True, backend="eager")
    config._compile_all_devices = True
    return config


def run(quick: bool, device: torch.device, env: dict) -> list[dict]:
    return decode_rows(quick, device, env) + generate_rows(quick, device, env)


def plot(rows: list[dict], path):
    """GB/s of K/V read against the cache length, a line per impl, a panel per (batch, new
    queries, layout), the copy bandwidth as a ceiling."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (matplotlib not installed: no plots)")
        return None
    rows = [r for r in rows if r["op"] == "decode" and r["gbps"] != ""]
    panels = sorted({(int(r["B"]), int(r["Tq"]), r["mask"]) for r in rows})
    if not panels:
        return None
    cols = min(3, len(panels))
    fig, axes = plt.subplots(-(-len(panels) // cols), cols, figsize=(5 * cols, 3.4 * -(-len(panels) // cols)),
                             squeeze=False)  # fmt: skip
    for ax, (B, Tq, layout) in zip(axes.flat, panels, strict=False):
        mine = [r for r in rows if (int(r["B"]), int(r["Tq"]), r["mask"]) == (B, Tq, layout)]
        for impl in sorted({r["impl"] for r in mine}):
            pts = sorted((int(r["Tk"]), float(r["gbps"])) for r in mine if r["impl"] == impl)
            ax.plot(*zip(*pts, strict=True), marker="o", label=impl)
        copy = next((float(r["gbps"]) * 100 / float(r["pct_of_copy"]) for r in mine
                     if r["pct_of_copy"] not in ("", "0", "0.0")), None)  # fmt: skip
        if copy:
            ax.axhline(copy, color="gray", linestyle="--", label="copy")
        ax.set_xscale("log", base=2)
        ax.set_title(f"B={B} Tq={Tq} {layout}", fontsize=9)
        ax.set_xlabel("cache length")
        ax.set_ylabel("GB/s of K/V")
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"decode, {rows[0]['device']}, {rows[0]['dtype']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    harness.cli(run, "decode.csv")
