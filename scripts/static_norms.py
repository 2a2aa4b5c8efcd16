"""Compile the Triton LayerNorm/RMSNorm and softmax kernels (one-pass: the row in registers)
for Hopper (sm_90) without a GPU, at several warp counts, and print what the compiler made of
them: registers, spills, and SASS instructions per row element (issue #14). A row-wise kernel
at copy speed has a budget of roughly 30 instructions per element; fewer warps per row mean
more elements per thread and fewer instructions per element, until registers run out.

Run it in a venv with the GPU machine's versions (torch 2.11, triton 3.6; ENVIRONMENT.md) with
fusedattn installed, and the shared sm90_static tool:

    python scripts/static_norms.py --tool ../shared/tools/sm90_static.py \\
        [--n 1024,4096,8192,32768] [--warps 4,8,16] [--csv out.csv]

The forwards and the softmax backward handle one row per program (straight-line code: the
count is the kernel's); the LayerNorm backward loops over rows, and the count is that loop's.
bf16 rows.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import subprocess
import sys
import tempfile

# the sibling screens: the same tool loading and SASS reading
from static_attention import _load_tool, screen_parser, write_csv
from static_cuda_attention import loops, sass_functions

KERNELS = ("layernorm_fwd", "rmsnorm_fwd", "layernorm_bwd", "softmax_fwd", "softmax_bwd")


def sass_counts(tool, compiled) -> tuple[int, int]:
    """(instructions of the whole kernel, instructions of its largest innermost loop or 0)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        sass = subprocess.run(
            [os.path.join(tool._BIN, "cuobjdump"), "-sass", cubin], capture_output=True, text=True
        ).stdout
    (ins,) = sass_functions(sass).values()
    real = [t for _, t in ins if not t.startswith(("NOP", "BRA `(.L_x_"))]
    biggest = max((lp["instructions"] for lp in loops(ins, matrix_only=False)), default=0)
    return len(real), biggest


def compile_one(tool_path: str, kernel: str, n: int, warps: int) -> dict:
    tool = _load_tool(tool_path)
    import torch

    from fusedattn.triton_kernels import layernorm as LN
    from fusedattn.triton_kernels import softmax as SM

    block = 1 << (n - 1).bit_length()
    M = 4
    x = torch.empty(M, n, dtype=torch.bfloat16)
    w = torch.empty(n, dtype=torch.float32)
    stats = torch.empty(M, dtype=torch.float32)
    common = dict(BLOCK_N=block, num_warps=warps, grid=(M,))
    if kernel in ("layernorm_fwd", "rmsnorm_fwd"):
        rms = kernel == "rmsnorm_fwd"
        c = LN.layer_norm_fwd_one_pass.warmup(
            x, x, w, None if rms else w, stats, stats, n, n, n, 1e-5,
            HAS_WEIGHT=True, HAS_BIAS=not rms, RMS=rms, **common,
        )  # fmt: skip
    elif kernel == "layernorm_bwd":
        part = torch.empty(8, n, dtype=torch.float32)
        c = LN.layer_norm_bwd_one_pass.warmup(
            x, x, x, w, stats, stats, part, part, n, n, n, M, n, 7,  # 7: not specialized away
            HAS_WEIGHT=True, PARAM_GRADS=True, RMS=False, **common,
        )  # fmt: skip
    elif kernel == "softmax_fwd":
        x4 = x.view(1, 1, M, n)
        strides = (M * n, M * n, n, 1)
        c = SM.softmax_fwd_one_pass.warmup(
            x4, x4, None, *strides, *strides, 0, 0, 0, 0, 1, M, n, 1.0,
            HAS_MASK=False, MASK_IS_BOOL=False, IS_CAUSAL=False, **common,
        )  # fmt: skip
    else:
        x4 = x.view(1, 1, M, n)
        strides = (M * n, M * n, n, 1)
        c = SM.softmax_bwd_one_pass.warmup(
            x4, x4, x4, *strides, *strides, *strides, 1, M, n, 1.0, **common
        )
    report = tool.report(c)
    total, loop = sass_counts(tool, c)
    per_row = loop if kernel == "layernorm_bwd" else total  # the one kernel that loops rows
    return dict(
        kernel=kernel, n=n, warps=warps, regs=report["regs"],
        spill_bytes=(report["spill_store_bytes"] or 0) + (report["spill_load_bytes"] or 0),
        instructions_per_row_per_warp=per_row,
        instructions_per_element=round(per_row * warps / n, 2),
    )  # fmt: skip


def main(argv=None) -> int:
    parser = screen_parser(__doc__)
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--n", default="1024,4096,8192,32768")
    parser.add_argument("--warps", default="4,8,16")
    args = parser.parse_args(argv)
    jobs = [(args.tool, k, int(n), int(w)) for k in args.kernels.split(",")
            for n in args.n.split(",") for w in args.warps.split(",")]  # fmt: skip
    rows = []
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(compile_one, *job): job for job in jobs}
        for future in concurrent.futures.as_completed(futures):
            job = futures[future]
            try:
                row = future.result()
            except Exception as exc:  # one bad candidate must not stop the screen
                row = dict(kernel=job[1], n=job[2], warps=job[3], error=repr(exc)[:300])
            rows.append(row)
    order = collections.defaultdict(int, {k: i for i, k in enumerate(KERNELS)})
    rows.sort(key=lambda r: (order[r["kernel"]], r["n"], r["warps"]))
    for row in rows:
        print(", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    if args.csv:
        write_csv(rows, args.csv)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
