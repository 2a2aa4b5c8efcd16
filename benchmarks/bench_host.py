"""Host cost of one call: microseconds of CPU time per forward, backward (of a saved graph) and
forward+backward of fusedattn.attention, layer_norm, rms_norm and softmax, and the forward of
fusedattn.linear (one row: a decode step's projection), on the Triton path,
with the GPU work taken out of the picture.

    python benchmarks/bench_host.py [--sm90-tool ../shared/tools/sm90_static.py] [--out DIR]

On a GPU the shapes are tiny (B=1, H=2, T=64, D=64: the kernels take a few µs) and calls are
timed back to back, so the time is the host's. Without a GPU, `--sm90-tool` compiles the
Triton kernels for sm_90 and replaces only the final driver launch by a no-op: every line of
Python on the path (validation, dispatch, autograd, the launch arguments, Triton's own
launcher) runs and is timed. Without either, the kernel launches themselves are skipped
(Triton's launcher excluded; the note column says which).

Decoding (`attention_with_kvcache`, inference only: fwd rows) is timed where its kernels do not
run in the interpreter (a GPU, or `--sm90-tool`): one step at batch 1 with Llama-3-8B's heads
over a 1k cache, with and without appending the new token's k, v. Under the stub the CPU is
given an H100's/H200's 132 SMs, so the key split and its combine launch are timed as on those
cards, and the append takes its GPU path (one append_kv launch, not torch's indexed writes).
On the H200 such a step took 157-181 µs, the host's time (benchmarks/results/h200/decode.csv).

Run it from two checkouts (PYTHONPATH) on the same machine to compare host cost before and
after a change; the CSV's host_us column holds the median of 7 repeats of 200 calls.

`--check-launches` (with `--sm90-tool`) first checks the launch cache (ops/triton_launch.py):
for attention variants, the norms, softmax and decoding, forward and backward, every launch
through the cache must hand Triton's launcher the same compiled kernel, grid and arguments as
Triton's own path; it exits 1 on a difference.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import statistics
import sys
import time
from pathlib import Path

import harness
import torch

SHAPE = (1, 2, 64, 64)  # attention (B, H, T, D)
ROWS = (64, 1024)  # the norms and softmax: (M, N)
DECODE = (1, 32, 8, 128, 1024)  # decoding (B, Hq, Hkv, D, cache length): Llama-3-8B's heads
STUB_SMS = 132  # H100 SXM and H200: what num_splits=0 splits for under the sm_90 stub


_stubbed = False


def first_module(*names):
    """The first of these modules that this checkout has (None if none): bench_host.py times
    older checkouts too, whose internal modules had other names."""
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def stub_driver_launch(tool_path: str) -> None:
    """Compile for sm_90 on this machine and make the final launch a no-op (once per process:
    --check-launches and the timing both need it)."""
    global _stubbed
    if _stubbed:
        return
    _stubbed = True
    spec = importlib.util.spec_from_file_location("sm90_static", tool_path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.install()
    from triton.compiler import compiler

    # decoding as on a GPU: the split for a GPU's SMs (the interpreter's 4 would not split a
    # batch-1 step), the append through its kernel (CPU tensors take torch's writes), and no
    # host check of the lengths' values (the CPU always checks them; a GPU only on request).
    # Checkouts older than the ops layout by family (2026-11-28, run via PYTHONPATH) keep all
    # three in fusedattn.ops.decode; older than decoding, none.
    launch = first_module("fusedattn.ops.shared.decode_launch", "fusedattn.ops.decode")
    api = first_module("fusedattn.ops.decode.api", "fusedattn.ops.decode")
    if launch is not None and hasattr(launch, "INTERPRETER_SMS"):
        launch.INTERPRETER_SMS = STUB_SMS
        if hasattr(launch, "append_uses_kernel"):
            launch.append_uses_kernel = lambda k_cache: True
        else:
            launch.append = functools.partial(launch.append, kernel=True)
        if hasattr(api, "values_checked"):
            gpu_rule = api.values_checked
            api.values_checked = lambda on_gpu, backend, *env: gpu_rule(True, backend, *env)

    def no_handles(self):
        self.module, self._run = "stub", lambda *args, **kwargs: None

    compiler.CompiledKernel._init_handles = no_handles


def _same_launch_arg(a, b) -> bool:
    """Equal as the launcher reads them: tensors by dtype, shape and strides (each call makes
    new outputs), launch metadata by content, everything else by value and type."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride()
        )  # fmt: skip
    if (a is None) != (b is None):
        # the direct launcher (triton_launch._direct_launcher) passes None for the launch
        # metadata and the enter/exit hooks when no hook is set; Triton's own path passes the
        # metadata the hooks would get and the empty hook chains (Triton 3.6 and later): the
        # C launcher then calls nothing either way
        other = b if a is None else a
        if type(other).__name__ in ("LazyDict", "HookChain"):
            return not getattr(other, "calls", None)
    if type(a) is not type(b):
        return False
    if type(a).__name__ == "LazyDict":  # triton's launch metadata: a new one per launch
        return a.data == b.data and len(a.extras) == len(b.extras)
    if type(a) is tuple:  # a score_mod's captures: tensors, sizes, strides
        return len(a) == len(b) and all(map(_same_launch_arg, a, b))
    return a is b or a == b


def _launch_cases(fusedattn, dtype) -> dict:
    """{name: call} covering every Triton kernel: attention plain and causal with ragged key
    padding, the norms on rows long enough for the looped backward, softmax, and decoding with
    an append (contiguous cache split over keys; paged with left padding and causal)."""
    T, N = 80, 40000
    q, k, v = (torch.randn(2, 3, T, 64, dtype=dtype, requires_grad=True) for _ in range(3))
    kpm = torch.zeros(2, T, dtype=torch.bool)
    kpm[1, 70:] = True
    x = torch.randn(6, N, dtype=dtype, requires_grad=True)
    w, b = (torch.randn(N, dtype=dtype, requires_grad=True) for _ in range(2))
    # decoding: a split contiguous cache and a paged one with left padding, each appending
    q1, k1, v1 = (torch.randn(2, 1, h, 64, dtype=dtype) for h in (4, 2, 2))
    k_cache, v_cache = (torch.randn(2, 300, 2, 64, dtype=dtype) for _ in range(2))
    k_pages, v_pages = (torch.randn(40, 16, 2, 64, dtype=dtype) for _ in range(2))
    table = torch.randperm(40, dtype=torch.int32)[:36].view(2, 18)
    lengths = torch.tensor([250, 17], dtype=torch.int32)
    leftpad = torch.tensor([0, 5], dtype=torch.int32)
    decode_paged = functools.partial(
        fusedattn.attention_with_kvcache, q1, k_pages, v_pages, k1, v1, is_causal=True,
        cache_seqlens=lengths, block_table=table, cache_leftpad=leftpad, backend="triton",
    )  # fmt: skip
    flex = {}
    if hasattr(fusedattn, "score_mod"):  # a block mask and a learnable score_mod (issue #84)
        from fusedattn.masks import create_block_mask

        doc = torch.arange(T) // 30
        blocks = create_block_mask(lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j), None, None,
                                   T, T, device="cpu", BLOCK_SIZE=16)  # fmt: skip
        rel = torch.randn(3, 2 * T - 1, requires_grad=True)

        def relative(s, b, h, i, j):
            return s + rel[h, i - j + T - 1]

        flex = {
            "attention block_mask": lambda: fusedattn.attention(q, k, v, block_mask=blocks,
                                                                backend="triton"),
            "attention score_mod": lambda: fusedattn.attention(
                q, k, v, block_mask=blocks, score_mod=relative, backend="triton"
            ),
        }  # fmt: skip
    return {
        **flex,
        "attention": lambda: fusedattn.attention(q, k, v, backend="triton"),
        "attention causal+kpm": lambda: fusedattn.attention(
            q, k, v, is_causal=True, key_padding_mask=kpm, backend="triton"
        ),
        "layer_norm": lambda: fusedattn.layer_norm(x, (N,), w, b, backend="triton"),
        "rms_norm": lambda: fusedattn.rms_norm(x, (N,), w, backend="triton"),
        "softmax": lambda: fusedattn.softmax(x, -1, backend="triton"),
        "decode+append": lambda: fusedattn.attention_with_kvcache(
            q1, k_cache, v_cache, k1, v1, cache_seqlens=lengths, backend="triton"
        ),
        "decode paged+append": decode_paged,
    }


def forget_plans() -> None:
    """Drop attention_with_kvcache's and attention's plans (their launchers are bound at
    their first call: a plan kept from a run with the launch cache off would never bind the
    compiled kernel's launcher that --check-launches checks)."""
    for name in ("fusedattn.ops.decode.plans", "fusedattn.ops.attention.plans"):
        plans = first_module(name)
        if plans is not None:
            plans.PLANS.clear()


def check_launches(fusedattn) -> list[str]:
    """With the sm_90 stub installed: the differences between what Triton's launcher receives
    through the launch cache and through Triton's own path, per case ([] = none)."""
    from triton.compiler import compiler

    triton_launch = first_module("fusedattn.ops.core.triton_launch", "fusedattn.ops.triton_launch")
    received = []

    def recording_handles(self):
        self.module, self._run = "stub", lambda *args: received.append((self, args))

    no_op = compiler.CompiledKernel._init_handles
    compiler.CompiledKernel._init_handles = recording_handles
    problems = []
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        cases = _launch_cases(fusedattn, dtype)
        for name, call in cases.items():

            def launches(call=call):
                received.clear()
                out = call()
                if out.requires_grad:  # decoding has no backward
                    out.backward(torch.ones_like(out))
                return list(received)

            forget_plans()
            triton_launch.ENABLED, triton_launch._launches = False, {}
            reference = launches()
            forget_plans()  # the plans' bound launchers are what is checked next
            triton_launch.ENABLED, triton_launch._launches = True, {}
            launches()  # fills the cache
            cached = launches()
            keys = sum(len(e.compiled) for e in triton_launch._launches.values())
            same = len(cached) == len(reference) and all(
                c is r and len(a) == len(b) and all(map(_same_launch_arg, a, b))
                for (c, a), (r, b) in zip(cached, reference, strict=True)
            )
            print(f"  launch check {name:<22} {str(dtype)[6:]:<9} {len(cached)} launches, "
                  f"{keys} cached: {'same arguments' if same else 'DIFFERENT'}")  # fmt: skip
            if not same or keys != len(cached):
                problems.append(f"{name} {dtype}")
    compiler.CompiledKernel._init_handles = no_op
    forget_plans()  # their launchers call the recording stub
    return problems


def host_us(fn, repeats=7, calls=200, sync=lambda: None) -> tuple[float, float]:
    """(median, spread) over repeats of the mean µs per call."""
    for _ in range(20):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    median = statistics.median(samples)
    return median, (max(samples) - min(samples)) / median


def run(args) -> list[dict]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    note = "real launches, tiny shapes"
    if device.type == "cpu":
        if args.sm90_tool:
            stub_driver_launch(args.sm90_tool)
            note = "compiled for sm_90, driver launch stubbed"
        backends = first_module("fusedattn.ops.core.backends", "fusedattn.ops.backends")
        backends.triton_interpreter_enabled = lambda: True  # accept CPU tensors: nothing runs
        if not args.sm90_tool:
            os.environ.setdefault("TRITON_INTERPRET", "1")
            note = "kernel launches skipped (Triton's launcher not timed)"
            # every launch goes through triton_launch.launch (a plan's prepared launchers
            # too, uncached under the interpreter); older checkouts: the attention's own
            skip = first_module("fusedattn.ops.core.triton_launch")
            if skip is not None:
                skip.launch = lambda *args, **kwargs: None
            else:
                attention_launch = first_module("fusedattn.ops.attention.triton_args",
                                                "fusedattn.ops.attention_launch")  # fmt: skip
                attention_launch.TritonAttentionLaunch.launch = staticmethod(lambda *a: None)
    import fusedattn

    env = harness.environment(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows = []
    # The other ops' launches are skipped only by the sm_90 stub (without it the interpreter
    # would run them): on a CPU without --sm90-tool, attention alone.
    every_op = device.type == "cuda" or bool(args.sm90_tool)
    for op, call, leaves, fields in cases(fusedattn, device, dtype, every_op):
        impl = fields.pop("impl", "fusedattn-triton")
        if getattr(args, "impl", None) and impl not in args.impl:
            continue
        out = call()
        grad = torch.randn_like(out) if leaves else None

        def fwd(call=call):
            with torch.no_grad():
                return call()

        def bwd(out=out, leaves=leaves, grad=grad):  # as the harness's bwd mode: a saved graph
            return torch.autograd.grad(out, leaves, grad, retain_graph=True)

        def fwd_bwd(call=call, leaves=leaves, grad=grad):
            return torch.autograd.grad(call(), leaves, grad)

        modes = (("fwd", fwd), ("bwd", bwd), ("fwd+bwd", fwd_bwd)) if leaves else (("fwd", fwd),)
        for mode, fn in modes:
            us, spread = host_us(fn, sync=sync)
            row = harness.make_row(
                env, op=op, mode=mode, impl=impl + args.label,
                dtype=str(dtype)[6:], host_us=us,
                note=f"{note}; spread {spread:.0%}" + harness.noisy(spread), **fields,
            )  # fmt: skip
            print(f"  host {op:<10} {impl:<17} {mode:<8} {fields} {us:8.1f} µs/call  "
                  f"({row['note']})")  # fmt: skip
            rows.append(row)
    wanted = getattr(args, "impl", None) is None or "fusedattn-triton" in args.impl
    if wanted and getattr(args, "first_call", True):
        rows += first_call_rows(fusedattn, env, device, dtype, note, args.label)
    return rows


def cases(fusedattn, device, dtype, every_op: bool):
    """(op, call() -> out, leaves that get gradients (none: inference only, fwd alone), shape
    columns) per measured call; attention alone unless every_op."""
    q, k, v = (torch.randn(SHAPE, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    B, H, T, D = SHAPE
    for causal in (False, True):
        yield (
            "attention",
            lambda c=causal: fusedattn.attention(q, k, v, is_causal=c, backend="triton"),
            (q, k, v),
            dict(B=B, H=H, Tq=T, Tk=T, D=D, causal=causal),
        )
    yield from flex_cases(fusedattn, q, k, v)
    yield from torch_key_padding_cases(fusedattn, device, dtype)
    if not every_op:
        return
    M, N = ROWS
    x = torch.randn(ROWS, device=device, dtype=dtype, requires_grad=True)
    w, b = (torch.randn(N, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    shape = dict(M=M, N=N)
    yield (
        "layernorm",
        lambda: fusedattn.layer_norm(x, (N,), w, b, backend="triton"),
        (x, w, b),
        shape,
    )
    if hasattr(fusedattn, "rms_norm"):  # checkouts older than RMSNorm (run via PYTHONPATH)
        yield "rmsnorm", lambda: fusedattn.rms_norm(x, (N,), w, backend="triton"), (x, w), shape
    yield "softmax", lambda: fusedattn.softmax(x, -1, backend="triton"), (x,), shape
    if hasattr(fusedattn, "linear"):  # the batch-invariant matmul, one decode row (Llama's o_proj)
        x1 = torch.randn(1, 4096, device=device, dtype=dtype)
        w1 = torch.randn(4096, 4096, device=device, dtype=dtype)
        call = functools.partial(fusedattn.linear, x1, w1, backend="triton")
        yield "linear", call, (), dict(M=1, N=4096)
    if not hasattr(fusedattn, "attention_with_kvcache"):  # checkouts older than decoding
        return
    # new names: the attention calls above read q, k, v when they run (this is a generator)
    Bd, Hq, Hkv, Dd, L = DECODE
    q_step = torch.randn(Bd, 1, Hq, Dd, device=device, dtype=dtype)
    k_cache, v_cache = (
        torch.randn(Bd, L + 64, Hkv, Dd, device=device, dtype=dtype) for _ in range(2)
    )  # fmt: skip
    k_new, v_new = (torch.randn(Bd, 1, Hkv, Dd, device=device, dtype=dtype) for _ in range(2))
    lengths = torch.full((Bd,), L, device=device, dtype=torch.int32)  # the append writes at L
    for new, layout in (((None, None), "contiguous"), ((k_new, v_new), "contiguous+append")):
        yield (
            "decode",
            lambda new=new: fusedattn.attention_with_kvcache(
                q_step, k_cache, v_cache, *new, cache_seqlens=lengths, backend="triton"
            ),
            (),
            dict(B=Bd, H=Hq, Tq=1, Tk=L, D=Dd, mask=layout),
        )
    # the Hugging Face integration's decode step over its (B, Hkv, S, D) cache, without a mask
    # and with a padding mask (left padding and the unfilled slots of a static cache)
    hf = first_module("fusedattn.integrations.huggingface")
    module = torch.nn.Module()
    module.is_causal = True
    S = k_cache.shape[1]
    padding = torch.ones(Bd, 1, 1, S, device=device, dtype=torch.bool)
    padding[..., :16] = False
    padding[..., L + 1 :] = False
    q_hf, k_hf, v_hf = q_step.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    for mask, layout in ((None, "hf"), (padding, "hf+padding")):
        yield (
            "decode",
            lambda m=mask: hf.attention_forward(module, q_hf, k_hf, v_hf, m, backend="triton")[0],
            (),
            dict(B=Bd, H=Hq, Tq=1, Tk=L, D=Dd, mask=layout),
        )


def flex_cases(fusedattn, q, k, v):
    """FlexAttention's halves on the Triton path (issue #84): a score_mod whose structure is
    cached (a relative bias over a captured table: each call walks the closure, finds the
    trace and passes the table by pointer), the same over a learnable table (its gradient
    computed), and a block mask (causal, 16 x 16 blocks)."""
    if not hasattr(fusedattn, "score_mod"):  # checkouts older than score_mod
        return
    B, H, T, D = q.shape
    fields = dict(B=B, H=H, Tq=T, Tk=T, D=D, causal=False)
    table = torch.randn(H, 2 * T - 1, device=q.device)

    def relative_bias(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + T - 1]

    yield (
        "attention",
        lambda: fusedattn.attention(q, k, v, score_mod=relative_bias, backend="triton"),
        (q, k, v),
        dict(fields, mask="score_mod:relative_bias"),
    )
    learned = torch.randn(H, 2 * T - 1, device=q.device, requires_grad=True)

    def learnable_bias(score, b, h, q_idx, kv_idx):
        return score + learned[h, q_idx - kv_idx + T - 1]

    yield (  # its gradient too: float32 buffers, the dQ kernel's atomics, the cast back
        "attention",
        lambda: fusedattn.attention(q, k, v, score_mod=learnable_bias, backend="triton"),
        (q, k, v, learned),
        dict(fields, mask="score_mod:learnable_bias"),
    )
    from fusedattn.masks import create_block_mask

    causal = create_block_mask(lambda b, h, i, j: i >= j, None, None, T, T, device=q.device,
                               BLOCK_SIZE=16)  # fmt: skip
    yield (
        "attention",
        lambda: fusedattn.attention(q, k, v, block_mask=causal, backend="triton"),
        (q, k, v),
        dict(fields, mask="block_mask:causal16"),
    )


def first_call_rows(fusedattn, env, device, dtype, note, label="") -> list[dict]:
    """Seconds of a new score_mod's first forward+backward: its trace, its generated module,
    and the three kernels compiled for it (the sm_90 stub or a GPU: Triton's compile; the
    interpreter: no compile), once each (a new scalar makes the structure new)."""
    if not hasattr(fusedattn, "score_mod"):
        return []
    rows = []
    q, k, v = (torch.randn(SHAPE, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    table = torch.randn(SHAPE[1], 2 * SHAPE[2] - 1, device=device, requires_grad=True)
    for name, scale in (("first call, new mod", 1.0 + time.time() % 1.0),):

        def mod(score, b, h, q_idx, kv_idx, scale=scale):
            return score * scale + table[h, q_idx - kv_idx + SHAPE[2] - 1]

        start = time.perf_counter()
        out = fusedattn.attention(q, k, v, score_mod=mod, backend="triton")
        torch.autograd.grad(out, (q, k, v, table), torch.randn_like(out))
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        B, H, T, D = SHAPE
        rows.append(harness.make_row(
            env, op="attention", mode="fwd+bwd", impl="fusedattn-triton" + label,
            dtype=str(dtype)[6:],
            host_us=seconds * 1e6, B=B, H=H, Tq=T, Tk=T, D=D, causal=False,
            mask="score_mod:learnable_bias", note=f"{note}; {name}: one call, not a median",
        ))  # fmt: skip
        print(f"  host attention {name}: {seconds:.2f} s")
    return rows


def torch_key_padding_cases(fusedattn, device, dtype):
    """Key padding on the torch backend (issue #82: a padded key's content never reaches the
    output) beside the direct SDPA call a user writes: right padding (one SDPA call per run
    of equal key ranges, on views) and a hole (K and V copied with the padded rows zeroed).
    SDPA itself runs here, at tiny shapes, so the rows hold its time too."""
    B, T = 2, SHAPE[2]
    q, k, v = (
        torch.randn(B, SHAPE[1], T, SHAPE[3], device=device, dtype=dtype, requires_grad=True)
        for _ in range(3)
    )  # fmt: skip
    fields = dict(B=B, H=SHAPE[1], Tq=T, Tk=T, D=SHAPE[3], causal=False)
    for name in ("right", "hole"):
        pad = torch.zeros(B, T, dtype=torch.bool, device=device)
        pad[1, T // 2 :] = name == "right"
        pad[1, T // 4 : T // 2] = name == "hole"
        keep = ~pad[:, None, None, :]
        yield (
            "attention",
            lambda p=pad: fusedattn.attention(q, k, v, key_padding_mask=p, backend="torch"),
            (q, k, v),
            dict(fields, mask=f"key_padding:{name}", impl="fusedattn-torch"),
        )
        yield (
            "attention",
            lambda m=keep: torch.nn.functional.scaled_dot_product_attention(q, k, v, m),
            (q, k, v),
            dict(fields, mask=f"key_padding:{name}", impl="sdpa"),
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sm90-tool", help="sm90_static.py: compile for sm_90, stub the launch")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--label", default="", help="appended to the impl column (a checkout)")
    parser.add_argument(
        "--impl", nargs="*", default=None,
        help="only these impls' rows (fusedattn-triton, fusedattn-torch, sdpa)",
    )  # fmt: skip
    parser.add_argument(
        "--check-launches", action="store_true",
        help="with --sm90-tool: check the launch cache hands Triton's launcher the arguments "
        "Triton's own path would (exit 1 if not), then time",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.check_launches:
        if not args.sm90_tool or torch.cuda.is_available():
            parser.error("--check-launches needs --sm90-tool, on a machine without a GPU")
        stub_driver_launch(args.sm90_tool)
        backends = first_module("fusedattn.ops.core.backends", "fusedattn.ops.backends")
        backends.triton_interpreter_enabled = lambda: True
        import fusedattn

        problems = check_launches(fusedattn)
        if problems:
            print("launch cache differs from Triton's path: " + ", ".join(problems))
            return 1
    rows = run(args)
    if args.out:  # several checkouts into one file
        print(f"wrote {harness.append_csv(rows, args.out / 'host.csv')}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
