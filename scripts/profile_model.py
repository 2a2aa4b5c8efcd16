"""Where a model's step goes, per impl: the backend `auto` picked for each op call, the step's
median time, and the GPU kernels that took the most time (torch.profiler), so a row where
`auto` trails the best baseline a user has says where the time went.

    python3 scripts/profile_model.py [--model bert-base-padded] [--T 512] [--mode infer]
                                     [--impls sdpa,auto]

The models, impls and batches are bench_model.py's (model_cases.py: B*T = 16k tokens, bf16;
`model:` cases take sdpa, naive, fusedattn-torch, auto, fusedattn-triton, fusedattn-cuda;
`hf:` cases eager, sdpa, fusedattn, fusedattn-triton, fusedattn-cuda). Why: on the H200
(2026-11-28) padded BERT at T=512 ran 0.70x under auto against fusedattn's own SDPA wrapper;
the `models` preset profiles it against plain SDPA. CPU: a tiny model, to check it runs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402
import model_cases  # noqa: E402

from fusedattn.ops.core import auto, backends, plans  # noqa: E402


@contextlib.contextmanager
def record_choices():
    """Count (op, key, backend chosen) of every auto call inside the block (every op
    dispatches through backends.select once plans are bypassed); select restored after it."""
    seen = collections.Counter()
    select = backends.select

    def recording(op, backend, device, inputs):
        impl = select(op, backend, device, inputs)
        if backend == "auto":
            seen[(op, auto.call_key(op, inputs), impl.backend)] += 1
        return impl

    backends.select = recording
    try:
        with plans.bypassed():
            yield seen
    finally:
        backends.select = select


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert-base-padded")
    parser.add_argument("--T", type=int, default=512)
    parser.add_argument("--mode", choices=("infer", "train"), default="infer")
    parser.add_argument("--impls", default="sdpa,auto")
    parser.add_argument("--top", type=int, default=8, help="kernels listed per impl")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases = {c.name: c for c in model_cases.cases(quick=True, device=device)}
    case = cases[args.model]
    T = args.T if device.type == "cuda" else case.lengths[0]
    B = max(1, case.tokens // T)
    inputs = model_cases.batch(case, T, B, device)
    print(f"{case.op} {args.mode} B={B} T={T} on {device}")
    times = {}
    with record_choices() as seen:
        for impl in args.impls.split(","):
            times[impl] = profile(impl, case, inputs, seen, args, device)
    fastest = min(times, key=times.get)
    print("\n" + ", ".join(f"{impl} {ms:.2f} ms ({times[fastest] / ms:.2f}x the fastest)"
                           for impl, ms in times.items()))  # fmt: skip
    return 0


def profile(impl, case, inputs, seen, args, device) -> float:
    """One impl: the step time, auto's choices in one step, the top kernels."""
    model, _ = model_cases.build(case, impl, device)
    model.train(args.mode == "train")

    def step(model=model):
        if args.mode == "infer":
            with torch.no_grad():
                return model_cases.forward(case, model, inputs)
        model_cases.loss(case, model, inputs).backward()
        model.zero_grad(set_to_none=True)

    step()
    seen.clear()
    step()
    choices = sorted(seen.items(), key=lambda kv: str(kv[0]))
    ms, spread = harness.time_stats(step, device=device, reps=3)
    print(f"\n== {impl}: {ms:.2f} ms per {args.mode} step (repeats spread {spread:.0%})")
    for (op, key, chosen), n in choices:
        print(f"  auto: {n:3d} x {op} {key} -> {chosen}")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.top, max_name_column_width=60))
    return ms


if __name__ == "__main__":
    sys.exit(main())
