"""Model level: tokens/s and peak memory of whole models, fusedattn against what users run.

    python benchmarks/bench_model.py [--quick] [--out DIR] [--isolate row|none]
        [--only-models a,b] [--only-impls x,y] [--only-modes infer,train] [--compile-jobs N]
        [--deadline SECONDS]

The baselines are what a user has without fusedattn (model_cases.py): Hugging Face models
(`hf:<name>`) with transformers' own attn_implementation (eager, sdpa, flash_attention_2 where
installed) and the reference transformer (`model:<name>`) on torch's own SDPA and
F.layer_norm (`sdpa`); against them fusedattn's hook or swapped modules (`fusedattn` / `auto`,
and each kernel backend). Modes: infer, train (eager), infer-compiled, train-compiled
(torch.compile: mode="reduce-overhead" for inference on a GPU; dynamo's eager backend on the
CPU, a trace with no speed meaning), for baselines and fusedattn alike.

Isolation: with --isolate row (the default on a GPU) each (model, impl) runs its eager modes
in a process of its own and each compiled mode in another, so no row is timed after something
else compiled or autotuned in its process (the 2026-11-28 H200 eager rows were timed after a
reduce-overhead compile and a dynamo reset). The compiled processes first compile in
--compile-jobs parallel processes (inductor's and Triton's on-disk caches), then time one by
one. --isolate none (the CPU default) runs everything in this process, eager rows before any
compile.

Each row is warmed up to a steady state (consecutive calls within 10 %), then timed (median
of the repeats and their spread); a row whose spread passes 10 % is timed again and, if it
stays above, its note says so. The pass column is the k× check (k = 3) of the logits against
float64 (model_cases.check).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import harness
import model_cases
import torch
from model_cases import MODES, Case

RETIME_SPREAD = 0.10  # a row whose repeats spread more is timed again, then marked
ROW_PREFIX = "MODEL_ROW "  # how a child process hands its rows back on stdout
HERE = Path(__file__).resolve().parent


def _steady(fn, device, *, limit: int = 10) -> None:
    """Call fn until two consecutive calls take times within 10 % (compiles, autotuning,
    CUDA-graph recording and allocator growth done), at most `limit` calls."""
    last = None
    for _ in range(limit):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        took = time.perf_counter() - start
        if last is not None and abs(took - last) <= 0.1 * max(took, last):
            return
        last = took


def _timed(fn, device) -> tuple[float, float, str]:
    """(median ms, spread, note): timed again once when the spread passes RETIME_SPREAD."""
    ms, spread = harness.time_stats(fn, device=device, reps=3)
    note = ""
    if spread > RETIME_SPREAD:
        ms, spread = harness.time_stats(fn, device=device, reps=5)
        if spread > RETIME_SPREAD:
            note = f"NOISY: repeats spread {spread:.0%} after re-timing"
    return ms, spread, note


def _step(case: Case, model, inputs: dict, mode: str, device: torch.device):
    """The callable one row times; None (said) when the compile fails."""
    compiled = mode.endswith("-compiled")
    train = mode.startswith("train")
    model.train(train)
    if not train:
        body = lambda: model_cases.forward(case, model, inputs)  # noqa: E731
    else:
        body = lambda: model_cases.loss(case, model, inputs)  # noqa: E731
    if compiled:
        options = dict(backend="eager") if device.type != "cuda" else (
            dict(mode="reduce-overhead") if not train else {})  # fmt: skip
        body = torch.compile(body, fullgraph=case.family == "model", **options)

    def call():
        if train:
            body().backward()
            model.zero_grad(set_to_none=True)
            return None
        with torch.no_grad():
            return body()

    try:
        call()
    except Exception as exc:  # a benchmark reports what it could not run, it does not stop
        print(f"  {case.op} {mode}: not run ({type(exc).__name__}: {exc})"[:300], flush=True)
        return None
    return call


def run_group(case: Case, impl: str, modes: tuple[str, ...], device: torch.device,
              env: dict) -> list[dict]:  # fmt: skip
    """Every length of one (case, impl) in the given modes, in this process: one row each."""
    model, naive = model_cases.build(case, impl, device)
    verdict = model_cases.check(case, model, naive, device)
    del naive
    rows = []
    heads = case.config.get("n_heads") or case.config.get("heads")
    width = case.config.get("d_model") or case.config.get("hidden")
    for mode in modes:
        for T in case.lengths:
            B = max(1, case.tokens // T)
            inputs = model_cases.batch(case, T, B, device)
            fields = dict(op=case.op, mode=mode, impl=impl, dtype=str(case.dtype)[6:], B=B,
                          H=heads, Tq=T, Tk=T, D=width)  # fmt: skip
            try:
                fn = _step(case, model, inputs, mode, device)
                if fn is None:
                    rows.append(harness.make_row(env, **fields, note="not compiled"))
                    harness.stream(rows[-1])
                    continue
                _steady(fn, device, limit=10 if device.type == "cuda" else 2)
                ms, spread, note = _timed(fn, device)
                peak = harness.peak_memory_mb(fn, device=device)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                rows.append(harness.make_row(env, **fields, note="out of memory"))
                harness.stream(rows[-1])
                print(f"  {case.op} {mode} {impl} T={T}: out of memory", flush=True)
                continue
            row = harness.make_row(env, **fields, ms=ms, peak_mem_mb=peak,
                                   tokens_per_s=B * T / (ms * 1e-3), spread=spread,
                                   note=note or None, **{"pass": verdict})  # fmt: skip
            harness.progress(row)
            rows.append(row)
    return rows


def plan(quick: bool, device: torch.device, models=None, impls=None, modes=MODES,
         isolate: str = "none"):  # fmt: skip
    """[(case, impl, modes)]: each (case, impl)'s eager modes as one group, each compiled mode
    as a group of its own. In one process (isolate "none") every eager group comes before
    any compiled one; in processes of their own (a GPU run a deadline may cut) auto against
    the user baselines first, eager then compiled, then fusedattn's other backends."""
    tiers = {0: [], 1: [], 2: [], 3: []}
    for case in model_cases.cases(quick, device):
        if models and case.name not in models:
            continue
        for impl in model_cases.impls(case, device):
            if impls and impl not in impls:
                continue
            main = impl in (*model_cases.BASELINES, *model_cases.HF_HOOKS.keys(), "auto")
            main = main and impl not in ("fusedattn-triton", "fusedattn-cuda")
            plain = tuple(m for m in modes if not m.endswith("-compiled"))
            if plain:
                tiers[0 if main else 2].append((case, impl, plain))
            if impl != "naive":  # the O(T^2) modules are the correctness yardstick, not a target
                tiers[1 if main else 3] += [(case, impl, (m,)) for m in modes
                                            if m.endswith("-compiled")]  # fmt: skip
    order = (0, 2, 1, 3) if isolate == "none" else (0, 1, 2, 3)
    return [group for tier in order for group in tiers[tier]]


def _child(case: Case, impl: str, modes, quick: bool, device, *, warm: bool = False,
           timeout: float = 900.0) -> list[dict]:  # fmt: skip
    """Run one group in a fresh process; its rows (or a failed row per mode)."""
    spec = json.dumps(dict(model=case.name, impl=impl, modes=list(modes), quick=quick,
                           device=str(device), warm=warm))  # fmt: skip
    cmd = [sys.executable, str(HERE / "bench_model.py"), "--group", spec]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        out, failed = done.stdout, done.returncode != 0 and f"exit {done.returncode}"
        err = done.stderr
    except subprocess.TimeoutExpired as exc:
        out, failed, err = exc.stdout or "", f"timed out after {timeout:.0f} s", ""
        out = out if isinstance(out, str) else out.decode()
    rows = [json.loads(line[len(ROW_PREFIX):]) for line in out.splitlines()
            if line.startswith(ROW_PREFIX)]  # fmt: skip
    for line in out.splitlines():
        if not line.startswith(ROW_PREFIX) and not warm:
            print(line, flush=True)
    if failed:
        tail = " | ".join(err.strip().splitlines()[-2:])[:200]
        print(f"  {case.op} {impl} {','.join(modes)}: process {failed}: {tail}", flush=True)
        if not warm and not rows:
            env = harness.environment(device)
            rows = [harness.make_row(env, op=case.op, mode=m, impl=impl,
                                     dtype=str(case.dtype)[6:], note=f"process {failed}")
                    for m in modes]  # fmt: skip
    for row in rows:
        harness.stream(row)
    return rows


def _warm_compiled(groups, quick, device, jobs: int, timeout: float = 600.0) -> None:
    """Compile every compiled group once in `jobs` processes at a time (inductor's FX-graph
    and Triton caches on disk), so the timing processes find their kernels built; a group
    still compiling after `timeout` seconds is left to its timing process."""
    import concurrent.futures

    compiled = [g for g in groups if g[2][0].endswith("-compiled")]
    if jobs < 1 or not compiled:
        return
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        list(pool.map(lambda g: _child(*g, quick, device, warm=True, timeout=timeout),
                      compiled))  # fmt: skip
    print(f"  compiled {len(compiled)} model groups in {time.perf_counter() - start:.0f}s "
          f"on {jobs} processes", flush=True)  # fmt: skip


def run(quick: bool, device: torch.device, env: dict, *, isolate: str | None = None,
        models=None, impls=None, modes=MODES, compile_jobs: int | None = None,
        deadline: float | None = None) -> list[dict]:  # fmt: skip
    """deadline: seconds from now after which no group starts (isolate "row"; a child still
    running then is stopped at it), so a device call ends with its rows written."""
    start = time.monotonic()
    isolate = isolate or ("row" if device.type == "cuda" else "none")
    groups = plan(quick, device, models, impls, modes, isolate)
    rows = []
    if isolate == "row":
        jobs = compile_jobs if compile_jobs is not None else (4 if device.type == "cuda" else 0)
        _warm_compiled(groups, quick, device, jobs, 600.0 if deadline is None else 0.35 * deadline)
        for case, impl, group_modes in groups:
            left = None if deadline is None else deadline - (time.monotonic() - start)
            if left is not None and left < 10:
                print(f"  {case.op} {impl} {','.join(group_modes)}: not run, the deadline "
                      f"({deadline:.0f} s) is reached", flush=True)  # fmt: skip
                continue
            rows += _child(case, impl, group_modes, quick, device,
                           timeout=900.0 if left is None else left)  # fmt: skip
    else:
        for case, impl, group_modes in groups:
            if group_modes[0].endswith("-compiled"):
                torch._dynamo.reset()  # each compiled group traces from scratch
            rows += run_group(case, impl, group_modes, device, env)
    harness.add_speedups(rows)
    return rows


def _group_main(spec: str) -> None:
    """A child process: run one group, print its rows (--group)."""
    s = json.loads(spec)
    device = torch.device(s["device"])
    case = next(c for c in model_cases.cases(s["quick"], device) if c.name == s["model"])
    if s["warm"]:  # compile (and run once) each mode at each length, time nothing
        model, _ = model_cases.build(case, s["impl"], device)
        for mode in s["modes"]:
            for T in case.lengths:
                inputs = model_cases.batch(case, T, max(1, case.tokens // T), device)
                _step(case, model, inputs, mode, device)
        return
    env = harness.environment(device)
    rows = run_group(case, s["impl"], tuple(s["modes"]), device, env)
    for row in rows:
        print(ROW_PREFIX + json.dumps(row), flush=True)


def main(argv=None) -> None:
    import argparse

    if argv is None and "--group" in sys.argv:
        return _group_main(sys.argv[sys.argv.index("--group") + 1])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--isolate", choices=("row", "none"), default=None)
    parser.add_argument("--only-models", default=None, help="comma-separated case names")
    parser.add_argument("--only-impls", default=None, help="comma-separated impls")
    parser.add_argument("--only-modes", default=None, help="comma-separated modes")
    parser.add_argument("--compile-jobs", type=int, default=None)
    parser.add_argument(
        "--deadline",
        type=float,
        default=None,
        help="seconds after which no more groups start (a device call's limit)",
    )
    args = parser.parse_args(argv)
    split = lambda s: tuple(s.split(",")) if s else None  # noqa: E731

    def run_selected(quick, device, env):
        return run(quick, device, env, isolate=args.isolate, models=split(args.only_models),
                   impls=split(args.only_impls), modes=split(args.only_modes) or MODES,
                   compile_jobs=args.compile_jobs, deadline=args.deadline)  # fmt: skip

    argv_rest = ["--quick"] * args.quick + (["--out", str(args.out)] if args.out else [])
    harness.cli(run_selected, "model.csv", argv_rest)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
