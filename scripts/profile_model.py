"""Where a swapped model's step goes, per impl: the backend `auto` picked for each op call, the
step's median time, and the GPU kernels that took the most time (torch.profiler).

    python3 scripts/profile_model.py [--model gpt2-small] [--T 512] [--mode infer]
                                     [--impls torch,auto,cuda,triton]

Why: on the H200 (2026-11-27, benchmarks/results/h200/model.csv) GPT-2-small inference at
T=512 took 28.7 ms with `auto` against 12.5 ms swapped to torch and 9.4 ms to cuda, while
`auto` then sent attention to torch and LayerNorm to cuda, the pieces of the two faster rows.
This prints what each variant ran, so the next GPU run says why. The models and batches are
bench_model.py's (B*T = 16k tokens, bf16). CPU: a tiny model, to check the script runs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_model  # noqa: E402
import harness  # noqa: E402

import fusedattn  # noqa: E402
from fusedattn.ops.core import auto, backends, plans  # noqa: E402
from fusedattn.reference.transformer import Transformer  # noqa: E402


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
    parser.add_argument("--model", default="gpt2-small")
    parser.add_argument("--T", type=int, default=512)
    parser.add_argument("--mode", choices=("infer", "train"), default="infer")
    parser.add_argument("--impls", default="torch,auto,cuda,triton")
    parser.add_argument("--top", type=int, default=8, help="kernels listed per impl")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases = {c.name: c for c in bench_model.cases(quick=True, device=device)}
    case = cases.get(args.model) or next(iter(cases.values()))
    T = args.T if device.type == "cuda" else case.lengths[0]
    B = max(1, case.tokens // T)
    torch.manual_seed(0)
    naive = Transformer(case.cfg).to(device=device, dtype=case.dtype)
    src, tgt = bench_model.batch(case, T, B, device)
    print(f"{case.name} {args.mode} B={B} T={T} on {device}")
    with record_choices() as seen:
        for impl in args.impls.split(","):
            profile(impl, naive, case, src, tgt, seen, args, device)
    return 0


def profile(impl, naive, case, src, tgt, seen, args, device):
    """One variant: the step time, auto's choices in one step, the top kernels."""
    model = fusedattn.swap_modules(copy.deepcopy(naive), backend=impl)
    model.train(args.mode == "train")

    def step(model=model):
        if args.mode == "infer":
            with torch.no_grad():
                return bench_model.forward(model, case, src, tgt)
        model.loss(src, tgt).backward()
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


if __name__ == "__main__":
    sys.exit(main())
