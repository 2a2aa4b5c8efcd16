"""Compile fusedattn.linear's batch-invariant matmul (triton_kernels/matmul.py) for Hopper
(sm_90) without a GPU and print what the compiler made of it: registers, spills, shared
memory, whether the dots became wgmma, and the SASS of the K loop per iteration, at the tiles
matmul_config gives each dtype (and candidates, --tiles), before any device minute is spent.

    python scripts/static_matmul.py [--tool ../shared/tools/sm90_static.py] [--csv out.csv]
        [--tiles 64x64x64w4s4,128x128x64w8s3]

Cases: bf16 (the serving dtype), fp32 with exact products (TF32 off, torch's default) and
with TF32 allowed. Each compiles in its own process.
"""

from __future__ import annotations

from static_attention import run_screen, screen_parser, write_csv
from static_decode import _load_tool, screen_row

CASES = {"bf16": ("bfloat16", "tf32"), "fp32_ieee": ("float32", "ieee"),
         "fp32_tf32": ("float32", "tf32")}  # fmt: skip


def parse_tiles(text: str):
    """'64x64x64w4s4' -> (block_m, block_n, block_k, warps, stages)."""
    dims, rest = text.split("w")
    warps, stages = rest.split("s")
    return (*map(int, dims.split("x")), int(warps), int(stages))


def compile_one(tool_path: str, case: str, tiles: str | None) -> dict:
    tool = _load_tool(tool_path)
    import torch

    from fusedattn.triton_kernels import matmul as K

    dtype, precision = CASES[case]
    dtype = getattr(torch, dtype)
    cfg = K.matmul_config(torch.empty(0, dtype=dtype).element_size())
    bm, bn, bk, warps, stages = (
        parse_tiles(tiles) if tiles
        else (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages)
    )  # fmt: skip
    M, N, Kd = 64, 4096, 4096
    a = torch.empty(M, Kd, dtype=dtype)
    w = torch.empty(N, Kd, dtype=dtype)
    c = torch.empty(M, N, dtype=dtype)
    compiled = K.matmul_kernel.warmup(
        a, w.t(), a, c, M, N, Kd, Kd, 1, 1, Kd, N, 1,
        HAS_BIAS=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m,
        PRECISION=precision, DOT_IN_FP32=False, num_warps=warps, num_stages=stages, grid=(1,),
    )  # fmt: skip
    return screen_row(tool, compiled, case=case, tiles=f"{bm}x{bn}x{bk}w{warps}s{stages}")


def main(argv=None) -> int:
    parser = screen_parser(__doc__)
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {','.join(CASES)}")
    parser.add_argument(
        "--tiles", default="", help="candidates MxNxKwWARPSsSTAGES, comma-separated"
    )
    args = parser.parse_args(argv)
    jobs = [
        (args.tool, case, t or None)
        for case in args.cases.split(",")
        for t in ["", *filter(None, args.tiles.split(","))]
    ]
    rows = run_screen(compile_one, jobs, args.jobs, lambda job: dict(case=job[1], tiles=job[2]))
    if args.csv:
        write_csv(rows, args.csv)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
