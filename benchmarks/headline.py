"""The README's results: the headline numbers per card, read from the committed CSVs under
benchmarks/results/<card>/ and never typed by hand, and one plot beside them.

    python benchmarks/headline.py                  # print the markdown
    python benchmarks/headline.py --update README.md   # rewrite the README's block and the PNG

Per card: attention at B=4, H=16, T=4096, D=128, bf16 (forward and forward+backward TFLOP/s of
fusedattn's kernels, SDPA's backends and the naive path; plain, causal, key padding), the norms
and softmax at N=4096 (GB/s as % of the device copy rate measured in the same run), decode
(GB/s of K/V as % of copy) and generate / model tokens/s where a GPU run has measured them.
Every row names its card, date and CSV; a family no GPU run has measured says so.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import harness

from fusedattn.support import update_block

RESULTS = Path(__file__).resolve().parent / "results"
START = "<!-- headline:start (python benchmarks/headline.py --update README.md) -->"
END = "<!-- headline:end -->"
GPU_CARDS = ("h200", "h100")  # folders of GPU runs, newest card first
ATTENTION = dict(B="4", H="16", Tq="4096", D="128", dtype="bfloat16")
ATTENTION_IMPLS = ("fusedattn-triton", "fusedattn-cuda", "sdpa-cudnn", "sdpa-flash", "naive")
NORM_N = "4096"
NORM_IMPLS = ("fusedattn-triton", "fusedattn-cuda", "torch", "liger")
# What a reader must know about a CSV beyond its numbers (from the card folder's README.md).
CAVEATS = {
    "h200/attention.csv": "both attention kernels changed since (issues #12, #13): to be re-timed",
}


def _rows(card: str, name: str) -> list[dict]:
    path = RESULTS / card / name
    return harness.read_csv(path) if path.exists() else []


def _fmt(value: str, digits=0) -> str:
    return "—" if value in ("", None) else f"{float(value):.{digits}f}"


def attention_table(card: str) -> list[str]:
    rows = [r for r in _rows(card, "attention.csv")
            if all(r[k] == v for k, v in ATTENTION.items())]  # fmt: skip
    if not rows:
        return []
    cases = (("False", "none", "plain"), ("True", "none", "causal"),
             ("False", "key_padding", "key padding"), ("True", "key_padding", "causal + padding"))  # fmt: skip
    head = "| impl | " + " | ".join(f"{c[2]} fwd / fwd+bwd" for c in cases) + " |"
    lines = [head, "|---" * (len(cases) + 1) + "|"]
    for impl in ATTENTION_IMPLS:
        cells = []
        for causal, mask, _ in cases:
            got = {r["mode"]: r for r in rows
                   if (r["impl"], r["causal"], r["mask"]) == (impl, causal, mask)}  # fmt: skip
            if not got:
                cells.append("refused" if impl == "sdpa-flash" and mask != "none" else "—")
                continue
            fwd, both = got.get("fwd", {}), got.get("fwd+bwd", {})
            cells.append(f"{_fmt(fwd.get('tflops'))} / {_fmt(both.get('tflops'))}")
        lines.append(f"| {impl} | " + " | ".join(cells) + " |")
    return lines


def norm_table(card: str) -> list[str]:
    lines = []
    for family in ("layernorm", "rmsnorm", "softmax"):
        rows = [r for r in _rows(card, f"{family}.csv")
                if r["N"] == NORM_N and r["mask"] in ("", "none")]  # fmt: skip
        if not rows:
            continue
        if not lines:
            head = "| op (N=4096) | " + " | ".join(f"{i} fwd / fwd+bwd" for i in NORM_IMPLS) + " |"
            lines = [head, "|---" * (len(NORM_IMPLS) + 1) + "|"]
        cells = []
        for impl in NORM_IMPLS:
            got = {r["mode"]: r["pct_of_copy"] for r in rows if r["impl"] == impl}
            cells.append("—" if not got else
                         f"{_fmt(got.get('fwd'))} % / {_fmt(got.get('fwd+bwd'))} %")  # fmt: skip
        lines.append(f"| {family} | " + " | ".join(cells) + " |")
    return lines


def _source(card: str, name: str) -> str:
    rows = _rows(card, name)
    dates = sorted({r["date"][:10] for r in rows if r["date"]})
    device = rows[0]["device"] if rows else card
    caveat = CAVEATS.get(f"{card}/{name}")
    where = f"[`benchmarks/results/{card}/{name}`](benchmarks/results/{card}/{name})"
    return f"{device}, {', '.join(dates)}, {where}" + (f" — {caveat}" if caveat else "")


def markdown() -> str:
    out = []
    for card in GPU_CARDS:
        attention, norms = attention_table(card), norm_table(card)
        if attention:
            out += [f"**Attention**, TFLOP/s, B=4 H=16 T=4096 D=128 bf16 — {_source(card, 'attention.csv')}",
                    "", *attention, ""]  # fmt: skip
        if norms:
            sources = "; ".join(_source(card, f"{f}.csv") for f in ("layernorm", "rmsnorm", "softmax")
                                if (RESULTS / card / f"{f}.csv").exists())  # fmt: skip
            out += [f"**LayerNorm, RMSNorm, softmax**, % of the copy rate measured in the same run, "
                    f"M×N = 128 Mi elements bf16 — {sources}", "", *norms, ""]  # fmt: skip
    measured = {f for card in GPU_CARDS for f in ("decode", "model") if _rows(card, f"{f}.csv")}
    missing = [f for f in ("decode", "model") if f not in measured]
    if missing:
        out.append(f"Not yet measured on a GPU: {', '.join(missing)} (tokens/s, decode GB/s).")
    if (RESULTS / "h200" / "attention.png").exists():
        out += ["", "![attention on an H200](benchmarks/results/h200/attention.png)"]
    return "\n".join(out).rstrip()


def update(path: str) -> bool:
    return update_block(path, START, END, markdown())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", metavar="README")
    args = parser.parse_args(argv)
    if args.update:
        print(f"{args.update}: {'updated' if update(args.update) else 'already current'}")
    else:
        print(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
