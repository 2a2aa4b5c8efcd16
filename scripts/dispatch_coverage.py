"""Which (op, backend, dtype, options) combinations a test run exercised, and what a second
run lost or added: the coverage check of a change that cuts tests (docs/development.md).

    python -m pytest -n auto -m "not gpu" tests --record-dispatch before/   # on the old tree
    python -m pytest -n auto -m "not gpu" tests --record-dispatch after/    # on the new one
    python scripts/dispatch_coverage.py before/ after/

A combination is recorded when dispatch selects the backend that runs a call (the
recorder is tests/dispatch_probe.py's record_combinations). Exits 1 when the second run lost a
combination the first had.
"""

import argparse
import json
import pathlib
import sys


def load(folder: str) -> set:
    seen = set()
    for path in sorted(pathlib.Path(folder).glob("*.json")):
        for op, backend, dtype, options in json.loads(path.read_text()):
            seen.add((op, backend, dtype, tuple(options)))
    return seen


def show(title: str, rows: set) -> None:
    print(f"{title}: {len(rows)}")
    for op, backend, dtype, options in sorted(rows):
        print(f"  {op:24s} {backend:9s} {dtype:15s} {','.join(options) or '-'}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="--record-dispatch folder of the first run")
    parser.add_argument("after", nargs="?", help="--record-dispatch folder of the second run")
    args = parser.parse_args(argv)

    before = load(args.before)
    if args.after is None:
        show("combinations", before)
        return 0
    after = load(args.after)
    print(f"before {len(before)}, after {len(after)} combinations")
    show("lost", before - after)
    show("added", after - before)
    return 1 if before - after else 0


if __name__ == "__main__":
    sys.exit(main())
