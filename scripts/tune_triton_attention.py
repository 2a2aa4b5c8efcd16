"""Time the Triton attention kernels under candidate tiles (issue #12) and say which win.

    python scripts/tune_triton_attention.py [--out DIR] [--jobs 16] [--cases d128,d128c,d64,d64c]

`--cases d128cs` (not in the default list) is D=128 causal with Gemma-2's softcap of 50: its
shipped rows against d128c's say what the softcap costs per kernel. `--cases d128w` is D=128
causal with a 1024-key sliding window (Mistral's layout): the merged dK/dV loops were timed on
causal only, and the window's merged loop spilled a little more in the sm_90 screen.
`--cases d128m,d128cm,d128cmf` are D=128 with a dense (B, 1, T, T) attn_mask, bool (90 % kept)
or bf16, without and with causal (the benchmark's `dense` rows): the masked loops the sm_90
screen reshaped (attention_triton_mask_loops.csv), the pipelined forward with a mask included.

For each kernel (fwd, dq, dkdv) and each candidate tiling (the shipped one first), at the
H200 comparison points (bf16, B=4, H=16, T=4096; D=128 and 64, causal and not; `--lengths
1024,4096,16384` for more, B·T = 16k tokens each): the kernel's median time
(triton.testing.do_bench), TFLOP/s, the speedup over the shipped tiles, the largest
difference of its output from the shipped tiles' output (a tiling changes rounding order
only: a large difference is a bug), and `pass`: the k× rule against float64 on a slice (batch
0, heads 0-1) of the forward's output or of dq, dk (the backward against the reference's
autograd), checked before the candidate is timed; a candidate that fails is not timed.
`--baselines` adds SDPA's cuDNN and flash backends on the same inputs (tiles `sdpa-cudnn`,
`sdpa-flash`: kernel fwd their forward, kernel bwd their backward), and a `bwd` row of ours
(the fastest dq plus the fastest dk/dv that passed). Writes tune_triton_attention.csv into DIR;
`scripts/build_tile_table.py` turns it into the tile table attention_config reads.

Candidates come from the sm_90 static screen (benchmarks/results/sm90-static/): no spills,
fewer instructions per score element. All of them compile first, in parallel processes
(Triton's on-disk cache), then time in this one. Without a GPU it runs a tiny dry run in the
interpreter (the same code path, no timing worth reading).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import csv
import dataclasses
import itertools
import os
import sys
import time
from pathlib import Path

# (kernel, Tiles.parse specs: "BMxBNwWARPSsSTAGES" and flags t: tensor-descriptor (TMA)
# copies, p: the forward's pipelined interior loop, w: the forward warp-specialized (4 warps;
# 128x128 at 3 stages needs 246 KB of shared memory: not a candidate), r: the forward on
# persistent programs, longest blocks first under causal (pipelined + persistent, "pr",
# spilled 120-128 B at D=128 on the sm_90 screen: not a candidate), m: dK/dV's boundary
# loops merged, p on dkdv: its interior loop rotated (the rotated dQ is no candidate: Triton
# 3.6's ptxas 12.8 crashes on it)); the
# shipped tiles are always measured first (64x64w4s2: the tiles every card got before the
# H100 tuning; still the default off Hopper)
CANDIDATES = {
    "fwd": ["64x64w4s2", "128x128w8s2", "128x64w8s3", "64x64w4s2t", "128x128w8s2t",
            "128x64w8s3t", "128x128w8s3", "128x64w8s2", "128x64w8s3p", "128x64w8s2p",
            "128x64w8s3tp", "128x128w8s2p", "128x64w4s3w", "128x128w4s2w", "128x64w8s3r",
            "128x64w8s3tr", "128x64w4s3wr"],
    "dq": ["64x64w4s2", "128x64w8s3", "128x32w8s2", "64x64w8s2", "128x64w8s2", "128x128w8s2"],
    "dkdv": ["64x64w4s2", "64x128w8s3", "32x128w8s2", "64x64w8s3", "64x128w8s3m", "64x128w8s2m",
             "64x64w4s2m", "64x128w8s3mp", "32x128w8s2mp"],
}  # fmt: skip
# case: (head dim, causal, softcap, window: keys left of the diagonal, -1 for none, attn_mask:
# None, "bool" or "float")
CASES = {
    "d128": (128, False, 0.0, -1, None), "d128c": (128, True, 0.0, -1, None),
    "d64": (64, False, 0.0, -1, None), "d64c": (64, True, 0.0, -1, None),
    "d128cs": (128, True, 50.0, -1, None), "d128w": (128, True, 0.0, 1024, None),
    "d128m": (128, False, 0.0, -1, "bool"), "d128cm": (128, True, 0.0, -1, "bool"),
    "d128cmf": (128, True, 0.0, -1, "float"),
}  # fmt: skip
DEFAULT_CASES = "d128,d128c,d64,d64c"
B, H, T = 4, 16, 4096
FLOPS = {"fwd": 4.0, "dq": 6.0, "dkdv": 8.0}  # per (q, k) pair and head dim: GEMMs of each kernel


def visible_pairs(t: int, causal: bool, window: int) -> float:
    """(query, key) pairs a square T x T call computes: all, causal's half, or the band of a
    window of `window` keys left of the diagonal (as FlexAttention counts them)."""
    if window >= 0:
        return sum(min(i, window) + 1 for i in range(t))
    return t * t * (0.5 if causal else 1.0)


def tiles(spec: str):
    """The Tiles a candidate names (Tiles.parse: BMxBNwWARPSsSTAGES and flags t, m, p)."""
    from fusedattn.triton_kernels.attention import Tiles

    return Tiles.parse(spec)


def setup(D: int, causal: bool, device, dtype, shape=(B, H, T), softcap=0.0, window=-1,
          mask=None):  # fmt: skip
    """Inputs, the forward/backward buffers a shipped-tiles run fills, and launch builders."""
    import torch

    from fusedattn.ops.attention.triton_args import TritonAttentionLaunch
    from fusedattn.ops.core.kernels import device_arch
    from fusedattn.triton_kernels.attention import attention_config

    b, h, t = shape
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(b, t, h, D, device=device, dtype=dtype).transpose(1, 2)
                   for _ in range(4))  # fmt: skip
    attn_mask = None  # one mask for every head, as the benchmark's dense rows
    if mask == "bool":
        attn_mask = torch.rand(b, 1, t, t, device=device) > 0.1
    elif mask == "float":
        attn_mask = torch.randn(b, 1, t, t, device=device, dtype=dtype)
    # the tiles a call on this card gets ("shipped")
    base = attention_config(D, D, device.type == "cuda", elem_bytes=q.element_size(),
                            arch=device_arch(device))  # fmt: skip

    def launch(kernel=None, spec=None):
        cfg = base if spec is None else dataclasses.replace(base, **{kernel: tiles(spec)})
        return TritonAttentionLaunch(
            q, k, v, attn_mask, None, None, None, None, None, 0, 0, window, 0 if causal else -1,
            False, D**-0.5, softcap, 0.0, None, config=cfg,
        )  # fmt: skip

    out = torch.empty(b, t, h, D, device=device, dtype=dtype).transpose(1, 2)
    lse = torch.empty(b, h, t, device=device)
    delta = torch.empty(b, h, t, device=device)
    L = launch()
    L.launch(L.K.attention_fwd, *L.fwd_args(q, k, v, out, lse))
    bufs = dict(q=q, k=k, v=v, do=do, out=out, lse=lse, delta=delta, mask=attn_mask)
    L.launch(L.K.attention_bwd_dq, *L.dq_args(q, k, v, out, do, lse, delta, torch.empty_like(q),
                                              None, False))  # fmt: skip
    return bufs, launch


def kernel_call(kernel: str, L, bufs):
    """(jit function, grid, args, constexprs, output tensor) of one kernel launch."""
    import torch

    q, k, v, do, out, lse, delta = (bufs[n] for n in ("q", "k", "v", "do", "out", "lse", "delta"))
    if kernel == "fwd":
        result = torch.empty_like(out)
        return (L.K.attention_fwd, *L.fwd_args(q, k, v, result, torch.empty_like(lse)), result)
    if kernel == "dq":
        result = torch.empty_like(q)
        return (L.K.attention_bwd_dq,
                *L.dq_args(q, k, v, out, do, lse, torch.empty_like(delta), result, None, False),
                result)  # fmt: skip
    result = torch.empty_like(k)
    return (L.K.attention_bwd_dkdv,
            *L.dkdv_args(q, k, v, do, lse, delta, result, torch.empty_like(v)), result)  # fmt: skip


def compile_one(case: str, kernel: str, spec: str | None) -> str:
    """Child process: compile one candidate into Triton's cache (no timing)."""
    import torch

    D, causal, softcap, window, mask = CASES[case]
    bufs, launch = setup(D, causal, torch.device("cuda"), torch.bfloat16, softcap=softcap,
                         window=window, mask=mask)  # fmt: skip
    fn, grid, args, constexprs, _ = kernel_call(kernel, launch(kernel, spec), bufs)
    fn.warmup(*args, grid=grid, **constexprs)
    return f"{case} {kernel} {spec or 'shipped'}"


def reference_slice(bufs, causal, softcap, window, mask):
    """float64 and same-dtype naive results on batch 0, heads 0-1 (forward output, dq, dk):
    the yardsticks of the k× rule."""
    import torch

    from fusedattn import reference

    sl = (slice(0, 1), slice(0, 2))
    out = {}
    for name, dtype in (("truth", torch.float64), ("base", bufs["q"].dtype)):
        q, k, v = (bufs[n][sl].detach().to(dtype).requires_grad_() for n in ("q", "k", "v"))
        kw = dict(is_causal=causal, softcap=softcap,
                  window_size=None if window < 0 else (window, 0),
                  attn_mask=None if bufs["mask"] is None else bufs["mask"][:1].to(
                      torch.bool if bufs["mask"].dtype == torch.bool else dtype))  # fmt: skip
        o = reference.attention(q, k, v, **kw)
        dq, dk = torch.autograd.grad(o, (q, k), bufs["do"][sl].to(dtype))
        out[name] = dict(fwd=o.detach(), dq=dq, dkdv=dk)
    return out


def verdict(kernel, result, refs) -> str:
    """'yes' or 'no: ...' by the k× rule on the slice the references cover."""
    from fusedattn.testing import compare_kx

    got = result[:1, :2]
    check = compare_kx(got, refs["truth"][kernel], refs["base"][kernel], k=2.0)
    return "yes" if check.ok else "no: " + check.message[:200]


def sdpa_baselines(bufs, causal, mask):
    """{name: (forward call, backward call)} of SDPA's cuDNN and flash backends on the case's
    inputs, or those that refuse them left out with a line."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    for name, backend in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):  # fmt: skip
        q, k, v = (bufs[n].detach().requires_grad_() for n in ("q", "k", "v"))

        def fwd(backend=backend, q=q, k=k, v=v):
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=bufs["mask"], is_causal=causal and bufs["mask"] is None
                )

        try:
            with torch.no_grad():
                fwd()
            o = fwd()
        except RuntimeError as exc:
            print(f"  {name}: not run: {str(exc).splitlines()[0][:100]}")
            continue

        def bwd(o=o, q=q, k=k, v=v):
            return torch.autograd.grad(o, (q, k, v), bufs["do"], retain_graph=True)

        def fwd_only(fwd=fwd):
            with torch.no_grad():
                return fwd()

        out[name] = (fwd_only, bwd)
    return out


def write_rows(rows: list[dict], path: Path) -> None:
    fields = ["arch", "case", "T", "B", "kernel", "tiles", "ms", "tflops", "speedup", "max_diff",
              "pass", "error"]  # fmt: skip
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--cases", default=DEFAULT_CASES, help=f"of {','.join(CASES)}")
    parser.add_argument("--lengths", default=str(T),
                        help="sequence lengths, B = 16384 // T each (default 4096: B=4)")  # fmt: skip
    parser.add_argument("--kernels", default=",".join(CANDIDATES), help="of fwd,dq,dkdv")
    parser.add_argument("--baselines", action="store_true",
                        help="time SDPA's cuDNN and flash backends on the same inputs too")  # fmt: skip
    args = parser.parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from fusedattn.ops.core.kernels import device_arch

    device = torch.device("cuda" if gpu else "cpu")
    cases = args.cases.split(",")
    lengths = [int(t) for t in args.lengths.split(",")]
    arch = device_arch(device)  # the card's 10 * major + minor (0 on the CPU)
    candidates = {k: CANDIDATES[k] for k in args.kernels.split(",")}
    jobs = [(c, kern, spec) for c in cases for kern, specs in candidates.items()
            for spec in [None, *specs]]  # fmt: skip
    # job -> its compiler error (ptxas or Triton's own): not compiled again when timed (ptxas
    # can take a while to crash); any other failure of a child is retried in this process
    failed = {}
    if gpu and args.jobs > 1:
        start = time.perf_counter()
        ctx = __import__("multiprocessing").get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=ctx) as pool:
            futures = {pool.submit(compile_one, *job): job for job in jobs}
            for future in concurrent.futures.as_completed(futures):
                try:
                    future.result()
                except Exception as exc:  # reported again (and skipped) when timed below
                    if type(exc).__name__ in ("PTXASError", "CompilationError"):
                        failed[futures[future]] = exc
                    print(f"  compile {futures[future]}: {repr(exc)[:200]}", flush=True)
        print(f"compiled {len(jobs)} candidates in {time.perf_counter() - start:.0f}s", flush=True)
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "tune_triton_attention.csv"
    for case, t in itertools.product(cases, lengths):
        D, causal, softcap, window, mask = CASES[case]
        dtype = torch.bfloat16 if gpu else torch.float32
        shape = (max(1, 16384 // t), H, t) if gpu else (1, 2, 64)
        bufs, launch = setup(D, causal, device, dtype, shape, softcap, window, mask)
        refs = reference_slice(bufs, causal, softcap, window, mask)
        where = dict(arch=arch, case=case, T=shape[2], B=shape[0])
        flops_of = {kernel: FLOPS[kernel] * shape[0] * shape[1]
                    * visible_pairs(shape[2], causal, window) * D for kernel in FLOPS}  # fmt: skip
        flops_of["bwd"] = flops_of["dq"] + flops_of["dkdv"]
        best = {}
        for kernel, specs in candidates.items():
            shipped_ms = reference = None
            for spec in [None, *specs]:
                try:
                    if (case, kernel, spec) in failed:
                        raise failed[case, kernel, spec]
                    fn, grid, a, kw, result = kernel_call(kernel, launch(kernel, spec), bufs)
                    call = lambda fn=fn, grid=grid, a=a, kw=kw: fn[grid](*a, **kw)  # noqa: E731
                    call()
                    passed = verdict(kernel, result, refs)  # checked before it is timed
                    ms = time_call(call, gpu) if passed == "yes" else None
                except Exception as exc:  # a candidate that fails (resources, compile) is reported
                    print(f"  {case} T={t} {kernel} {spec}: failed: {repr(exc)[:200]}", flush=True)
                    rows.append(dict(**where, kernel=kernel, tiles=spec, error=repr(exc)[:300]))
                    continue
                if spec is None:
                    shipped_ms, reference = ms, result.float().clone()
                err = (result.float() - reference).abs().max().item()
                row = dict(**where, kernel=kernel, tiles=spec or "shipped", max_diff=f"{err:.3g}",
                           **{"pass": passed})  # fmt: skip
                if ms is not None:
                    row |= dict(ms=round(ms, 4), tflops=round(flops_of[kernel] / ms / 1e9, 1),
                                speedup=round(shipped_ms / ms, 3) if shipped_ms else "")  # fmt: skip
                    if ms < best.get(kernel, (float("inf"),))[0]:
                        best[kernel] = (ms, spec or "shipped")
                print("  " + ", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
                rows.append(row)
        if args.baselines:
            rows += baseline_rows(bufs, causal, mask, where, flops_of, best, gpu)
        write_rows(rows, path)  # after every case: a step cut by its time limit keeps the rest
    print(f"wrote {path}")
    for case, t in itertools.product(cases, lengths):
        for kernel in candidates:
            mine = [r for r in rows if r["case"] == case and r["kernel"] == kernel and "ms" in r
                    and r["T"] == (t if gpu else 64) and r["tiles"] not in SDPA]  # fmt: skip
            if mine:
                top = min(mine, key=lambda r: r["ms"])
                print(f"best {case} T={t} {kernel}: {top['tiles']} ({top['speedup']}x the shipped)")
    return 0


SDPA = ("sdpa-cudnn", "sdpa-flash")


def time_call(call, gpu: bool) -> float:
    if gpu:
        import triton.testing

        return triton.testing.do_bench(call, warmup=10, rep=50, return_mode="median")
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e3


def baseline_rows(bufs, causal, mask, where, flops_of, best, gpu) -> list[dict]:
    """SDPA's cuDNN and flash forward (kernel fwd) and backward (kernel bwd) on the case's
    inputs, and our bwd: the fastest passing dq plus the fastest passing dk/dv."""
    rows = []
    if "dq" in best and "dkdv" in best:
        ms = best["dq"][0] + best["dkdv"][0]
        rows.append(dict(**where, kernel="bwd", tiles=f"{best['dq'][1]}+{best['dkdv'][1]}",
                         ms=round(ms, 4), tflops=round(flops_of["bwd"] / ms / 1e9, 1),
                         **{"pass": "yes"}))  # fmt: skip
    if not gpu:
        return rows
    for name, (fwd, bwd) in sdpa_baselines(bufs, causal, mask).items():
        for kernel, call in (("fwd", fwd), ("bwd", bwd)):
            ms = time_call(call, gpu)
            row = dict(**where, kernel=kernel, tiles=name, ms=round(ms, 4),
                       tflops=round(flops_of[kernel] / ms / 1e9, 1))  # fmt: skip
            print("  " + ", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__":
    sys.exit(main())
