"""Turn a tuning run's CSV into the tile table the Triton attention kernels read.

    python scripts/build_tile_table.py benchmarks/results/h200/tune_triton_attention.csv \\
        [more CSVs] [--margin 0.02] [--out triton_kernels/attention_tiles.py]

Reads scripts/tune_triton_attention.py's rows (arch, case, T, kernel, tiles, speedup, pass).
Per card (arch), head-dim block (64 or 128, from the case: d64*, d128*) and kernel (fwd, dq,
dkdv), over the plain and causal cases (d64, d64c, d128, d128c) at every length run: each
candidate's geometric-mean speedup over the shipped tiles, counting only candidates that
passed the float64 check and ran in every one of those cases and lengths. The best one goes
into the table when it beats the shipped tiles by more than --margin; otherwise the kernel
keeps attention_config's rules (so the table holds what a measurement showed, nothing else).
Writes the table and prints what it chose and why.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import pprint
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHOSEN_FROM = {"d64": 64, "d64c": 64, "d128": 128, "d128c": 128}  # plain and causal cases
KERNELS = ("fwd", "dq", "dkdv")


def choose(rows: list[dict], margin: float) -> tuple[dict, list[str]]:
    """({arch: {head-dim block: {kernel: spec}}}, the reasons, one line each)."""
    points = defaultdict(set)  # (arch, block, kernel) -> the (case, T) points measured
    speedups = defaultdict(dict)  # (arch, block, kernel) -> spec -> {(case, T): speedup}
    for r in rows:
        block = CHOSEN_FROM.get(r.get("case", ""))
        if block is None or r.get("kernel") not in KERNELS or r.get("arch") in (None, "", "0"):
            continue  # arch 0: the CPU dry run
        where = (int(r["arch"]), block, r["kernel"])
        point = (r["case"], r["T"])
        points[where].add(point)
        if r.get("pass") == "yes" and r.get("speedup") and r.get("tiles") != "shipped":
            speedups[where].setdefault(r["tiles"], {})[point] = float(r["speedup"])
    table: dict = defaultdict(lambda: defaultdict(dict))
    notes = []
    for where in sorted(points):
        arch, block, kernel = where
        whole = {spec: s for spec, s in speedups[where].items() if set(s) == points[where]}
        if not whole:
            notes.append(f"sm_{arch} D<={block} {kernel}: no candidate passed everywhere: rules")
            continue
        score = {
            spec: math.exp(sum(map(math.log, s.values())) / len(s)) for spec, s in whole.items()
        }
        spec, best = max(score.items(), key=lambda kv: kv[1])
        if best > 1 + margin:
            table[arch][block][kernel] = spec
            notes.append(f"sm_{arch} D<={block} {kernel}: {spec}, {best:.3f}x the shipped "
                         f"(geometric mean over {len(points[where])} points)")  # fmt: skip
        else:
            notes.append(f"sm_{arch} D<={block} {kernel}: shipped kept (best {spec} {best:.3f}x)")
    return {a: dict(b) for a, b in table.items()}, notes


def render(table: dict, sources: list[str], notes: list[str]) -> str:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    head = Path(ROOT / "triton_kernels" / "attention_tiles.py").read_text().split('"""')[1]
    source = f"{', '.join(sources)} ({stamp}): " + "; ".join(notes)
    return (f'"""{head}"""\n\nSOURCE = {source!r}\n\n'
            f"TABLE: dict[int, dict[int, dict[str, str]]] = {pprint.pformat(table, width=90)}\n")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csvs", nargs="+", type=Path)
    parser.add_argument("--margin", type=float, default=0.02)
    parser.add_argument("--out", type=Path, default=ROOT / "triton_kernels" / "attention_tiles.py")
    args = parser.parse_args(argv)
    rows = [r for path in args.csvs for r in csv.DictReader(path.open())]
    table, notes = choose(rows, args.margin)
    print("\n".join(notes))
    args.out.write_text(render(table, [str(p) for p in args.csvs], notes))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
