"""Block masks against FlexAttention (issue #71): document masks and prefix-LM at T = 8k, 16k
and 32k (D = 128, Hq = Hkv = 16, B = 1, bf16), forward and forward+backward, each row timed
against the same mask under

- `flex`: torch's flex_attention compiled (its Triton kernel; the compile done before timing),
- `fusedattn-varlen`: fusedattn.varlen_attention over the same documents, causal (document
  masks only: the packed path, the bar the block mask must stay within 10 % of),
- `fusedattn-causal`: is_causal=True (the causal block mask only: within 5 %),

and `create_block_mask` at 128k: fusedattn's (eager, chunked) and torch's (compiled, on the
GPU), seconds and peak memory. Targets (issue #71): block masks >= 1.2x Flex.

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
            leaves = [t.detach().requires_grad_(mode != "fwd") for t in (q, k, v)]
            times = {}
            for impl, fn in impls.items():

                def call(fn=fn, leaves=leaves, mode=mode):
                    out = fn(leaves)
                    if mode != "fwd":
                        out.backward(torch.ones_like(out))

                times[impl] = harness.time_ms(call, device=device)
            for impl, ms in times.items():
                flops = None
                if visible is not None:  # the FLOPs of the visible scores only
                    flops = 4.0 * H * visible * D * {"fwd": 1.0, "fwd+bwd": 3.5}[mode]
                note = f"{times['flex'] / ms:.2f}x flex"
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
    return rows


def run(quick: bool, device: torch.device, env: dict) -> list[dict]:
    if device.type != "cuda":
        return cpu_rows(env, device) + ([] if quick else build_rows(env, device))
    rows = build_rows(env, device)
    for T in (8192,) if quick else (8192, 16384, 32768):
        rows += attention_rows(env, device, T)
    return rows


if __name__ == "__main__":
    harness.cli(run, "flex.csv")
