"""Compile the Triton MLA decode kernel (triton_kernels/mla.py) for Hopper (sm_90) without a GPU
and print what the compiler made of it: registers, spills, shared memory, wgmma / cp.async use
and the SASS of the key loop per iteration (issue #83: a 64 x 512 fp32 accumulator does not
fit one warpgroup; which tiles do, before any device minute is spent).

Run it in the venv with the GPU machine's versions (torch 2.11, triton 3.6; see
scripts/static_attention.py), fusedattn importable there (PYTHONPATH=python):

    python scripts/static_mla.py --tool ../shared/tools/sm90_static.py --csv out.csv
    python scripts/static_mla.py --tiles 32x32w8s2 --cases hq16_paged64

Cases are DeepSeek's latent (512 + 64), bf16 queries, a 32k cache: Hq 16 (memory-bound) and
128 (compute-bound) rows, pages 64 and 16, bf16 and fp8 (e4m3) caches, one split or several,
Tq 2 causal (MTP), batch invariance, and the sparse form (2048 gathered slots a query).
--tiles BMxBNwWsS replaces the shipped tiles
(mla_config's) for every case; each case compiles in its own process.
"""

from __future__ import annotations

import re
import sys

from static_attention import run_screen, screen_parser, write_csv
from static_decode import _load_tool, screen_row

DL, DR, S = 512, 64, 32768
CASES = {
    "hq16_paged64": dict(Hq=16, page=64),
    "hq16_paged64_nosplit": dict(Hq=16, page=64, split=False),
    "hq16_paged16": dict(Hq=16, page=16),
    "hq128_paged64": dict(Hq=128, page=64),
    "hq16_paged64_fp8": dict(Hq=16, page=64, fp8=True),
    "hq128_paged64_fp8": dict(Hq=128, page=64, fp8=True),
    "hq16_paged64_tq2_causal": dict(Hq=16, page=64, Tq=2, causal=True),
    "hq16_paged64_invariant": dict(Hq=16, page=64, invariant=32),
    # DeepSeek sparse attention (issue #85): each query's 2048 listed slots gathered
    "sparse_hq16_paged64": dict(Hq=16, page=64, sparse=2048),
    "sparse_hq128_paged64": dict(Hq=128, page=64, sparse=2048),
    "sparse_hq128_paged64_tq2": dict(Hq=128, page=64, sparse=2048, Tq=2),
    "sparse_hq128_paged64_fp8": dict(Hq=128, page=64, sparse=2048, fp8=True),
    # DeepSeek's 656-byte rows (e4m3 latent, a float32 scale per 128 values, bf16 rope)
    "hq128_paged64_ds656": dict(Hq=128, page=64, ds=True),
    "sparse_hq128_paged64_ds656": dict(Hq=128, page=64, sparse=2048, ds=True),
    "sparse_hq16_paged64_ds656": dict(Hq=16, page=64, sparse=2048, ds=True),
}


def parse_tiles(text: str):
    m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", text)
    if not m:
        raise ValueError(f"tiles are BMxBNwWsS, e.g. 16x32w4s2; got {text!r}")
    return tuple(int(g) for g in m.groups())


def launch_args(name: str, tiles=None):
    """(args, constexprs with the launch options, tile label) of case `name`, laid out as
    ops/mla/triton_backend.TritonMLA launches mla_decode (a CPU test binds them to the
    kernel's signature)."""
    import torch

    from fusedattn.triton_kernels import mla as K

    c = CASES[name]
    Hq, page, Tq = c["Hq"], c["page"], c.get("Tq", 1)
    sparse = c.get("sparse", 0)
    cfg = K.mla_config(Hq if sparse else Hq * Tq, DL, DR, True, bool(c.get("fp8")),
                       bool(c.get("ds")))  # fmt: skip
    bm, bn, warps, stages = tiles or (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages)
    B = 1
    cache_dtype = torch.float8_e4m3fn if c.get("fp8") else torch.bfloat16
    q = torch.empty(B, Tq, Hq, DL + DR, dtype=torch.bfloat16)
    q_v, q_r = q[..., :DL], q[..., DL:]
    kv = torch.empty(B * S // page, page, DL + DR, dtype=cache_dtype)
    if c.get("ds"):  # 656 bytes a row
        kv = torch.empty(B * S // page, page, 656, dtype=torch.uint8)
    table = torch.empty(B, S // page, dtype=torch.int32)
    out = torch.empty(B, Tq, Hq, DL, dtype=torch.bfloat16)
    lse = torch.empty(B, Hq, Tq)
    split = c.get("split", True)
    splits = 16 if split else 1
    part_o = torch.empty(B * splits * Hq * Tq * DL) if split else None
    part_lse = torch.empty(B * splits * Hq * Tq) if split else None
    seqlens = torch.empty(B, dtype=torch.int32)
    descale = torch.empty(1) if c.get("fp8") else None
    m_blocks = -(-(Hq if sparse else Hq * Tq) // bm)
    indices = torch.empty(B, Tq, sparse, dtype=torch.int32) if sparse else None
    args = (
        q_v, q_r, kv, out, lse, part_o, part_lse, seqlens, table, None, descale, indices,
        *q_v.stride()[:3], *q_r.stride()[:3], kv.stride(0), kv.stride(1), *out.stride()[:3],
        *lse.stride()[:2], table.stride(0), Tq, Hq, DL, DR, m_blocks, splits, (DL + DR) ** -0.5,
        S, kv.shape[0], *(indices.stride()[:2] if sparse else (0, 0)), sparse,
    )  # fmt: skip
    constexprs = dict(
        PAGED=True, PAGE_SIZE=page, IS_CAUSAL=bool(c.get("causal")), HAS_SINKS=False,
        SPLIT=split or bool(c.get("invariant")), HAS_ROPE=True, PRECISION="tf32",
        DOT_IN_FP32=False, INTERPRETED=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_V=cfg.block_v,
        BLOCK_R=cfg.block_r, num_warps=warps, num_stages=stages,
        CACHE_FP8=3 if c.get("ds") else 1 if c.get("fp8") else 0,
        INVARIANT_SPLIT=c.get("invariant", 0),
        SPARSE=bool(sparse),
    )  # fmt: skip
    return args, constexprs, f"{bm}x{bn}w{warps}s{stages}"


def compile_one(tool_path: str, name: str, tiles=None) -> dict:
    tool = _load_tool(tool_path)
    from fusedattn.triton_kernels import mla as K

    args, constexprs, label = launch_args(name, tiles)
    compiled = K.mla_decode.warmup(*args, grid=(1,), **constexprs)
    return screen_row(tool, compiled, case=name, tiles=label)


def main(argv=None) -> int:
    parser = screen_parser(__doc__)
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {','.join(CASES)}")
    parser.add_argument("--tiles", type=parse_tiles, action="append", default=[],
                        help="BMxBNwWsS, repeatable; default: mla_config's")  # fmt: skip
    args = parser.parse_args(argv)
    jobs = [(args.tool, name, tiles) for name in args.cases.split(",")
            for tiles in (args.tiles or [None])]  # fmt: skip
    rows = run_screen(compile_one, jobs, args.jobs, lambda job: dict(case=job[1], tiles=job[2]))
    if args.csv:
        write_csv(rows, args.csv)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
