"""Compile the Triton decode kernel (triton_kernels/decode.py) for Hopper (sm_90) without a GPU
and print what the compiler made of it: registers, spills, shared memory, how the K/V loads
were issued (cp.async pipelined into shared memory, and in how many bytes per load), and the
SASS of the key loop per iteration (issue #32: "loads in 16-byte vectors, no spills, the K/V
loads pipelined" before any device minute is spent).

Run it in the venv with the GPU machine's versions (torch 2.11, triton 3.6; see
scripts/static_attention.py), fusedattn installed there:

    python scripts/static_decode.py --tool ../shared/tools/sm90_static.py --csv out.csv

Cases are Llama-3-8B's attention heads (Hq 32, Hkv 8, D 128), bf16, a 32k cache: contiguous,
paged (page 16 and 256), Tq 1 and 4, one split (output written by the kernel) or several
(fp32 partials). Each case compiles in its own process.
"""

from __future__ import annotations

import concurrent.futures
import csv
import importlib.util
import re
import sys

from static_attention import screen_parser

HQ, HKV, D, S = 32, 8, 128, 32768
CASES = {
    "contiguous_tq1": dict(paged=0, Tq=1, split=True),
    "contiguous_tq1_nosplit": dict(paged=0, Tq=1, split=False),
    "contiguous_tq4": dict(paged=0, Tq=4, split=True),
    "paged16_tq1": dict(paged=16, Tq=1, split=True),
    "paged256_tq1": dict(paged=256, Tq=1, split=True),
    "paged16_tq4_causal_window": dict(paged=16, Tq=4, split=True, window=(4095, 0)),
    # Hugging Face's decode step: its (B, Hkv, S, D) cache read in place, the mask's last row,
    # each program finding the row's visible bounds itself (MASK_BOUNDS)
    "hf_layout_key_mask_tq1": dict(paged=0, Tq=1, split=True, hf=True),
    # paged prefill (varlen_attention with a block table): 64 packed new queries a sequence
    "paged16_varlen_tq64_causal": dict(paged=16, Tq=64, split=False, varlen=True, window=(-1, 0)),
    # fp8 caches (issue #60): e4m3 K/V loaded one byte an element and converted per tile, a
    # descale per (sequence, kv head); an fp8 q as well; e5m2; the paged prefill over fp8
    "contiguous_tq1_fp8": dict(paged=0, Tq=1, split=True, cache_fp8=1),
    "contiguous_tq1_fp8_q": dict(paged=0, Tq=1, split=True, cache_fp8=1, q_fp8=1),
    "contiguous_tq1_e5m2": dict(paged=0, Tq=1, split=True, cache_fp8=2),
    "paged16_tq1_fp8": dict(paged=16, Tq=1, split=True, cache_fp8=1),
    "hf_layout_key_mask_tq1_fp8": dict(paged=0, Tq=1, split=True, hf=True, cache_fp8=1),
    "paged16_varlen_tq64_causal_fp8": dict(paged=16, Tq=64, split=False, varlen=True,
                                           window=(-1, 0), cache_fp8=1),
    # fusedattn.batch_invariant (issue #73): tiles from the sequence's first key, splits of
    # 1024 keys at fixed positions, an entry per key row of a paged cache
    "contiguous_tq1_invariant": dict(paged=0, Tq=1, split=True, invariant=16),
    "paged16_tq1_invariant": dict(paged=16, Tq=1, split=True, invariant=16),
    "contiguous_tq1_fp8_invariant": dict(paged=0, Tq=1, split=True, cache_fp8=1, invariant=16),
}  # fmt: skip
FP8_TYPES = {1: "float8_e4m3fn", 2: "float8_e5m2"}


def _load_tool(path: str):
    spec = importlib.util.spec_from_file_location("sm90_static", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.install()
    return tool


def load_widths(ptx: str) -> dict:
    """How the kernel's global loads were issued: cp.async copies by size in bytes (16 = one
    16-byte vector per thread), and plain ld.global by vector width."""
    cp = re.findall(
        r"cp\.async\.(?:ca|cg)\.shared\.global(?:\.\w+)*\s+\[[^\]]+\],\s*\[[^\]]+\],\s*(0x[0-9a-f]+|\d+)",
        ptx,
    )
    ld = re.findall(r"ld\.global(?:\.\w+)*?(\.v[248])?\.(?:b|u|f|s)(\d+)\b", ptx)
    widths = {}
    for size in cp:
        key = f"cp.async {int(size, 0)}B"
        widths[key] = widths.get(key, 0) + 1
    for vec, bits in ld:
        n = int(vec[2:]) if vec else 1
        key = f"ld.global {n * int(bits) // 8}B"
        widths[key] = widths.get(key, 0) + 1
    return widths


def launch_args(name: str):
    """(args, constexprs with the launch options, config) of case `name`, laid out as
    ops/shared/decode_launch.py launches attention_decode (a CPU test binds them to the kernel's signature,
    so a new kernel parameter cannot silently break this screen again)."""
    import torch

    from fusedattn.triton_kernels import decode as K

    c = CASES[name]
    Tq, page = c["Tq"], c["paged"]
    group = HQ // HKV
    cache_fp8, q_fp8 = c.get("cache_fp8", 0), c.get("q_fp8", 0)
    cfg = K.decode_config(group * Tq, D, D, True)
    bf16 = dict(dtype=torch.bfloat16)
    cache_type = dict(dtype=getattr(torch, FP8_TYPES[cache_fp8])) if cache_fp8 else bf16
    q_type = dict(dtype=getattr(torch, FP8_TYPES[q_fp8])) if q_fp8 else bf16
    B = 1
    varlen = bool(c.get("varlen"))
    q = torch.empty(B * Tq, HQ, D, **q_type) if varlen else torch.empty(B, Tq, HQ, D, **q_type)
    if page:
        kc = torch.empty(B * S // page, page, HKV, D, **cache_type)
        table = torch.empty(B, S // page, dtype=torch.int32)
    elif c.get("hf"):
        kc = torch.empty(B, HKV, S, D, **cache_type).transpose(1, 2)
        table = None
    else:
        kc = torch.empty(B, S, HKV, D, **cache_type)
        table = None
    descale = torch.empty(B, HKV) if cache_fp8 else None  # per (sequence, kv head)
    q_descale = torch.empty(B, HKV) if q_fp8 else None
    key_mask = torch.empty(B, S, dtype=torch.bool) if c.get("hf") else None
    out = torch.empty(q.shape, **bf16)  # an fp8 q's output is bf16
    lse = torch.empty(HQ, B * Tq) if varlen else torch.empty(B, HQ, Tq)
    cu_q = torch.empty(B + 1, dtype=torch.int32) if varlen else None
    q_strides = (0, *q.stride()[:2]) if varlen else q.stride()[:3]
    out_strides = (0, *out.stride()[:2]) if varlen else out.stride()[:3]
    lse_strides = (0, lse.stride(0)) if varlen else lse.stride()[:2]
    splits = 33 if c["split"] else 1
    part_o = torch.empty(B, HKV, splits, group * Tq, D) if c["split"] else None
    part_lse = torch.empty(B, HKV, splits, group * Tq) if c["split"] else None
    seqlens = torch.empty(B, dtype=torch.int32)
    left, right = c.get("window", (-1, -1))
    d_strides = (HKV, 1) if cache_fp8 else (0, 0)
    args = (
        q, kc, kc, out, lse, part_o, part_lse, seqlens, None, table, None, None, key_mask, cu_q,
        q_descale, descale, descale,
        *q_strides, *kc.stride()[:3], *kc.stride()[:3], *out_strides, *lse_strides,
        table.stride(0) if page else 0, 0, S if c.get("hf") else 0, Tq, HQ,
        HKV, D, D, group, -(-group * Tq // cfg.block_m), splits, D**-0.5, 0.0, left, right, S,
        kc.shape[0], 0, *((HKV, 1) if q_fp8 else (0, 0)), *d_strides, *d_strides,
    )  # fmt: skip
    constexprs = dict(
        VARLEN_Q=varlen, HAS_LEFTPAD=False, PAGED=bool(page), PAGE_SIZE=page or 1, HAS_LEFT=left >= 0,
        HAS_RIGHT=right >= 0, SOFTCAP=False, HAS_ALIBI=False, HAS_SINKS=False,
        SPLIT=c["split"], HAS_KEY_MASK=bool(c.get("hf")), PRECISION="tf32",
        DOT_IN_FP32=False, INTERPRETED=False, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_D=cfg.block_d, BLOCK_DV=cfg.block_dv, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, MASK_BOUNDS=bool(c.get("hf")), MASK_SCAN=1024,
        Q_FP8=q_fp8, CACHE_FP8=cache_fp8, DOT_F16=bool(cache_fp8),
        INVARIANT_SPLIT=c.get("invariant", 0),
    )  # fmt: skip
    return args, constexprs, cfg


def compile_one(tool_path: str, name: str) -> dict:
    tool = _load_tool(tool_path)
    from fusedattn.triton_kernels import decode as K

    args, constexprs, cfg = launch_args(name)
    compiled = K.attention_decode.warmup(*args, grid=(1,), **constexprs)
    row = dict(case=name, tiles=f"{cfg.block_m}x{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}")
    row |= {k: v for k, v in tool.report(compiled).items() if k != "name"}
    row["loads"] = "; ".join(
        f"{k} x{v}" for k, v in sorted(load_widths(compiled.asm["ptx"]).items())
    )
    row["loops"] = loop_summary(tool, compiled)
    return row


def screen_row(tool, compiled, **fields) -> dict:
    """A screen's row: the given fields, the tool's report (registers, spills, shared memory,
    instruction counts) and the loop summary."""
    row = dict(fields) | {k: v for k, v in tool.report(compiled).items() if k != "name"}
    row["loops"] = loop_summary(tool, compiled)
    return row


def loop_summary(tool, compiled) -> str:
    """The instruction mix of each innermost SASS loop holding matrix instructions."""
    return " | ".join(
        f"{lp['instructions']} ins int {lp['int']} fp32 {lp['fp32']} mufu {lp['MUFU']} "
        f"mma {lp['HGMMA'] or lp['HMMA']} ldgsts {lp['LDGSTS']} local {lp['LDL+STL']}"
        for lp in tool.loops(compiled)
    )


def main(argv=None) -> int:
    parser = screen_parser(__doc__)
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {','.join(CASES)}")
    args = parser.parse_args(argv)
    rows = []
    names = args.cases.split(",")
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = {pool.submit(compile_one, args.tool, n): n for n in names}
        for future in concurrent.futures.as_completed(futures):
            try:
                row = future.result()
            except Exception as exc:  # report and go on
                row = dict(case=futures[future], error=repr(exc)[:300])
            rows.append(row)
            print(", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    if args.csv:
        fields = list(dict.fromkeys(k for r in rows for k in r))
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(sorted(rows, key=lambda r: names.index(r["case"])))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
