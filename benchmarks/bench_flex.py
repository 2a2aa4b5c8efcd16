"""Block masks and score_mods against FlexAttention (issues #71, #84): document masks and
prefix-LM at T = 8k, 16k and 32k (D = 128, Hq = Hkv = 16, B = 1, bf16), forward and
forward+backward, each row timed against the same mask under

- `flex`: torch's flex_attention compiled (its Triton kernel; the compile done before timing),
- `fusedattn-varlen`: fusedattn.varlen_attention over the same documents, causal (document
  masks only: the packed path, the bar the block mask must stay within 10 % of),
- `fusedattn-causal`: is_causal=True (the causal block mask only: within 5 %),

and `create_block_mask` at 128k: fusedattn's (eager, chunked) and torch's (compiled, on the
GPU), seconds and peak memory. Targets (issue #71): block masks >= 1.2x Flex.

score_mods (op `score-mod`, causal, B = 2, T = 4k and 16k; 8k with --quick): softcap, ALiBi
and a relative-position bias as mods, and the bias table learnable (its gradient in the
fwd+bwd rows), under fusedattn (is_causal, and Flex's causal block mask), Flex compiled, and
fusedattn's built-in softcap= / alibi_slopes= where one equals the mod; and the seconds of a
new mod's first forward+backward. Targets (issue #84): pointwise mods >= Flex compiled,
learnable tables within 1.1x of it, a mod equal to a built-in within 5 % of the built-in, a
new mod's first call within 10 s.

On a CPU the kernels are not timed (the interpreter's speed means nothing): the CPU run builds
the 128k document mask (the time and memory this machine gives) and runs one small block-mask
call of each pattern through the dense path, so CI runs the script's structure.

    python benchmarks/bench_flex.py [--quick] [--out DIR]
"""

from __future__ import annotations

import resource
import time

import harness
import torch

import fusedattn
from fusedattn.masks import create_block_mask


def documents(T: int, n: int, device) -> torch.Tensor:
    """Document ids of T tokens in n documents of uneven lengths (fixed seed)."""
    g = torch.Generator().manual_seed(n)
    cuts = torch.randperm(T - 1, generator=g)[: n - 1].add(1).sort().values
    return torch.bucketize(torch.arange(T), cuts, right=True).to(device)


def mask_mods(T: int, device) -> dict:
    mods = {}
    for n in (4, 16):
        doc = documents(T, n, device)
        mods[f"document causal, {n} docs"] = (
            lambda b, h, q, kv, doc=doc: (doc[q] == doc[kv]) & (q >= kv),
            doc,
        )
    prefix = T // 4
    mods["prefix-LM, prefix T/4"] = (lambda b, h, q, kv: (kv <= q) | (kv < prefix), None)
    mods["causal"] = (lambda b, h, q, kv: q >= kv, None)
    return mods  # fmt: skip


def build_rows(env, device, T=131072) -> list[dict]:
    """create_block_mask over T tokens, 16 documents: fusedattn's, and torch's compiled one on a
    GPU. Seconds and the peak memory it added (RSS on a CPU, CUDA's allocator on a GPU)."""
    doc = documents(T, 16, device)

    def mask_mod(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    builders = {"fusedattn": lambda: create_block_mask(mask_mod, None, None, T, T, device=device)}
    if device.type == "cuda":
        from torch.nn.attention.flex_attention import create_block_mask as torch_create

        builders["flex"] = lambda: torch_create(mask_mod, None, None, T, T, device=device,
                                                _compile=True)  # fmt: skip
    rows = []
    for impl, build in builders.items():
        if device.type == "cuda":
            build()  # the compile, and the allocator's first pass
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        start = time.perf_counter()
        bm = build()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        if device.type == "cuda":
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
        del bm
        rows.append(harness.make_row(
            env, op="create_block_mask", mode="build", impl=impl, B=1, H=1, Tq=T, Tk=T,
            mask="document causal, 16 docs", ms=seconds * 1e3, peak_mem_mb=peak,
            note=f"{seconds:.1f} s; peak extra memory {peak:.0f} MiB (dense bool: "
                 f"{T * T / 2**30:.0f} GiB)",
        ))  # fmt: skip
        harness.progress(rows[-1])
    return rows


def time_impls(impls: dict, qkv, mode: str, device, name: str) -> dict:
    """{impl: median ms} of each impl(leaves) on fresh leaves of q, k, v (fwd+bwd: with the
    backward of ones); an impl that raises (a compile failure) is reported and left out."""
    leaves = [t.detach().requires_grad_(mode != "fwd") for t in qkv]
    times = {}
    for impl, fn in impls.items():

        def call(fn=fn):
            out = fn(leaves)
            if mode != "fwd":
                out.backward(torch.ones_like(out))

        try:
            times[impl] = harness.time_ms(call, device=device)
        except Exception as exc:  # a compile failure reads as the impl refusing the case
            print(f"  {impl} {name} {mode}: {type(exc).__name__}: {str(exc)[:200]}")
    return times


def attention_rows(env, device, T: int) -> list[dict]:
    from torch.nn.attention.flex_attention import create_block_mask as torch_create
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    H, D = 16, 128
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, H, T, D, device=device, dtype=torch.bfloat16, generator=g)
               for _ in range(3))  # fmt: skip
    rows = []
    for name, (mask_mod, doc) in mask_mods(T, device).items():
        ours = create_block_mask(mask_mod, None, None, T, T, device=device)
        theirs = torch_create(mask_mod, None, None, T, T, device=device)
        impls = {
            "fusedattn": lambda leaves, bm=ours: fusedattn.attention(*leaves, block_mask=bm),
            "flex": lambda leaves, bm=theirs: flex(*leaves, block_mask=bm),
        }
        if doc is not None:
            lengths = torch.bincount(doc)
            cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
            longest = int(lengths.max())

            def varlen(leaves, cu=cu, longest=longest):
                packed = [t[0].transpose(0, 1) for t in leaves]  # (T, H, D)
                out = fusedattn.varlen_attention(*packed, cu, cu, longest, longest, is_causal=True)
                return out.transpose(0, 1)[None]

            impls["fusedattn-varlen"] = varlen
        if name == "causal":
            impls["fusedattn-causal"] = lambda leaves: fusedattn.attention(*leaves, is_causal=True)
        visible = ours.dense_mask().sum().item() if T <= 16384 else None
        for mode in ("fwd", "fwd+bwd"):
            times = time_impls(impls, (q, k, v), mode, device, name)
            for impl, ms in times.items():
                flops = None
                if visible is not None:  # the FLOPs of the visible scores only
                    flops = 4.0 * H * visible * D * {"fwd": 1.0, "fwd+bwd": 3.5}[mode]
                note = f"{times['flex'] / ms:.2f}x flex" if "flex" in times else "flex failed"
                if impl == "fusedattn" and "fusedattn-varlen" in times:
                    note += f"; {times['fusedattn-varlen'] / ms:.2f}x varlen"
                if impl == "fusedattn" and "fusedattn-causal" in times:
                    note += f"; {times['fusedattn-causal'] / ms:.2f}x is_causal"
                rows.append(harness.make_row(
                    env, op="block-mask", mode=mode, impl=impl, dtype="bfloat16", B=1, H=H,
                    Tq=T, Tk=T, D=D, causal=name == "causal", mask=name, ms=ms,
                    tflops=harness.tflops(flops, ms) if flops else None, note=note,
                ))  # fmt: skip
                harness.progress(rows[-1])
    return rows


def score_mods(T: int, H: int, device, learnable: bool = False) -> dict:
    """{name: (score_mod, fusedattn's built-in keywords or None)} at sequence length T: softcap
    and ALiBi as mods (each equals a built-in), a relative-position bias (a gather) and, with
    learnable, the same table wanting its gradient."""
    slopes = torch.exp2(-8.0 * torch.arange(1, H + 1, device=device) / H)
    table = torch.randn(H, 2 * T - 1, device=device) * 0.1
    mods = {
        "softcap 30": (lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0), dict(softcap=30.0)),
        "alibi": (lambda s, b, h, q, kv: s - slopes[h] * (q - kv), dict(alibi_slopes=slopes)),
        "relative bias": (lambda s, b, h, q, kv: s + table[h, q - kv + T - 1], None),
    }
    if learnable:
        learned = table.clone().requires_grad_()
        mods["learnable relative bias"] = (
            lambda s, b, h, q, kv: s + learned[h, q - kv + T - 1], None
        )  # fmt: skip
    return mods


def score_mod_rows(env, device, T: int, B: int = 2) -> list[dict]:
    """score_mods (issue #84), causal, D = 128, Hq = Hkv = 16, bf16, forward and fwd+bwd:
    fusedattn's kernels with the mod (is_causal; and with Flex's causal block mask) against
    Flex compiled with the same mod and mask, and against fusedattn's built-in term where one
    equals the mod. Targets: pointwise mods >= Flex, a learnable table within 1.1x of it, a
    mod equal to a built-in within 5 % of the built-in."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create
    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    H, D = 16, 128
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device=device, dtype=torch.bfloat16, generator=g)
               for _ in range(3))  # fmt: skip
    causal = lambda b, h, i, j: i >= j  # noqa: E731
    ours_bm = create_block_mask(causal, None, None, T, T, device=device)
    theirs_bm = torch_create(causal, None, None, T, T, device=device)
    rows = []
    for name, (mod, builtin) in score_mods(T, H, device, learnable=True).items():
        impls = {
            "fusedattn": lambda x, mod=mod: fusedattn.attention(*x, is_causal=True,
                                                                score_mod=mod),
            "fusedattn-blockmask": lambda x, mod=mod: fusedattn.attention(
                *x, block_mask=ours_bm, score_mod=mod),
            "flex": lambda x, mod=mod: flex(*x, score_mod=mod, block_mask=theirs_bm),
        }  # fmt: skip
        if builtin is not None:
            impls["fusedattn-builtin"] = lambda x, kw=builtin: fusedattn.attention(
                *x, is_causal=True, **kw)  # fmt: skip
        for mode in ("fwd", "fwd+bwd"):
            times = time_impls(impls, (q, k, v), mode, device, name)
            flops = harness.attention_flops(B, H, T, T, D, causal=True, mode=mode)
            for impl, ms in times.items():
                notes = [f"{times[other] / ms:.2f}x {other}" for other in ("flex", "fusedattn-builtin")
                         if other in times and other != impl]  # fmt: skip
                rows.append(harness.make_row(
                    env, op="score-mod", mode=mode, impl=impl, dtype="bfloat16", B=B, H=H,
                    Tq=T, Tk=T, D=D, causal=True, mask=name, ms=ms,
                    tflops=harness.tflops(flops, ms), note="; ".join(notes),
                ))  # fmt: skip
                harness.progress(rows[-1])
    return rows


def first_call_rows(env, device) -> list[dict]:
    """Seconds of a new score_mod's first forward+backward (its trace, generated module and
    the three kernels' compile; the target: 10 s), and of the same call once compiled."""
    H, T, D = 16, 4096, 128
    q, k, v = (torch.randn(1, H, T, D, device=device, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    table = torch.zeros(H, 2 * T - 1, device=device, requires_grad=True)
    scale = 1.0 + time.time() % 1.0  # a new constant: a structure no earlier run compiled
    rows = []
    for what in ("first call", "second call"):

        def mod(s, b, h, q_idx, kv_idx, scale=scale):
            return s * scale + table[h, q_idx - kv_idx + T - 1]

        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fusedattn.attention(q, k, v, is_causal=True, score_mod=mod)
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        rows.append(harness.make_row(
            env, op="score-mod", mode="fwd+bwd", impl="fusedattn", dtype="bfloat16", B=1, H=H,
            Tq=T, Tk=T, D=D, causal=True, mask=f"new mod, {what}", ms=seconds * 1e3,
            note=f"{seconds:.2f} s, one call (trace, codegen, compile on the first)",
        ))  # fmt: skip
        harness.progress(rows[-1])
    return rows


def cpu_rows(env, device) -> list[dict]:
    """The dense path of each pattern on a small call (CPU: the structure, not a speed)."""
    rows = []
    T, H, D = 256, 2, 32
    q, k, v = (torch.randn(1, H, T, D) for _ in range(3))
    for name, (mask_mod, _doc) in mask_mods(T, device).items():
        bm = create_block_mask(mask_mod, None, None, T, T, device=device, BLOCK_SIZE=64)
        ms = harness.time_ms(
            lambda bm=bm: fusedattn.attention(q, k, v, block_mask=bm), device=device
        )
        rows.append(harness.make_row(
            env, op="block-mask", mode="fwd", impl="fusedattn", dtype="float32", B=1, H=H, Tq=T,
            Tk=T, D=D, causal=name == "causal", mask=name, ms=ms,
            note=f"CPU: the dense mask on the torch backend; {bm.sparsity():.0f}% of blocks empty",
        ))  # fmt: skip
        harness.progress(rows[-1])
    for name, (mod, _builtin) in score_mods(T, H, device, learnable=True).items():
        ms = harness.time_ms(
            lambda mod=mod: fusedattn.attention(q, k, v, is_causal=True, score_mod=mod),
            device=device,
        )  # fmt: skip
        rows.append(harness.make_row(
            env, op="score-mod", mode="fwd", impl="fusedattn", dtype="float32", B=1, H=H,
            Tq=T, Tk=T, D=D, causal=True, mask=name, ms=ms,
            note="CPU: the mod on every score, the torch backend's dense path",
        ))  # fmt: skip
        harness.progress(rows[-1])
    return rows


def _roomy_dynamo_cache() -> None:
    """One compiled flex_attention serves every mask and mod here: Dynamo's per-code cache
    (8 entries by default) would make later ones fall back to Flex's eager path, which
    materialises the scores (vllm#27178), and time that instead."""
    import torch._dynamo

    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 64)


def run(quick: bool, device: torch.device, env: dict, part: str = "all") -> list[dict]:
    """part: "masks" (issue #71's rows), "mods" (issue #84's), or both."""
    if device.type != "cuda":
        return cpu_rows(env, device) + ([] if quick else build_rows(env, device))
    _roomy_dynamo_cache()
    rows = []
    if part in ("all", "masks"):
        rows += build_rows(env, device)
        for T in (8192,) if quick else (8192, 16384, 32768):
            rows += attention_rows(env, device, T)
    if part in ("all", "mods"):
        rows += first_call_rows(env, device)
        for T in (8192,) if quick else (4096, 16384):
            rows += score_mod_rows(env, device, T)
    return rows


if __name__ == "__main__":
    harness.cli(run, "flex.csv", parts={"all": "flex.csv", "masks": "flex.csv",
                                        "mods": "flex_score_mod.csv"})  # fmt: skip
