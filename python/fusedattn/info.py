"""What fusedattn has built and can use here: `python -m fusedattn.info [--json]`.

Paste its output into bug reports. `collect()` returns the same facts as a dict (the
benchmarks record them with every result).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys

import torch

from ._version import __version__
from .ops.attention.cuda_args import CUDA_BACKWARD_ENV
from .ops.core import auto, backends


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cuda_version_str(v: int) -> str:
    return f"{v // 1000}.{(v % 1000) // 10}"


def extension_info() -> dict:
    """fusedattn._C's build facts (built ahead of time or on first use), or why it is
    unavailable and whether backend="cuda" would compile it."""
    if backends.EXTENSION is None:
        return {
            "built": False,
            "reason": backends.EXTENSION_ERROR,
            "build_on_first_use": backends.BUILD_ON_FIRST_USE,
        }
    raw = backends.EXTENSION.build_info()
    return {
        "built": True,
        "origin": backends.EXTENSION_ORIGIN,
        "path": getattr(backends.EXTENSION, "__file__", ""),
        "cuda_compiled": _cuda_version_str(raw["cuda_compiled"]),
        "cuda_runtime": _cuda_version_str(raw["cuda_runtime"]),
        "archs": [f"sm_{a // 10}" for a in raw["archs"]],
        "attention_head_dims": list(raw["attention_head_dims"]),
        "torch_compiled": raw["torch_compiled"],
        "ops": list(raw["ops"]),
    }


def gpu_info() -> dict | None:
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return {
        "name": props.name,
        "capability": f"sm_{props.major}{props.minor}",
        "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "count": torch.cuda.device_count(),
    }


def collect() -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {
        "fusedattn": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _package_version("triton"),
        "numpy": _package_version("numpy"),
        "gpu": gpu_info(),
        "extension": extension_info(),
        "triton_interpret": backends.triton_interpreter_enabled(),
        "backend_env": f"{backends.ENV_VAR}={os.environ.get(backends.ENV_VAR, '')}",
        "cuda_backward_env": f"{CUDA_BACKWARD_ENV}={os.environ.get(CUDA_BACKWARD_ENV, '')}",
        "device": device,
        "available_backends": backends.available_backends(device),
        "backends": backends.backend_report(device),
    }


def extension_line(ext: dict) -> str:
    if not ext["built"]:
        return f"fusedattn._C: not available: {ext['reason']}"
    return (
        f"fusedattn._C: {ext['origin']} ({ext['path']}), built with CUDA "
        f"{ext['cuda_compiled']} (runtime {ext['cuda_runtime']})"
        f" for {', '.join(ext['archs']) or 'no archs'}; torch {ext['torch_compiled']}; "
        f"ops: {', '.join(ext['ops']) or 'none yet'}"
    )


def auto_table_text() -> str:
    """auto's measured routing (ops/core/auto_table.py) in force: one line per key."""
    lines = [f"auto: {auto.TABLE_SOURCE}"]
    here = auto.capability(0) if torch.cuda.is_available() else ""
    for cap, ops in sorted(auto.TABLE.items()):
        mark = " (this GPU)" if cap == here else ""
        for op, keys in sorted(ops.items()):
            lines.append(f"{cap}{mark} {op}:")
            header = (*auto.KEY_COLUMNS.get(op, ("key",)), "backends, fastest first")
            rows = [(*map(str, key), ", ".join(order)) for key, order in keys.items()]
            rows.sort(key=str)
            widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
            for row in [header, *rows]:
                cells = "  ".join(f"{c:<{w}}" for c, w in zip(row[:-1], widths, strict=True))
                lines.append(f"  {cells}  {row[-1]}")
    if len(lines) == 1:
        lines.append("no measurements: auto keeps the default order everywhere")
    lines.append("other calls: " + ", ".join(f"{d}: {' > '.join(o['attention'])}"
                                            for d, o in backends.AUTO_ORDER.items()))  # fmt: skip
    return "\n".join(lines)


def render(info: dict) -> str:
    lines = [
        f"fusedattn {info['fusedattn']}",
        f"python {info['python']}, torch {info['torch']} (CUDA {info['torch_cuda']}), "
        f"triton {info['triton']}, numpy {info['numpy']}",
    ]
    gpu = info["gpu"]
    if gpu:
        lines.append(
            f"GPU: {gpu['name']} ({gpu['capability']}, {gpu['sms']} SMs, {gpu['memory_gib']} GiB)"
            f" x{gpu['count']}"
        )
    else:
        lines.append("GPU: none (torch.cuda.is_available() is False)")
    lines.append(extension_line(info["extension"]))
    lines.append(f"TRITON_INTERPRET=1: {'yes' if info['triton_interpret'] else 'no'}")
    lines.append(f"{info['backend_env']}")
    lines.append(f"{info['cuda_backward_env']} (the CUDA attention's backward: auto, split, fused)")
    lines.append(f"backends on {info['device']}: {', '.join(info['available_backends']) or 'none'}")
    for op, per_backend in info["backends"].items():
        lines.append(f"  {op}:")
        for name, reasons in per_backend.items():
            lines.append(f"    {name:<9} " + ("ok" if not reasons else "no: " + "; ".join(reasons)))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusedattn.info", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print the facts as JSON")
    parser.add_argument(
        "--extension", action="store_true", help="one line: is fusedattn._C built, for what"
    )
    parser.add_argument(
        "--auto-table", action="store_true", help="the routing table auto uses, per GPU arch"
    )
    args = parser.parse_args(argv)
    if args.extension:
        print(extension_line(extension_info()))
        return 0
    if args.auto_table:
        print(auto_table_text())
        return 0
    info = collect()
    print(json.dumps(info, indent=2) if args.json else render(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
