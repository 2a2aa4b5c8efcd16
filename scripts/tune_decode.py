"""The Triton decode kernel's key splits per (sequence, kv head): the count num_splits=0 picks
(ops/decode.py, choose_splits: two programs per SM) against half, 2x and 4x that, timed from
a CUDA graph so that the kernels' time shows, not the host's (batch 1 is host-bound eager).

    python3 scripts/tune_decode.py [--out DIR]

Why: on the H200 (2026-11-27, benchmarks/results/h200/decode.csv) a paged-16 cache at batch 8
with 32k keys took 1.68x the contiguous cache's time (0.48 against 0.29 ms), within 3 % at
batch 64: with 2.4 programs per SM each waits on its block-table read before its K/V loads,
and more splits put more loads in flight. Llama-3-8B heads (Hq 32, Hkv 8, D 128), bf16, one
new query; GB/s of K/V read and % of the copy rate measured in the same run. Each output is
checked against the chosen split count's (max_abs_diff: the fp32 partials merge in another
order). CPU: a tiny case through the interpreter, eager, to check the script runs.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the CPU smoke run: Triton's interpreter, set before import
    os.environ.setdefault("TRITON_INTERPRET", "1")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_decode  # noqa: E402
import harness  # noqa: E402

import fusedattn  # noqa: E402
from fusedattn.ops.core.kernels import kernels  # noqa: E402
from fusedattn.ops.shared import decode_launch as decode  # noqa: E402

GPU_CASES = ((1, 32768, "contiguous"), (1, 32768, "paged16"), (8, 8192, "contiguous"),
             (8, 32768, "contiguous"), (8, 32768, "paged16"), (64, 32768, "paged16"))  # fmt: skip
CPU_CASES = ((2, 256, "paged16"),)


def chosen_splits(B: int, L: int, hq: int, hkv: int, dim: int, device) -> int:
    """What num_splits=0 picks for one new query per sequence (ops/decode.py's own rule)."""
    cfg = kernels("decode").decode_config(hq // hkv, dim, dim, device.type == "cuda")
    return decode.default_splits(cfg, B * hkv, L, device)


def write(rows: list[dict], path: Path | None) -> None:
    """The CSV so far, rewritten after each case (a run cut by gpu_check's limit keeps it)."""
    if path is None or not rows:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def tune_case(B, L, layout, device, dtype, hq, hkv, dim, copy) -> list[dict]:
    torch.manual_seed(0)
    k_cache, v_cache, table = bench_decode.make_cache(B, L, layout, device, dtype, hkv, dim)
    q = torch.randn(B, 1, hq, dim, device=device, dtype=dtype)
    kv_bytes = B * L * hkv * 2 * dim * k_cache.element_size()
    n0 = chosen_splits(B, L, hq, hkv, dim, device)
    on_gpu = device.type == "cuda"

    def call(n):
        return fusedattn.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=L, block_table=table, num_splits=n,
            backend="triton",
        )  # fmt: skip

    rows = []
    with torch.inference_mode():
        want = call(n0)
        for n in sorted({max(1, n0 // 2), n0, min(128, 2 * n0), min(128, 4 * n0)}):
            fn = lambda n=n: call(n)  # noqa: E731
            timed = harness.cuda_graph(fn) if on_gpu else fn
            diff = (timed().float() - want.float()).abs().max().item()
            ms, spread = harness.time_stats(timed, device=device, reps=3)
            speed = harness.gbps(kv_bytes, ms)
            row = dict(B=B, L=L, layout=layout, num_splits=n, chosen=n == n0,
                       timing="cuda graph" if on_gpu else "eager (CPU interpreter)",
                       ms=round(ms, 4), gbps=round(speed, 1),
                       pct_of_copy=round(100 * speed / copy, 1) if copy else "",
                       spread=round(spread, 3), max_abs_diff=diff)  # fmt: skip
            print("  " + "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)
            rows.append(row)
    return rows


def run(device, copy, out: Path | None) -> list[dict]:
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    hq, hkv, dim = (bench_decode.HQ, bench_decode.HKV, bench_decode.D) if on_gpu else (4, 2, 64)
    rows = []
    for B, L, layout in GPU_CASES if on_gpu else CPU_CASES:
        rows += tune_case(B, L, layout, device, dtype, hq, hkv, dim, copy)
        write(rows, out)
        if on_gpu:
            torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = harness.environment(device)
    copy = harness.copy_gbps(device)
    print(f"device {env['device']}, torch {env['torch']}, triton {env['triton']}, "
          f"git {env['git_sha']}, copy {copy} GB/s")  # fmt: skip
    path = None if args.out is None else args.out / "tune_decode.csv"
    rows = run(device, copy, path)
    if path is not None:
        print(f"wrote {path} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
