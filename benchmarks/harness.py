"""Shared benchmark harness: timing, FLOP/byte formulas, environment capture, the CSV schema.

Every bench_*.py builds rows with `make_row` and writes them with `write_csv`, so one schema
(DESIGN.md) holds for every family:

  op, mode, impl, dtype, B, H, Tq, Tk, D, M, N, causal, mask, pass, ms, tflops, gbps,
  peak_mem_mb, speedup_vs_naive, device, torch, triton, cuda, git_sha, date, note,
  tokens_per_s, step, loss, pct_of_copy, host_us, spread, transformers

(M is the row count of LayerNorm and softmax, N their row length; mode is fwd, bwd or fwd+bwd,
or infer/train/infer-compiled/train-compiled for the model benchmark, which fills
tokens_per_s and the transformers version; the training demo fills step
and loss; bench_host.py fills host_us, the CPU microseconds of one call.)

Timing: `triton.testing.do_bench` medians on CUDA (it warms up, flushes the L2 between runs and
sizes the repetitions by time). do_bench puts one call between two events, so for a call of
under SMALL_MS the gaps of the host path between calls leak into it: those are re-timed as
back-to-back calls between one pair of events (what a training loop sees), so fwd+bwd adds up
to fwd + bwd. On CPU a perf_counter median after one warm-up call. `spread` is the relative
range (max - min) / median of the repeats; above NOISY_SPREAD the note says the machine was
noisy and the row should not be trusted.
"""

from __future__ import annotations

import csv
import datetime
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

import fusedattn.info
from fusedattn.testing import compare_kx

COLUMNS = [
    "op", "mode", "impl", "dtype", "B", "H", "Tq", "Tk", "D", "M", "N", "causal", "mask", "pass",
    "ms", "tflops", "gbps", "peak_mem_mb", "speedup_vs_naive", "device", "torch", "triton",
    "cuda", "git_sha", "date", "note", "tokens_per_s", "step", "loss", "pct_of_copy", "host_us",
    "spread", "transformers",
]  # fmt: skip
SMALL_MS = 1.0  # calls shorter than this are timed back to back (see the module docstring)
NOISY_SPREAD = 0.25
MODES = ("fwd", "bwd", "fwd+bwd")
REPO = Path(__file__).resolve().parent.parent


# ---- FLOPs and bytes ----------------------------------------------------------------------


def attention_flops(B, H, Tq, Tk, D, *, causal=False, mode="fwd") -> float:
    """4·B·H·Tq·Tk·D forward (two matmuls of 2·Tq·Tk·D), half when causal; backward 2.5× the
    forward (five matmuls); fwd+bwd 3.5×."""
    fwd = 4.0 * B * H * Tq * Tk * D * (0.5 if causal else 1.0)
    return fwd * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]


def rowwise_bytes(M, N, element_size, *, mode="fwd", param_vectors=0, stat_bytes_per_row=0):
    """Bytes a row-wise op (LayerNorm, softmax) must move: each input read once, each output
    written once.

    fwd reads x and writes y (M·N each), plus `param_vectors` length-N parameters (weight,
    bias). bwd reads x (or y) and dy and writes dx (3·M·N), re-reads the parameters, writes
    their gradients, and reads `stat_bytes_per_row` of saved statistics (LayerNorm's mean and
    rstd). fwd+bwd is the sum.
    """
    mn = M * N * element_size
    params = param_vectors * N * element_size
    fwd = 2 * mn + params
    bwd = 3 * mn + 2 * params + M * stat_bytes_per_row
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def gbps(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


# ---- environment --------------------------------------------------------------------------


def git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True
        )
    except OSError:
        return ""
    if out.returncode != 0:
        return ""
    dirty = subprocess.run(
        ["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True
    )
    return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def environment(device: torch.device | None = None) -> dict:
    info = fusedattn.info.collect()
    on_gpu = info["gpu"] and (device is None or device.type == "cuda")
    return {
        "device": info["gpu"]["name"] if on_gpu else "cpu",
        "torch": info["torch"],
        "triton": info["triton"] or "",
        "cuda": info["torch_cuda"] or "",
        "transformers": _version_of("transformers"),
        "git_sha": git_sha(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
    }


def _version_of(package: str) -> str:
    """The installed version of a package, '' when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


def device_slug(env: dict) -> str:
    """A folder name for results/: 'cpu', 'nvidia-h200', ..."""
    name = env["device"].lower()
    for junk in (" nvl", " sxm5", " pcie", " 80gb", " 141gb", " hbm3", " hbm3e"):
        name = name.replace(junk, "")
    return "-".join(name.replace("_", " ").split())


# ---- measuring -----------------------------------------------------------------------------


def _spread(samples: list[float]) -> float:
    median = statistics.median(samples)
    return (max(samples) - min(samples)) / median if median > 0 else 0.0


def back_to_back_ms(fn: Callable[[], object], calls: int, repeats: int = 5) -> list[float]:
    """Per-call milliseconds of `calls` back-to-back calls between one pair of CUDA events,
    `repeats` times."""
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return samples


def cuda_graph(fn: Callable[[], object]) -> Callable[[], object]:
    """fn captured in a CUDA graph: a callable that replays it and returns the graph's own
    output (rewritten by each replay). Serving stacks replay decode steps this way, which
    takes the host's time per call out of the step; a call that syncs or reads device values
    on the host cannot be captured (raises). Warmed up on a side stream first, as torch's
    documentation asks."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out

    return replay


def time_stats(fn: Callable[[], object], *, device: torch.device, reps: int = 5):
    """(median milliseconds of fn(), spread of the repeats)."""
    if device.type == "cuda":
        import triton.testing

        samples = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="all")
        if statistics.median(samples) < SMALL_MS:
            calls = max(10, int(4 * SMALL_MS / max(statistics.median(samples), 1e-3)))
            samples = back_to_back_ms(fn, min(calls, 400))
        return float(statistics.median(samples)), _spread(samples)
    fn()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples), _spread(samples)


def time_ms(fn: Callable[[], object], *, device: torch.device, reps: int = 5) -> float:
    """Median milliseconds of fn() (time_stats without the spread)."""
    return time_stats(fn, device=device, reps=reps)[0]


def noisy(spread: float) -> str:
    """The note's warning for a row whose repeats disagree."""
    return f"; NOISY: repeats spread {spread:.0%}" if spread > NOISY_SPREAD else ""


def peak_memory_mb(fn: Callable[[], object], *, device: torch.device) -> float | None:
    """Extra device memory fn() allocates at its peak, over what was allocated before; None on
    CPU (torch's CPU allocator keeps no peak statistics)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def copy_gbps(device: torch.device, nbytes: int = 512 * 2**20) -> float | None:
    """Measured device copy bandwidth (read + write) of a buffer well past the L2, the
    ceiling for LayerNorm and softmax; None on CPU."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    return gbps(2 * nbytes, time_ms(lambda: dst.copy_(src), device=device))


def mode_callables(forward: Callable[[], torch.Tensor], inputs: list[torch.Tensor]):
    """{mode: callable} for fwd, bwd (backward of a saved graph) and fwd+bwd."""
    out = forward()
    grad = torch.randn_like(out)

    def fwd():
        with torch.no_grad():
            return forward()

    def bwd():
        return torch.autograd.grad(out, inputs, grad, retain_graph=True)

    def fwd_bwd():
        return torch.autograd.grad(forward(), inputs, grad)

    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd_bwd}


def correctness(out, ref, baseline, *, k=2.0) -> str:
    """'yes' / 'no: <worst element>' by the k× rule; '' when there is nothing to compare."""
    if out is None or ref is None:
        return ""
    result = compare_kx(out, ref, baseline, k=k)
    return "yes" if result.ok else "no: " + result.message


# ---- rows and files -------------------------------------------------------------------------


def make_row(env: dict, **fields) -> dict:
    unknown = set(fields) - set(COLUMNS)
    if unknown:
        raise KeyError(f"not in the CSV schema: {sorted(unknown)}")
    row = dict.fromkeys(COLUMNS, "")
    row.update({k: v for k, v in env.items() if k in COLUMNS})
    for key, value in fields.items():
        row[key] = "" if value is None else (round(value, 4) if isinstance(value, float) else value)
    return row


def add_speedups(rows: list[dict], naive_impl: str = "naive") -> None:
    """speedup_vs_naive = naive ms / impl ms for rows sharing every shape column and mode."""
    key_cols = ("op", "mode", "dtype", "B", "H", "Tq", "Tk", "D", "M", "N", "causal", "mask")
    naive = {tuple(r[c] for c in key_cols): r["ms"] for r in rows if r["impl"] == naive_impl}
    for r in rows:
        base = naive.get(tuple(r[c] for c in key_cols))
        if base not in (None, "") and r["ms"] not in (None, ""):
            r["speedup_vs_naive"] = round(float(base) / float(r["ms"]), 3)


def write_csv(rows: list[dict], path: Path) -> Path:
    """Write the rows; atomically (a temporary file renamed), so a run stopped mid-write by a
    time limit leaves the previous complete file, never a truncated one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)
    return path


def append_csv(rows: list[dict], path: Path) -> Path:
    """write_csv after the rows the file already holds (several checkouts into one file:
    bench_host.py, host_instructions.py)."""
    path = Path(path)
    if path.exists():
        rows = read_csv(path) + rows
    return write_csv(rows, path)


# A family's rows also go to its CSV as each one is measured, so a run that a time limit stops
# (gpu_check.sh's steps run under `timeout`) keeps every row it finished: the H100 run of
# 2026-11-26 lost a whole attention family's T=1024 rows that way (the CSV was written at
# the end only).
_STREAM: dict = {"path": None, "rows": []}


def stream_to(path: Path | None) -> None:
    """From now on `stream(row)` (and `progress(row)`) rewrites `path` with every row so far;
    None stops it. The family's final write_csv replaces the file with its finished rows."""
    _STREAM["path"] = None if path is None else Path(path)
    _STREAM["rows"] = []


def stream(row: dict) -> None:
    """Add one finished row to the streamed CSV (if stream_to named one)."""
    if _STREAM["path"] is None:
        return
    _STREAM["rows"].append(row)
    rows = [dict(r) for r in _STREAM["rows"]]  # the caller's rows keep their own speedups
    add_speedups(rows)
    write_csv(rows, _STREAM["path"])


def read_csv(path: Path) -> list[dict]:
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def measure(env, device, *, op, impls, leaves, check, fields, work) -> list[dict]:
    """Time every impl in every mode on one case; one row each.

    impls: {name: fn(*leaves) -> out}; leaves: input tensors that get gradients; check(name)
    -> the `pass` verdict of that impl; fields: the case's shape columns; work(mode) -> (flops, bytes), either
    None. An impl that refuses the case (RuntimeError/ValueError) is reported and skipped.
    """
    rows = []
    for name, fn in impls.items():
        try:
            verdict = check(name)
            grads_of = [t.detach().requires_grad_() for t in leaves]
            callables = mode_callables(lambda fn=fn, g=grads_of: fn(*g), grads_of)
        except (RuntimeError, ValueError) as exc:  # e.g. SDPA flash refuses a mask
            print(f"  {op} {name}: not run for {fields}: {str(exc).splitlines()[0][:120]}")
            continue
        for mode, call in callables.items():
            try:
                ms, spread = time_stats(call, device=device)
                peak = peak_memory_mb(call, device=device)
            except torch.cuda.OutOfMemoryError:  # the naive path at large T: part of the story
                torch.cuda.empty_cache()
                rows.append(make_row(env, op=op, mode=mode, impl=name, note="out of memory",
                                     **fields))  # fmt: skip
                stream(rows[-1])
                print(f"  {op} {mode} {name}: out of memory for {fields}")
                continue
            flops, nbytes = work(mode)
            speed = None if nbytes is None else gbps(nbytes, ms)
            copy = env.get("copy_gbps")
            row = make_row(
                env, op=op, mode=mode, impl=name, ms=ms,
                tflops=None if flops is None else tflops(flops, ms), gbps=speed,
                pct_of_copy=None if speed is None or not copy else 100.0 * speed / copy,
                peak_mem_mb=peak, spread=spread, note=noisy(spread).lstrip("; ") or None,
                **fields, **{"pass": verdict},
            )  # fmt: skip
            progress(row)
            rows.append(row)
        del callables
    return rows


def run_once(impls: dict, leaves: list, check: Callable) -> list[str]:
    """Call each impl as `measure` would (its check, then fwd and fwd+bwd once), untimed: what
    a warm-up needs compiled. Returns '<impl>: <error>' for each that failed."""
    failed = []
    for name, fn in impls.items():
        try:
            check(name)
            grads_of = [t.detach().requires_grad_() for t in leaves]
            callables = mode_callables(lambda fn=fn, g=grads_of: fn(*g), grads_of)
            callables["fwd"]()
            callables["fwd+bwd"]()
        except Exception as exc:  # a refusal or a compile error: measure reports it later
            failed.append(f"{name}: {str(exc).splitlines()[0][:120] if str(exc) else repr(exc)}")
    return failed


def _warm_child(module: str, index: int, quick: bool, device: str) -> list[str]:
    import contextlib
    import importlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # the timing run says it all once
        return importlib.import_module(module).warm(index, quick, torch.device(device))


def warm_in_parallel(module: str, n_cases: int, quick: bool, device: torch.device,
                     jobs: int) -> None:  # fmt: skip
    """Run `<module>.warm(i, quick, device)` for every case i in `jobs` spawned processes, so
    Triton compiles the family's kernels on every core at once and the timing run finds them in
    its on-disk cache (same machine, same environment: the same cache keys). Never fails the
    run: whatever goes wrong is printed and the timing run compiles the rest itself."""
    import concurrent.futures
    import multiprocessing

    if jobs < 1 or n_cases == 0:
        return
    start = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    failures = []
    try:
        with concurrent.futures.ProcessPoolExecutor(min(jobs, n_cases), mp_context=ctx) as pool:
            futures = [pool.submit(_warm_child, module, i, quick, str(device))
                       for i in range(n_cases)]  # fmt: skip
            for future in concurrent.futures.as_completed(futures):
                try:
                    failures += future.result()
                except Exception as exc:  # a child that died: its cases compile when timed
                    failures.append(repr(exc)[:200])
    except Exception as exc:  # no process pool here: everything compiles when timed
        failures.append(f"warm-up not run: {exc!r}"[:200])
    for f in failures:
        print(f"  warm-up: {f}")
    print(f"  compiled {n_cases} cases' kernels in {time.perf_counter() - start:.0f}s "
          f"on {min(jobs, n_cases)} processes", flush=True)  # fmt: skip


def cli(run: Callable, csv_name: str, argv=None, parts: dict[str, str] | None = None) -> None:
    """The command line of every bench_*.py: [--quick] [--out DIR]; with parts ({part: CSV
    name}, the first the default) also --part, handed to run as part= and naming the CSV."""
    import argparse

    parser = argparse.ArgumentParser(description=f"writes {csv_name}")
    parser.add_argument("--quick", action="store_true", help="small, CPU-friendly sizes")
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    if parts:
        parser.add_argument("--part", choices=tuple(parts), default=next(iter(parts)),
                            help="which rows: " + ", ".join(f"{p} ({c})" for p, c in parts.items()))  # fmt: skip
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    new_run()
    env = environment()
    out = args.out or REPO / "benchmarks" / "results" / device_slug(env)
    if parts:
        csv_name = parts[args.part]
    stream_to(out / csv_name)
    rows = run(args.quick, device, env, **({"part": args.part} if parts else {}))
    stream_to(None)
    print(f"wrote {write_csv(rows, out / csv_name)}")


KERNEL_BACKENDS = ("triton", "cuda")
_ANNOUNCED: set = set()  # (backend, reason) already said not to be measured in this run


def new_run() -> None:
    """Start a run: the backends not measured are said again, once."""
    _ANNOUNCED.clear()


def kernel_backends(op: str, device: torch.device) -> list[str]:
    """fusedattn's own kernel backends that can run `op` here; the rest are announced with
    their reasons. (reference and torch are measured as the naive and torch baselines.)"""
    from fusedattn.ops.core import backends

    report = backends.backend_report(device)[op]
    if device.type == "cpu" and not report["triton"]:
        report["triton"] = ["on the CPU Triton runs in its interpreter: tested, not timed"]
    for b in KERNEL_BACKENDS:
        reason = "; ".join(report[b])
        if report[b] and (b, reason) not in _ANNOUNCED:  # once per run and reason, not per case
            _ANNOUNCED.add((b, reason))
            print(f"  fusedattn-{b} not measured: {reason}")
    return [b for b in KERNEL_BACKENDS if not report[b]]


SPEED_UNITS = {"tflops": "TFLOP/s", "gbps": "GB/s", "tokens_per_s": "tok/s"}


def speed_column(rows: list[dict]) -> str | None:
    """The speed column these rows fill (tflops, gbps or tokens_per_s), if any."""
    return next((c for c in SPEED_UNITS if any(r[c] != "" for r in rows)), None)


def progress(row: dict) -> None:
    """Print the row's line and stream it to the family's CSV."""
    stream(row)
    shape = " ".join(
        f"{c}={row[c]}"
        for c in ("B", "H", "Tq", "Tk", "D", "M", "N", "causal", "mask")
        if row[c] != ""
    )
    speed = next((f"{row[c]} {unit}" for c, unit in SPEED_UNITS.items() if row[c] != ""), "-")
    noise = "  NOISY (repeats spread past 25 %: not in the summary)" if is_noisy(row) else ""
    print(
        f"  {row['op']:<10} {row['mode']:<7} {row['impl']:<16} {row['dtype']:<8} {shape:<44} "
        f"{row['ms']:>9} ms  {speed:>14}  pass={row['pass'][:3] or '-'}{noise}",
        flush=True,
    )


def is_noisy(row: dict) -> bool:
    """Whether a row's repeats disagreed (its note says NOISY)."""
    return "NOISY" in str(row.get("note") or "")
