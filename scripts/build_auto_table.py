"""Build fusedattn's `auto` routing table from benchmark CSVs.

    python scripts/build_auto_table.py benchmarks/results/h200 [more result folders] \\
        [--exclude fusedattn-triton:attention] [--margin 0.03] [--sdpa-bound]
        [--out python/fusedattn/ops/core/auto_table.py]

For every measured case (card capability, op, mode, dtype, head-dim/length or row-length
bucket, causal, mask kind) the backends are ordered by their median time over the cases of
the bucket. "torch" is fusedattn's torch backend timed as a call reaches it (the
fusedattn-torch rows: its mask merge and SDPA's own choice of kernel included), what auto
would otherwise run, so a kernel is put ahead of torch where it beats that by at least
--margin. SDPA rows with a pinned backend on a pre-merged mask order nothing (issue #70); a
key with no fusedattn-torch row is not decided, unless --sdpa-bound: results from before the
fusedattn-torch rows existed then let the fastest pinned SDPA backend (flash, efficient,
cuDNN) stand in for torch. That is a lower bound of the torch backend's time (it runs one of
those backends on the same merged mask), so a kernel still goes ahead of torch only where it
beat every SDPA backend; the table's SOURCE says the bound was used. Only rows that passed
the k× check count. --exclude IMPL:OP drops measurements that no longer describe the code
(a kernel changed since it was timed); the table records what it excluded.

Decode rows (op "decode", from bench_decode.py) become the attention_with_kvcache op's keys.
There "torch" is fusedattn's own torch backend (fusedattn-torch: the cache gathered, then one
masked SDPA call), which is what auto would otherwise run; the SDPA, naive, prefill, Flex and
FlashInfer rows time a dense cache that a decode call does not have, so they order nothing.

The bucket functions are the ones dispatch uses (fusedattn.ops.core.auto), so a row lands where a
call with its shapes will look.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import pprint
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python"))

from fusedattn.ops.core import auto  # noqa: E402

# Capability of each card name the benchmarks record (device column).
CARDS = {"H100": "sm_90", "H200": "sm_90", "H800": "sm_90", "GH200": "sm_90", "A100": "sm_80",
         "A800": "sm_80", "L40S": "sm_89", "L4": "sm_89", "B200": "sm_100"}  # fmt: skip
OPS = {"attention", "layer_norm", "rms_norm", "softmax", "decode"}  # op column values
AUTO_BACKENDS = ("torch", "triton", "cuda")
SDPA_FAST = ("sdpa-flash", "sdpa-efficient", "sdpa-cudnn")  # --sdpa-bound's stand-ins
SDPA_BOUND_NOTE = "the fastest pinned SDPA backend bounds torch where no fusedattn-torch row is"  # what auto chooses among on a GPU


def capability(device: str) -> str | None:
    return next((cap for name, cap in CARDS.items() if name in device.split()), None)


def backend_of(op: str, impl: str) -> str | None:
    """The backend of auto's that a row times, or None (naive, flex, torch-compile, liger,
    fusedattn's prefill kernel timed on a decode: nothing auto can run for that op)."""
    if impl.startswith("fusedattn-") and impl.split("-", 1)[1] in AUTO_BACKENDS:
        return impl.split("-", 1)[1]
    if impl == "torch" and not op.endswith("attention") and op != "attention_with_kvcache":
        return "torch"  # the norms' and softmax's torch rows: F.layer_norm, torch.softmax
    return None


def row_key(r: dict) -> tuple | None:
    """(op, key) of a CSV row, the key built by fusedattn.ops.core.auto's bucket functions."""
    op = r["op"]
    if op not in OPS or r["pass"] != "yes" or not r["ms"] or r["mode"] not in auto.MODES:
        return None
    if op == "decode":  # mask: the cache layout (contiguous, paged16, ...); Tk: its length
        key = auto.decode_key_of(r["dtype"], int(r["D"]), r["mask"].startswith("paged"),
                                 int(r["Tq"]), int(r["B"]), int(r["Tk"]), "plain")  # fmt: skip
        return "attention_with_kvcache", (r["mode"], *key)
    if op == "attention":
        mask = {"dense": "bool"}.get(r["mask"], r["mask"])
        if mask == "softcap":  # auto keys softcap calls as "variant": the default order
            return None
        if mask == "varlen":  # measured as attention rows, run by varlen_attention
            op = "varlen_attention"
        key = auto.attention_key_of(r["dtype"], int(r["D"]), r["causal"] == "True", mask,
                                    int(r["Tk"]))  # fmt: skip
    else:
        mask = (r.get("mask") or "none") if op == "softmax" else None
        key = auto.rowwise_key_of(r["dtype"], int(r["N"]), mask)
    return op, (r["mode"], *key)


def build(folders: list[Path], exclude: set[tuple[str, str]], margin: float,
          sdpa_bound: bool = False) -> dict:  # fmt: skip
    times = defaultdict(lambda: defaultdict(list))  # (cap, op, key) -> impl -> [ms]
    for folder in folders:
        for path in sorted(Path(folder).glob("*.csv")):
            for r in csv.DictReader(path.open()):
                if "impl" not in r or "op" not in r:
                    break  # not a benchmark CSV (tuning sweeps have their own columns)
                if (r["impl"], r["op"]) in exclude or not r.get("device"):
                    continue
                cap, found = capability(r["device"]), row_key(r)
                if cap is None or found is None:
                    continue
                times[(cap, *found)][r["impl"]].append(float(r["ms"]))
    table: dict = defaultdict(lambda: defaultdict(dict))
    for (cap, op, key), per_impl in sorted(times.items()):
        ms = {impl: statistics.median(v) for impl, v in per_impl.items()}
        by_backend = {}
        for impl, t in ms.items():
            b = backend_of(op, impl)
            if b:
                by_backend[b] = t
        bound = [ms[i] for i in SDPA_FAST if i in ms]
        if sdpa_bound and op.endswith("attention") and "torch" not in by_backend and bound:
            by_backend["torch"] = min(bound)
        if "torch" not in by_backend:
            continue  # no baseline measured: nothing to decide
        torch_ms = by_backend["torch"]
        faster = sorted(
            (t, b) for b, t in by_backend.items() if b != "torch" and t < (1 - margin) * torch_ms
        )
        table[cap][op][key] = (*(b for _, b in faster), "torch")
    return {cap: dict(ops) for cap, ops in table.items()}


def render(table: dict, sources: list[str], exclude: set, margin: float,
           sdpa_bound: bool = False) -> str:  # fmt: skip
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    excluded = ", ".join(sorted(f"{i} ({o})" for i, o in exclude)) or "none"
    wins = sum(order[0] != "torch" for ops in table.values() for keys in ops.values()
               for order in keys.values())  # fmt: skip
    source = (
        f"{', '.join(sources)} ({stamp}), margin {margin:.0%}, excluded as stale: {excluded}; "
        f"{wins} keys put a fusedattn kernel ahead of torch"
        + (f"; {SDPA_BOUND_NOTE}" if sdpa_bound else "")
    )
    return (
        '"""`auto`\'s routing table: generated by scripts/build_auto_table.py, do not edit.\n\n'
        "Keys: (mode, *bucket) with the buckets of fusedattn.ops.core.auto; values: backends fastest\n"
        'first."""\n\n'
        f"SOURCE = {source!r}\n\n"
        f"TABLE = {pprint.pformat(table, width=100, sort_dicts=True)}\n"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--exclude", action="append", default=[], metavar="IMPL:OP")
    parser.add_argument("--margin", type=float, default=0.03)
    parser.add_argument("--sdpa-bound", action="store_true",
                        help="results from before fusedattn-torch rows: see the docstring")  # fmt: skip
    parser.add_argument(
        "--out", type=Path, default=ROOT / "python/fusedattn/ops/core/auto_table.py"
    )
    args = parser.parse_args(argv)
    exclude = {tuple(e.split(":", 1)) for e in args.exclude}
    table = build(args.folders, exclude, args.margin, args.sdpa_bound)
    sources = [str(f.resolve().relative_to(ROOT)) if f.resolve().is_relative_to(ROOT) else str(f)
               for f in args.folders]  # fmt: skip
    args.out.write_text(render(table, sources, exclude, args.margin, args.sdpa_bound))
    n = sum(len(keys) for ops in table.values() for keys in ops.values())
    print(f"wrote {args.out}: {n} keys for {', '.join(table) or 'no card'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
