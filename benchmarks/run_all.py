"""The benchmark suite (`make bench`): every kernel family on the available device.

    python benchmarks/run_all.py [--quick] [--out DIR] [--only FAMILY,...] [--device cpu|cuda]
                                 [--compare OLD] [--tolerance 0.05] [--no-plots]
                                 [--compile-jobs N]

Families: attention (incl. a sliding-window and a packed-varlen row), layernorm, rmsnorm,
softmax, decode (attention over a KV cache, contiguous and paged, and generate tokens/s), fp8
(decoding over an fp8 cache and the fp8 forward against their bf16 twins and SDPA), model
(tokens/s and peak memory of whole models), demo (a training run, naive vs
fused). Default: all of them on a GPU; on a CPU all but demo (the demo trains two models for
700 steps: 58 s measured on the 2-core CPU machine, 2026-11-27; `--only demo` runs it).

Writes one CSV and one PNG per family (harness.COLUMNS) into DIR (default
benchmarks/results/<device>/), prints a progress line per case and a summary at the end.
Each row reaches its CSV as soon as it is measured, so a run stopped by a time limit keeps
what it finished. On a GPU the attention family first compiles its Triton kernels in
--compile-jobs processes at once (Triton's on-disk cache), then times them.
On a CPU it runs the reduced suite and says so (17 s on the 2-core CPU machine, measured
2026-11-27, plots included): speed on the CPU is not the product, the GPU sizes need a CUDA
device.

Exit status: 0 when every measurement passed; 1 if a measurement fails the k× correctness
check; 2 if --compare finds a regression (slower than OLD beyond the tolerance, or newly
incorrect).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_attention
import bench_decode
import bench_demo
import bench_fp8
import bench_layernorm
import bench_model
import bench_rmsnorm
import bench_softmax
import harness
import report
import torch

FAMILIES = {
    "attention": (bench_attention.run, "attention.csv"),
    "layernorm": (bench_layernorm.run, "layernorm.csv"),
    "rmsnorm": (bench_rmsnorm.run, "rmsnorm.csv"),
    "softmax": (bench_softmax.run, "softmax.csv"),
    "decode": (bench_decode.run, "decode.csv"),
    "fp8": (bench_fp8.run, "fp8.csv"),
    "model": (bench_model.run, "model.csv"),
    "demo": (bench_demo.run, "demo.csv"),
}
PLOTS = {
    "demo": bench_demo.plot,
    "decode": bench_decode.plot,
}  # families with their own plot; the rest use report.plot


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (CPU-friendly)")
    parser.add_argument("--out", type=Path, default=None, help="folder for the CSVs")
    parser.add_argument("--only", default=None,
                        help="comma-separated families (default: all; all but demo on a CPU)")  # fmt: skip
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--compare", type=Path, help="older CSV or folder: report regressions")
    parser.add_argument("--tolerance", type=float, default=report.DEFAULT_TOLERANCE,
                        help="relative slowdown counted as a regression")  # fmt: skip
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--compile-jobs", type=int, default=None,
                        help="processes that compile the attention family's Triton kernels "
                             "before it is timed (default: the CPU count, at most 16, on a "
                             "GPU; 0 on a CPU or to compile while timing)")  # fmt: skip
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    harness.new_run()
    env = harness.environment(device)
    env["copy_gbps"] = harness.copy_gbps(device)  # the norms' ceiling, measured in this run
    out = args.out or Path(__file__).resolve().parent / "results" / harness.device_slug(env)
    quick = args.quick
    families = args.only or ",".join(f for f in FAMILIES if device.type == "cuda" or f != "demo")
    if device.type != "cuda" and args.only is None:
        print("demo skipped on a CPU by default (about a minute on 2 cores): --only demo")
    if device.type != "cuda":
        print(
            "No CUDA device: running the reduced CPU suite (naive path vs torch's own ops at "
            "small sizes). The GPU sizes, the SDPA flash/efficient/cuDNN baselines, peak-memory "
            "curves and the Triton/CUDA kernels need a GPU."
        )
        quick = True
    print(
        f"device {env['device']}, torch {env['torch']}, triton {env['triton']}, "
        f"git {env['git_sha']}"
        + (f", copy {env['copy_gbps']:.0f} GB/s" if env["copy_gbps"] else "")
        + f", results -> {out}"
    )

    all_rows, failed = [], 0
    for name in families.split(","):
        if name not in FAMILIES:
            parser.error(f"unknown family {name!r}; choose from {', '.join(FAMILIES)}")
        run, csv_name = FAMILIES[name]
        start = time.perf_counter()
        print(f"== {name}")
        module = sys.modules.get(run.__module__)
        jobs = args.compile_jobs
        if jobs is None:
            jobs = min(16, os.cpu_count() or 1) if device.type == "cuda" else 0
        if jobs and hasattr(module, "warm"):
            harness.warm_in_parallel(run.__module__, len(module.cases(quick, device)), quick,
                                     device, jobs)  # fmt: skip
        harness.stream_to(out / csv_name)  # rows reach the CSV as they finish
        rows = run(quick, device, env)
        harness.stream_to(None)
        path = harness.write_csv(rows, out / csv_name)
        print(f"== {name}: {len(rows)} rows in {time.perf_counter() - start:.0f}s -> {path}")
        if not args.no_plots and rows:
            plotter = PLOTS.get(name, report.plot)
            print(f"   plot -> {plotter(rows, path.with_suffix('.png'))}")
        all_rows += rows
        failed += sum(1 for r in rows if r["pass"].startswith("no"))
    print("\nSummary")
    print("\n".join(report.summarize(all_rows)))
    if failed:
        print(f"\n{failed} measurements FAILED the k× correctness check (see the pass column)")
        return 1
    if args.compare:
        regressions = report.compare(all_rows, report.load(args.compare), tolerance=args.tolerance)
        print(f"\n{len(regressions)} regressions against {args.compare}")
        for r in regressions:
            print(f"  {r}")
        if regressions:
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
