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
    "h200/model.csv": "measured before the baselines users run (issue #70): fusedattn-torch is"
    " fusedattn's own SDPA wrapper, not a user baseline; auto with the table of 2026-11-27; the"
    " `models` preset of scripts/gpu_check.sh measures against Hugging Face's and plain SDPA",
    "h200/decode.csv": "eager calls at B=1 and B=8 at 8k are bound by host time per call, not"
    " by the kernel (their CUDA-graph replays are the -graph columns)",
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


DECODE_CASES = ((1, 8192, "contiguous"), (1, 32768, "contiguous"), (1, 32768, "paged16"),
                (8, 32768, "contiguous"), (8, 32768, "paged16"))  # fmt: skip
DECODE_IMPLS = ("fusedattn-triton", "fusedattn-torch", "sdpa (best)", "fusedattn-triton-graph",
                "sdpa-graph (best)", "flashinfer", "flex-compiled")  # fmt: skip


def _decode_impl_rows(case: list[dict], impl: str) -> list[dict]:
    """A column's rows: "sdpa (best)" is SDPA's fastest eager backend, "sdpa-graph (best)" its
    fastest replayed from a CUDA graph (bench_decode's "-graph" rows)."""
    if impl == "sdpa (best)":
        return [
            r for r in case if r["impl"].startswith("sdpa") and not r["impl"].endswith("-graph")
        ]
    if impl == "sdpa-graph (best)":
        return [r for r in case if r["impl"].startswith("sdpa") and r["impl"].endswith("-graph")]
    return [r for r in case if r["impl"] == impl]


def decode_table(card: str) -> list[str]:
    """One new query per sequence, Llama-3-8B heads: % of the copy rate (µs per call) per
    (batch, cache length, layout); SDPA's columns are its fastest backend on that case, eager
    and from a CUDA graph; a column no row measured is left out."""
    rows = [r for r in _rows(card, "decode.csv")
            if r["op"] == "decode" and r["Tq"] == "1" and r["ms"] and r["pass"] == "yes"]  # fmt: skip
    table = {}
    for B, L, layout in DECODE_CASES:
        case = [r for r in rows if (r["B"], r["Tk"], r["mask"]) == (str(B), str(L), layout)]
        if case:
            table[(B, L, layout)] = {
                impl: min(_decode_impl_rows(case, impl), key=lambda r: float(r["ms"]), default=None)
                for impl in DECODE_IMPLS
            }  # fmt: skip
    impls = [i for i in DECODE_IMPLS if any(cells[i] is not None for cells in table.values())]
    if not table:
        return []
    lines = [
        "| batch, cache, layout | " + " | ".join(impls) + " |",
        "|---" * (len(impls) + 1) + "|",
    ]
    for (B, L, layout), cells in table.items():
        text = ["—" if cells[i] is None else
                f"{_fmt(cells[i]['pct_of_copy'])} % ({_fmt(float(cells[i]['ms']) * 1e3)} µs)"
                for i in impls]  # fmt: skip
        lines.append(f"| {B}, {L // 1024}k, {layout} | " + " | ".join(text) + " |")
    return lines


LEGACY_MODEL_IMPLS = ("naive", "fusedattn-torch", "auto", "fusedattn-triton", "fusedattn-cuda")
# The baselines a user has (bench_model / model_cases.BASELINES), and fusedattn's auto, per family.
USER_BASELINES = {"model": ("sdpa",), "hf": ("sdpa", "eager", "flash_attention_2")}
AUTO_IMPL = {"model": "auto", "hf": "fusedattn"}


def _tokens(row: dict | None) -> float | None:
    if row is None or not row.get("tokens_per_s"):
        return None
    return float(row["tokens_per_s"])


def model_table(card: str) -> list[str]:
    """auto against the fastest thing a user has for each model, length and mode: eager
    against eager, compiled against compiled, both ratios shown (thousands of tokens/s). A CSV
    from before the user baselines were measured gets the older table, which says so."""
    rows = [r for r in _rows(card, "model.csv") if r["op"].split(":")[0] in AUTO_IMPL]
    if not rows:
        return []
    if not any(r["impl"] in USER_BASELINES[r["op"].split(":")[0]] for r in rows):
        return _legacy_model_table(rows)
    lines = ["| model, T, mode | best baseline, eager | auto, eager | × | "
             "best baseline, compiled | auto, compiled | × |", "|---" * 7 + "|"]  # fmt: skip
    keys = dict.fromkeys((r["op"], r["Tq"], r["mode"].removesuffix("-compiled")) for r in rows)
    for op, T, mode in keys:
        family = op.split(":")[0]
        cells = []
        for suffix in ("", "-compiled"):
            at = {r["impl"]: r for r in rows
                  if (r["op"], r["Tq"], r["mode"]) == (op, T, mode + suffix)}  # fmt: skip
            base = max(((_tokens(at.get(b)), b) for b in USER_BASELINES[family]
                        if _tokens(at.get(b))), default=None)  # fmt: skip
            ours = _tokens(at.get(AUTO_IMPL[family]))
            cells.append("—" if base is None else f"{base[1]} {base[0] / 1e3:.1f}k")
            cells.append("—" if ours is None else f"{ours / 1e3:.1f}k")
            cells.append("—" if None in (base, ours) else f"{ours / base[0]:.2f}×")
        lines.append(f"| {op}, {T}, {mode} | " + " | ".join(cells) + " |")
    return lines


def _legacy_model_table(rows: list[dict]) -> list[str]:
    lines = ["| model, mode, T | " + " | ".join(LEGACY_MODEL_IMPLS) + " |",
             "|---" * (len(LEGACY_MODEL_IMPLS) + 1) + "|"]  # fmt: skip
    cases = dict.fromkeys((r["op"].removeprefix("model:"), r["mode"], r["Tq"]) for r in rows)
    for name, mode, T in cases:
        cells = []
        for impl in LEGACY_MODEL_IMPLS:
            got = next((r for r in rows if (r["op"], r["mode"], r["Tq"], r["impl"]) ==
                        (f"model:{name}", mode, T, impl)), None)  # fmt: skip
            if got is None:
                cells.append("—")
            elif "out of memory" in (got["note"] or ""):
                cells.append("OOM")
            else:
                cells.append(f"{_fmt(float(got['tokens_per_s']) / 1e3, 1)}k")
        lines.append(f"| {name}, {mode}, {T} | " + " | ".join(cells) + " |")
    return lines


def generate_line(card: str) -> str | None:
    rows = {r["impl"]: r for r in _rows(card, "decode.csv") if r["op"] == "generate" and r["ms"]}
    if not rows:
        return None
    speeds = ", ".join(f"{impl} {_fmt(r['tokens_per_s'])}" for impl, r in sorted(rows.items()))
    r = next(iter(rows.values()))
    return (f"**generate**, tokens/s, 2 layers of Llama-3-8B shape, batch {r['B']}, prompt "
            f"{int(r['Tk']) - int(r['Tq'])} + {r['Tq']} new: {speeds}")  # fmt: skip


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
        decode, generate, model = decode_table(card), generate_line(card), model_table(card)
        if decode:
            out += [f"**Decode** (attention_with_kvcache, Hq 32 Hkv 8 D 128 bf16, one new query), "
                    f"% of the copy rate (µs per call) — {_source(card, 'decode.csv')}", "",
                    *decode, ""]  # fmt: skip
        if generate:
            out += [generate, ""]
        if model:
            against = (", auto against the best baseline a user has (HF: transformers' sdpa / "
                       "eager / flash_attention_2; the reference transformer: plain SDPA)"
                       if "best baseline" in model[0] else "")  # fmt: skip
            out += [f"**Models**, thousands of tokens/s, bf16{against} — "
                    f"{_source(card, 'model.csv')}", "", *model, ""]  # fmt: skip
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
