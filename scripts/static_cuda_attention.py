"""Compile the CUDA attention kernels for Hopper (sm_90a) without a GPU and print what ptxas
made of them: registers, spills, and the SASS instruction mix of each key/query loop per
iteration per warp. Screen kernel changes here before spending device minutes on them
(issue #13); the numbers go into the launch-policy comments of attention_launch.cuh.

    python scripts/static_cuda_attention.py [--head-dims 64,128] [--kernels fwd,bwd]
        [--dtype bf16] [--csv out.csv] [-D FUSEDATTN_TUNING]

Needs nvcc (CUDA_HOME or /usr/local/cuda) and a cuobjdump: the CUDA toolkit's, or the one
Triton's pip package ships under triton/backends/nvidia/bin/. One process per translation
unit, as the extension build does. Loops are found as in ../shared/tools/sm90_static.py: a
backward branch and the instructions between its target and itself, innermost loops holding
HMMA only. A loop with a run-time branch inside counts both sides of the branch.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import csv
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCH = "-gencode=arch=compute_90a,code=sm_90a"
NVCC_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-std=c++17"]  # as the extension's build

FP32 = ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "FCHK")
INT = (
    "IMAD",
    "IADD3",
    "LEA",
    "ISETP",
    "SEL",
    "LOP3",
    "SHF",
    "IMNMX",
    "IABS",
    "VIADD",
    "VIADDMNMX",
    "UIADD3",
    "UIMAD",
    "ULEA",
    "USEL",
    "UISETP",
    "IADD",
    "PLOP3",
    "P2R",
    "R2P",
)
MEMORY = ("LDSM", "LDS", "STS", "LDG", "STG", "LDGSTS")


def find_tool(name: str) -> str:
    cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    candidates = [Path(cuda_home) / "bin" / name]
    try:
        import triton

        candidates.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)
    except ImportError:
        pass
    for c in candidates:
        if c.exists():
            return str(c)
    found = shutil.which(name)
    if found:
        return found
    sys.exit(f"static_cuda_attention: no {name} (looked in {', '.join(map(str, candidates))})")


def short_name(mangled: str) -> str:
    """_ZN...attention_fwd_kernel<bf16, ForwardTraits<128,128,64,4,1>, false> -> a label such as
    fwd bf16 128.128.64.4.1 fast: the kernel, the dtype, the template numbers (traits, then the
    dK/dV pass), and fast or general (the last bool: attn_mask/dropout compiled in)."""
    kernel = re.search(
        r"attention_(fwd|bwd_dq_sum|bwd_dq|bwd_dkdv|bwd_delta|bwd_fused)_kernel", mangled
    )
    dtype = "bf16" if "bfloat16" in mangled else "fp16"
    numbers = ".".join(re.findall(r"Li(\d+)E", mangled))
    flags = re.findall(r"Lb([01])E", mangled)
    variant = ("general" if flags[-1] == "1" else "fast") if flags else ""
    return " ".join(
        x for x in (kernel.group(1) if kernel else mangled, dtype, numbers, variant) if x
    )


def compile_unit(source: Path, defines: list[str], workdir: str) -> tuple[str, str]:
    """ptxas's report and the SASS of one translation unit."""
    cubin = os.path.join(workdir, source.stem + ".cubin")
    nvcc = find_tool("nvcc")
    cmd = [
        nvcc,
        ARCH,
        *NVCC_FLAGS,
        *(f"-D{d}" for d in defines),
        "-Xptxas",
        "-v",
        "-cubin",
        "-I",
        str(ROOT / "csrc"),
        str(source),
        "-o",
        cubin,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"nvcc failed on {source}:\n{done.stderr}")
    sass = subprocess.run(
        [find_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True
    ).stdout
    return done.stderr, sass


def ptxas_resources(report: str) -> dict[str, dict]:
    out, current = {}, None
    for line in report.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = m.group(1)
            out[current] = {}
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            out[current]["spill_store_bytes"] = int(m.group(1))
            out[current]["spill_load_bytes"] = int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            out[current]["regs"] = int(m.group(1))
    return out


def sass_functions(sass: str) -> dict[str, list[tuple[int, str]]]:
    funcs, current = {}, None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\w+)", line)
        if m:
            current = funcs.setdefault(m.group(1), [])
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m and current is not None:
            current.append((int(m.group(1), 16), m.group(2).strip()))
    return funcs


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def loops(ins: list[tuple[int, str]], matrix_only: bool = True) -> list[dict]:
    """Innermost backward-branch loops, in address order: of those holding HMMA, or of all
    (matrix_only=False: the row-wise kernels of static_norms.py)."""
    index = {addr: i for i, (addr, _) in enumerate(ins)}
    found = []
    for i, (addr, text) in enumerate(ins):
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= addr or int(m.group(1), 16) not in index:
            continue
        lo = index[int(m.group(1), 16)]
        c = collections.Counter(opcode(t) for _, t in ins[lo : i + 1])
        if c["HMMA"] or not matrix_only:
            found.append(
                {
                    "lo": lo,
                    "hi": i,
                    "instructions": i + 1 - lo,
                    "HMMA": c["HMMA"],
                    "int": sum(c[k] for k in INT),
                    "fp32": sum(c[k] for k in FP32),
                    "MUFU": c["MUFU"],
                    "memory": sum(c[k] for k in MEMORY),
                    "LDL+STL": c["LDL"] + c["STL"],
                    "branches": c["BRA"],
                    "top": " ".join(f"{k}:{n}" for k, n in c.most_common(6)),
                }
            )
    inner = [
        a
        for a in found
        if not any(b is not a and a["lo"] <= b["lo"] and b["hi"] <= a["hi"] for b in found)
    ]
    return sorted(inner, key=lambda r: r["lo"])


def screen(source: Path, defines: list[str], dtype: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        report, sass = compile_unit(source, defines, tmp)
    resources = ptxas_resources(report)
    rows = []
    for mangled, ins in sass_functions(sass).items():
        label = short_name(mangled)
        if f" {dtype} " not in label:
            continue
        res = resources.get(mangled, {})
        for n, loop in enumerate(loops(ins)):
            rows.append(
                {
                    "unit": source.stem,
                    "kernel": label,
                    "loop": n,
                    "regs": res.get("regs"),
                    "spill_st": res.get("spill_store_bytes"),
                    "spill_ld": res.get("spill_load_bytes"),
                    **{k: v for k, v in loop.items() if k not in ("lo", "hi")},
                }
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--kernels", default="fwd,bwd", help="fwd, bwd or both")
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument(
        "-D",
        dest="defines",
        action="append",
        default=[],
        help="a preprocessor define, e.g. FUSEDATTN_TUNING",
    )
    ap.add_argument("--csv", help="also write the rows here")
    args = ap.parse_args()
    units = [
        ROOT / "csrc" / "attention" / f"attention_{k}_hdim{d}.cu"
        for k in args.kernels.split(",")
        for d in args.head_dims.split(",")
    ]
    dtype = args.dtype
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(lambda u: screen(u, args.defines, dtype), units))
    rows = [r for rs in results for r in rs]
    cols = [
        "unit",
        "kernel",
        "loop",
        "regs",
        "spill_st",
        "spill_ld",
        "instructions",
        "HMMA",
        "int",
        "fp32",
        "MUFU",
        "memory",
        "LDL+STL",
        "branches",
        "top",
    ]
    for r in rows:
        print("  ".join(f"{c}={r[c]}" for c in cols))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows(rows)


if __name__ == "__main__":
    main()
