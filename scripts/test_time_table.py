"""Where the test suite's time goes, by kind and by file, from pytest's JUnit XML.

    python -m pytest ... --junitxml=run.xml tests
    python scripts/test_time_table.py run.xml [before.xml] [--files 20]

Each test's time is its setup + call + teardown as pytest reports it, so the totals are
serial seconds (what one process would spend); with xdist the wall time is about that
divided by the workers, plus collection. Given two files, prints before and after side
by side. The kinds are what the CPU suite spends its time on (docs/development.md).
"""

import argparse
import collections
import xml.etree.ElementTree as ET

# test file -> kind; any other file is "Triton interpreter and the rest": the kernels under
# TRITON_INTERPRET=1 dominate it, the pure-Python tests in it take seconds in all.
KINDS = {
    "test_packaging": "packaging (sdist, wheel, nvcc builds)",
    "test_build": "packaging (sdist, wheel, nvcc builds)",
    "test_distributed": "gloo process groups",
    "test_ddp": "gloo process groups",
    "test_fsdp": "gloo process groups",
    "test_bench_harness": "benchmark harness",
    "test_swap": "swapped models",
    "test_transformer": "swapped models",
    "test_huggingface": "Hugging Face models",
    "test_compile": "torch.compile",
    "test_cuda_graphs": "torch.compile",
    "test_docs": "docs snippets",
    "test_examples": "examples",
}
REST = "Triton interpreter and the rest"


def per_file(path):
    seconds, count = collections.Counter(), collections.Counter()
    for case in ET.parse(path).iter("testcase"):
        if case.find("skipped") is not None:
            continue
        name = case.get("classname").split(".")
        module = next((part for part in name if part.startswith("test_")), name[-1])
        seconds[module] += float(case.get("time") or 0.0)
        count[module] += 1
    return seconds, count


def per_kind(seconds, count):
    kind_seconds, kind_count = collections.Counter(), collections.Counter()
    for module, s in seconds.items():
        kind = KINDS.get(module, REST)
        kind_seconds[kind] += s
        kind_count[kind] += count[module]
    return kind_seconds, kind_count


def table(title, rows, after, before):
    a_s, a_n = after
    header = f"| {title} | tests | seconds |"
    rule = "|---|---:|---:|"
    if before:
        b_s, b_n = before
        header = f"| {title} | tests before | seconds before | tests after | seconds after |"
        rule = "|---|---:|---:|---:|---:|"
    print(header)
    print(rule)
    for row in rows:
        if before:
            print(f"| {row} | {b_n[row]} | {b_s[row]:.0f} | {a_n[row]} | {a_s[row]:.0f} |")
        else:
            print(f"| {row} | {a_n[row]} | {a_s[row]:.0f} |")
    if before:
        print(
            f"| total | {sum(b_n.values())} | {sum(b_s.values()):.0f} "
            f"| {sum(a_n.values())} | {sum(a_s.values()):.0f} |"
        )
    else:
        print(f"| total | {sum(a_n.values())} | {sum(a_s.values()):.0f} |")
    print()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("after", help="JUnit XML of the run to describe")
    parser.add_argument("before", nargs="?", help="JUnit XML of an earlier run to compare")
    parser.add_argument("--files", type=int, default=20, help="how many files to list")
    args = parser.parse_args()

    after = per_file(args.after)
    before = per_file(args.before) if args.before else None
    after_kinds = per_kind(*after)
    before_kinds = per_kind(*before) if before else None

    key = before_kinds[0] if before else after_kinds[0]
    kinds = sorted(set(after_kinds[0]) | set(key), key=lambda k: -max(key[k], after_kinds[0][k]))
    table("kind", kinds, after_kinds, before_kinds)

    key = before[0] if before else after[0]
    files = sorted(set(after[0]) | set(key), key=lambda f: -max(key[f], after[0][f]))
    table("file", files[: args.files], after, before)


if __name__ == "__main__":
    main()
