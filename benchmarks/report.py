"""Reading results: the summary table, the regression check against an older CSV, and plots.

python benchmarks/report.py NEW_DIR_OR_CSV [--compare OLD_DIR_OR_CSV] [--tolerance 0.05]
                                           [--plot]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import harness

KEY_COLUMNS = ("op", "mode", "impl", "dtype", "B", "H", "Tq", "Tk", "D", "M", "N", "causal", "mask")
# do_bench medians on an H100/H200 repeat within ~2%; 5% keeps noise out of the gate.
DEFAULT_TOLERANCE = 0.05


def load(path: Path) -> list[dict]:
    """Rows of one CSV, or of every *.csv in a folder."""
    path = Path(path)
    files = sorted(path.glob("*.csv")) if path.is_dir() else [path]
    return [row for f in files for row in harness.read_csv(f)]


def row_key(row: dict) -> tuple:
    return tuple(str(row.get(c, "")) for c in KEY_COLUMNS)


@dataclass(frozen=True)
class Regression:
    key: tuple
    what: str  # "slower" or "incorrect"
    old: str
    new: str

    def __str__(self):
        case = " ".join(f"{c}={v}" for c, v in zip(KEY_COLUMNS, self.key, strict=True) if v)
        return f"{self.what}: {case}: {self.old} -> {self.new}"


def compare(new_rows, old_rows, *, tolerance=DEFAULT_TOLERANCE) -> list[Regression]:
    """Cases measured in both runs that got slower beyond `tolerance` (relative ms), or that
    passed the correctness check before and fail it now. Cases in only one run are ignored."""
    old = {row_key(r): r for r in old_rows}
    found = []
    for r in new_rows:
        o = old.get(row_key(r))
        if o is None:
            continue
        if o["pass"] == "yes" and r["pass"].startswith("no"):
            found.append(Regression(row_key(r), "incorrect", "pass", r["pass"][:80]))
        if o["ms"] and r["ms"] and float(r["ms"]) > float(o["ms"]) * (1.0 + tolerance):
            slower = float(r["ms"]) / float(o["ms"])
            found.append(
                Regression(row_key(r), "slower", f"{o['ms']} ms", f"{r['ms']} ms ({slower:.2f}x)")
            )
    return found


def summarize(rows: list[dict]) -> list[str]:
    """Best impl per (op, mode) and how it compares with the naive path, one line each.
    Noisy rows (repeats spread past 25 %) are left out of the verdicts and counted."""
    lines = []
    groups: dict[tuple, list[dict]] = {}
    noisy = [r for r in rows if harness.is_noisy(r)]
    if noisy:
        lines.append(
            f"  {len(noisy)} of {len(rows)} rows NOISY (the machine was busy): left out below"
        )
    for r in rows:
        if harness.is_noisy(r):
            continue
        groups.setdefault((r["op"], r["mode"], r["impl"]), []).append(r)
    for (op, mode, impl), rs in sorted(groups.items()):
        key = harness.speed_column(rs)
        if key is None:  # nothing measured (out of memory, or the training demo's curve)
            continue
        unit = harness.SPEED_UNITS[key]
        best = max(float(r[key]) for r in rs if r[key] != "")
        speedups = sorted(float(r["speedup_vs_naive"]) for r in rs if r["speedup_vs_naive"] != "")
        # rows with no naive twin (compiled model modes: naive is never compiled) say so
        median = f"{speedups[len(speedups) // 2]:6.2f}x" if speedups else "     —"
        failed = sum(1 for r in rs if r["pass"].startswith("no"))
        lines.append(
            f"  {op:<10} {mode:<7} {impl:<16} best {best:9.3f} {unit:<7}"
            f" median speedup vs naive {median}  {len(rs)} cases"
            + (f", {failed} FAILED the k× check" if failed else "")
        )
    return lines


def impl_colours(rows: list[dict]) -> dict[str, tuple]:
    """One colour per impl, the same in every panel of a figure: the impls in sorted order on
    matplotlib's qualitative palette (tab20 past 10 impls)."""
    import matplotlib

    impls = sorted({r["impl"] for r in rows})
    palette = matplotlib.colormaps["tab10" if len(impls) <= 10 else "tab20"]
    return {impl: palette(i % palette.N) for i, impl in enumerate(impls)}


def plot(rows: list[dict], path: Path) -> Path | None:
    """One PNG per op family: speed against size, a line per impl, a panel per case kind.
    Returns None (and says so) where matplotlib is missing or nothing is left to plot."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (matplotlib not installed: no plots)")
        return None
    if not rows:
        return None
    metric = harness.speed_column(rows)
    if metric is None:
        return None
    by_length = metric != "gbps"  # attention and models: against T; norms: against N
    size = "Tq" if by_length else "N"
    # attention: the training case (fwd+bwd) per head dim / causal / mask; others: every mode
    modes = ("fwd+bwd",) if metric == "tflops" else ("fwd", "fwd+bwd", "train", "infer")
    rows = [
        dict(r, causal=str(r["causal"])) for r in rows if r["mode"] in modes and r[metric] != ""
    ]
    # keyed on op too: the model family's decoder and padded-encoder rows are two ops
    panels = sorted({(r["op"], r["mode"], r["D"], r["causal"], r["mask"]) for r in rows})
    if not panels:
        return None
    ops = {p[0] for p in panels}
    cols = min(3, len(panels))
    rows_n = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5 * cols, 3.6 * rows_n), squeeze=False)
    colours = impl_colours(rows)
    for ax, panel in zip(axes.flat, panels, strict=False):
        op, mode, d, causal, mask = panel
        subset = [r for r in rows if (r["op"], r["mode"], r["D"], r["causal"], r["mask"]) == panel]
        for impl in sorted({r["impl"] for r in subset}):
            pts = sorted((int(r[size]), float(r[metric])) for r in subset if r["impl"] == impl)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl,
                    color=colours[impl])  # fmt: skip
        title = (f"{op} " if len(ops) > 1 else "") + mode
        title += (f" D={d}" if d else "") + (" causal" if causal == "True" else "")
        ax.set_title(title + (f" mask={mask}" if mask and mask != "none" else ""), fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(size)
        ax.set_ylabel(harness.SPEED_UNITS[metric])
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    # one legend for the figure, naming every impl of every panel (the first panel's legend
    # missed the impls it had no row of, e.g. sdpa-flash where it refuses key padding)
    handles = [
        matplotlib.lines.Line2D([], [], color=colours[i], marker="o", label=i) for i in colours
    ]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=7,
               frameon=False)  # fmt: skip
    family = rows[0]["op"] if len(ops) == 1 else ", ".join(sorted(ops))
    fig.suptitle(f"{family} on {rows[0]['device']} ({rows[0]['dtype']})")
    fig.tight_layout(rect=(0, 0.04 + 0.02 * (len(handles) // 6), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a CSV or a results folder")
    parser.add_argument("--compare", type=Path, help="older CSV or folder to compare against")
    parser.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    parser.add_argument("--plot", action="store_true", help="write <op>.png beside the CSVs")
    args = parser.parse_args(argv)
    rows = load(args.results)
    print("\n".join(summarize(rows)))
    if args.plot:
        folder = args.results if args.results.is_dir() else args.results.parent
        for op in sorted({r["op"] for r in rows}):
            plot([r for r in rows if r["op"] == op], folder / f"{op}.png")
    if args.compare:
        regressions = compare(rows, load(args.compare), tolerance=args.tolerance)
        print(f"{len(regressions)} regressions against {args.compare}")
        for r in regressions:
            print(f"  {r}")
        return 2 if regressions else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
