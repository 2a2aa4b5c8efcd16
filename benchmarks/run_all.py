"""The benchmark suite (`make bench`): every kernel family on the available device.

    python benchmarks/run_all.py [--quick] [--out DIR] [--only attention,layernorm,softmax]
                                 [--device cpu|cuda]

Writes one CSV per family (harness.COLUMNS) into DIR (default benchmarks/results/<device>/)
and prints a progress line per case and a summary at the end. On a CPU it runs the reduced
suite and says so: speed on the CPU is not the product, the GPU sizes need a CUDA device.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_attention
import bench_layernorm
import bench_softmax
import harness
import torch

FAMILIES = {
    "attention": (bench_attention.run, "attention.csv"),
    "layernorm": (bench_layernorm.run, "layernorm.csv"),
    "softmax": (bench_softmax.run, "softmax.csv"),
}


def summarize(rows: list[dict]) -> list[str]:
    """Best impl per (op, mode) and how it compares with the naive path, one line each."""
    lines = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["op"], r["mode"], r["impl"]), []).append(r)
    for (op, mode, impl), rs in sorted(groups.items()):
        unit, key = ("TFLOP/s", "tflops") if rs[0]["tflops"] != "" else ("GB/s", "gbps")
        best = max(float(r[key]) for r in rs)
        speedups = [float(r["speedup_vs_naive"]) for r in rs if r["speedup_vs_naive"] != ""]
        failed = sum(1 for r in rs if r["pass"].startswith("no"))
        lines.append(
            f"  {op:<10} {mode:<7} {impl:<16} best {best:9.3f} {unit:<7}"
            f" median speedup vs naive {sorted(speedups)[len(speedups) // 2] if speedups else 0:6.2f}x"
            f"  {len(rs)} cases" + (f", {failed} FAILED the k× check" if failed else "")
        )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (CPU-friendly)")
    parser.add_argument("--out", type=Path, default=None, help="folder for the CSVs")
    parser.add_argument("--only", default=",".join(FAMILIES), help="comma-separated families")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    env = harness.environment(device)
    out = args.out or Path(__file__).resolve().parent / "results" / harness.device_slug(env)
    quick = args.quick
    if device.type != "cuda":
        print(
            "No CUDA device: running the reduced CPU suite (naive path vs torch's own ops at "
            "small sizes). The GPU sizes, the SDPA flash/efficient/cuDNN baselines, peak-memory "
            "curves and the Triton/CUDA kernels need a GPU."
        )
        quick = True
    print(
        f"device {env['device']}, torch {env['torch']}, triton {env['triton']}, "
        f"git {env['git_sha']}, results -> {out}"
    )

    all_rows, failed = [], 0
    for name in args.only.split(","):
        if name not in FAMILIES:
            parser.error(f"unknown family {name!r}; choose from {', '.join(FAMILIES)}")
        run, csv_name = FAMILIES[name]
        start = time.perf_counter()
        print(f"== {name}")
        rows = run(quick, device, env)
        path = harness.write_csv(rows, out / csv_name)
        print(f"== {name}: {len(rows)} rows in {time.perf_counter() - start:.0f}s -> {path}")
        all_rows += rows
        failed += sum(1 for r in rows if r["pass"].startswith("no"))
    print("\nSummary")
    print("\n".join(summarize(all_rows)))
    if failed:
        print(f"\n{failed} measurements FAILED the k× correctness check (see the pass column)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
