"""Host cost in instructions: how many instructions the CPU runs per call of fusedattn.attention
on the Triton path (forward, and forward+backward), counted by valgrind's callgrind, for the
plain call, one with a block mask and one with a cached score_mod (bench_host.py's shapes and
flex cases), the kernels compiled for sm_90 and the driver launch stubbed as bench_host.py
does it.

    python benchmarks/host_instructions.py --sm90-tool ../shared/tools/sm90_static.py \
        [--out DIR] [--label @REV] [--calls 100]

Why a count and not a time: on the shared 2-core CPU machine bench_host.py's medians spread
10-30 % between runs (the same checkout measured 18-24 µs for the plain forward within one
hour of 2026-12-07), which hides a few µs; the count repeats within 0.1 % and the ratio of
two rows is the ratio of their Python work. The CSV's `note` holds the count and that ratio.

The script re-runs itself under `valgrind --tool=callgrind`, collecting only inside
functools.reduce (the loop around each case's calls) and dumping after each loop; the last
dumps are the cases, in order. Needs valgrind (not installed on the GPU machine: there,
bench_host.py's times with real launches are the number).
"""

from __future__ import annotations

import argparse
import functools
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def _cases(fusedattn, bench_host):
    """{name: call} in a fixed order: fwd (no grad) and fwd+bwd of the plain call, of
    bench_host's flex cases (a relative bias over a captured table, a causal block mask) and
    of the relative bias defined anew in each call (its closure walked every call)."""
    q, k, v = (torch.randn(bench_host.SHAPE, dtype=torch.float16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    grad = torch.randn(bench_host.SHAPE, dtype=torch.float16)
    calls = {"plain": lambda: fusedattn.attention(q, k, v, backend="triton")}
    for call, _leaves, fields in ((c, lv, f) for _, c, lv, f in
                                  bench_host.flex_cases(fusedattn, q, k, v)):  # fmt: skip
        if fields["mask"] != "score_mod:learnable_bias":
            calls[fields["mask"]] = call
    table, offset = torch.randn(q.shape[1], 2 * q.shape[2] - 1), q.shape[2] - 1

    def new_closure():  # as a model's forward writes it: a new function object every call
        def relative_bias(score, b, h, q_idx, kv_idx):
            return score + table[h, q_idx - kv_idx + offset]

        return fusedattn.attention(q, k, v, score_mod=relative_bias, backend="triton")

    calls["score_mod:relative_bias, a new closure each call"] = new_closure

    def forward(call):
        def run():
            with torch.no_grad():
                return call()

        return run

    cases = {f"fwd {name}": forward(call) for name, call in calls.items()}
    for name, call in calls.items():
        cases[f"fwd+bwd {name}"] = lambda c=call: torch.autograd.grad(c(), (q, k, v), grad)
    return cases


def child(args) -> None:
    """Under callgrind: the stub, the warm-up (compiles, plans), then one reduce per case."""
    sys.path.insert(0, str(HERE))
    import bench_host

    bench_host.stub_driver_launch(args.sm90_tool)
    from fusedattn.ops.core import backends

    backends.triton_interpreter_enabled = lambda: True  # CPU tensors accepted: nothing runs
    import fusedattn

    cases = _cases(fusedattn, bench_host)
    for fn in cases.values():
        fn(), fn()
    print("CASES\t" + "\t".join(cases), flush=True)
    for fn in cases.values():
        functools.reduce(lambda _, __, fn=fn: fn(), range(args.calls), None)


def parent(args) -> int:
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: nothing to count")
        return 1
    sys.path.insert(0, str(HERE))
    import harness

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "cg"
        cmd = [
            "valgrind", "--tool=callgrind", "--collect-atstart=no",
            "--toggle-collect=functools_reduce", "--dump-after=functools_reduce",
            f"--callgrind-out-file={out}", sys.executable, __file__, "--child",
            "--sm90-tool", args.sm90_tool, "--calls", str(args.calls),
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        names = next((line.split("\t")[1:] for line in done.stdout.splitlines()
                      if line.startswith("CASES\t")), None)  # fmt: skip
        if done.returncode != 0 or names is None:
            print(done.stdout[-2000:], done.stderr[-4000:])
            return 1
        # torch calls reduce at import too: the cases are the last dumps, in order
        dumps = sorted(Path(tmp).glob("cg.*"), key=lambda p: int(p.suffix[1:]))[-len(names) :]
        counts = {}
        for name, dump in zip(names, dumps, strict=True):
            found = re.search(r"^summary: (\d+)", dump.read_text(), re.MULTILINE)
            counts[name] = int(found.group(1)) / args.calls
    env = harness.environment(torch.device("cpu"))
    B, H, T, D = (1, 2, 64, 64)
    rows = []
    for name, count in counts.items():
        mode, mask = name.split(" ", 1)
        plain = counts[f"{mode} plain"]
        rows.append(harness.make_row(
            env, op="attention", mode=mode, impl="fusedattn-triton" + args.label,
            dtype="float16", B=B, H=H, Tq=T, Tk=T, D=D, causal=False,
            mask="" if mask == "plain" else mask,
            note=f"{count:.0f} instructions per call (callgrind), {count / plain:.3f}x the "
            "plain call; compiled for sm_90, driver launch stubbed",
        ))  # fmt: skip
        print(f"  {name:<32} {count:10.0f} instructions/call  {count / plain:6.3f}x plain")
    if args.out:  # several checkouts into one file
        print(f"wrote {harness.append_csv(rows, args.out / 'host_instructions.csv')}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sm90-tool", required=True, help="sm90_static.py (bench_host.py's stub)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--label", default="", help="appended to the impl column (a checkout)")
    parser.add_argument("--calls", type=int, default=100, help="calls counted per case")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
