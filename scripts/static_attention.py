"""Compile the Triton attention kernels for Hopper (sm_90) without a GPU and print what the
compiler made of them: registers, spills, shared memory, whether the dots became wgmma, the
SASS instruction mix of each key/query loop per iteration, and how many of a loop's MUFU
(exp2) issue while a wgmma is in flight (mufu_under_wgmma: the softmax hidden under the tensor
cores). Screen tile and variant candidates here before spending device minutes on them
(issue #12).

Run it in a venv with the GPU machine's versions (torch 2.11, triton 3.6: see
ENVIRONMENT.md) where fusedattn is installed (`FUSEDATTN_SKIP_CUDA_BUILD=1 pip install
--no-build-isolation --no-deps -e .`), with the shared sm90_static tool:

    python scripts/static_attention.py --tool ../shared/tools/sm90_static.py \\
        --variants plain,causal,window --tiles fwd=128x64w8s3,fwd=64x64w4s2 --csv out.csv

Tiles are KERNEL=BMxBNwWARPSsSTAGES[t][m][p] with KERNEL one of fwd, dkdv, dq; the flags (see
Tiles in triton_kernels/attention.py): t, tensor-descriptor (TMA) copies, and p, the pipelined
interior loop (the forward); m, dK/dV's boundary loops merged into one. The kernels not named
keep the default GPU tiles. Each (variant, kernel, tiles) compiles in its own process.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import csv
import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

# shapes of the H200 benchmark point (bf16, D=128): strides decide Triton's specialisation
B, H, T, D = 1, 16, 4096, 128
VARIANTS = {
    "plain": {},
    "causal": dict(window_right=0),
    "window": dict(window_left=1024, window_right=0),
    "key_padding": dict(kpm=True),
    "bool_mask": dict(mask="bool"),
    "bool_mask_causal": dict(mask="bool", window_right=0),
    "float_mask": dict(mask="float"),
    "float_mask_causal": dict(mask="float", window_right=0),
    "float_mask_key_padding": dict(mask="float", kpm=True),
    "softcap": dict(softcap=30.0),
    "alibi": dict(alibi=True, window_right=0),
    "sinks": dict(sinks=True, window_right=0),
    "varlen": dict(varlen=True, window_right=0),
    # the fp8 forward (issue #60; forward only): q, k, v in float8_e4m3fn, a descale per
    # (sequence, kv head), output bf16; both dots should become e4m3 wgmma (k = 32)
    "fp8": dict(fp8=True),
    "fp8_causal": dict(fp8=True, window_right=0),
    "fp8_varlen": dict(fp8=True, varlen=True, window_right=0),
    # every option at once, as the tests' "everything" variant (bottom-right alignment aside)
    "everything": dict(
        window_left=1024,
        window_right=64,
        softcap=30.0,
        alibi=True,
        sinks=True,
        kpm=True,
        mask="float",
    ),
    # block masks (issue #84 item 4): a document-causal BlockMask (documents of 1000 tokens:
    # full, partial and empty blocks) at each block size, with and without a score_mod; the
    # launcher fits each kernel's tiles into the blocks (triton_args.block_sparse_config)
    **{f"blocks{bs}": dict(blocks=bs) for bs in (128, 64, 32, 16)},
    **{
        f"blocks{bs}_{mod}": dict(blocks=bs, mod=mod)
        for bs in (128, 64, 32, 16)
        for mod in ("relative_bias", "learnable_bias", "softcap")
    },
    # score_mods on the dense kernels: the hook must not add spills there either
    "relative_bias": dict(mod="relative_bias"),
    "learnable_bias": dict(mod="learnable_bias"),
    "softcap_mod": dict(mod="softcap"),
}
KERNELS = ("fwd", "dkdv", "dq")


def _score_mod(kind: str):
    """(ScoreMod, its captures' float32 gradient buffers or None) for a screen variant: a
    relative-position bias per head (a gather by q - kv), the same table learnable (dq adds
    its gradient with atomics), or softcap as a pointwise mod."""
    import torch

    from fusedattn.score_mod import prepare

    table = torch.empty(H, 2 * T, requires_grad=kind == "learnable_bias")
    if kind == "softcap":
        fn = lambda s, b, h, q, kv: torch.tanh(s / 30.0) * 30.0  # noqa: E731
    else:
        fn = lambda s, b, h, q, kv: s + table[h, q - kv + T]  # noqa: E731
    mod = prepare(fn, torch.device("cpu"))
    grads = [torch.empty(t.shape) if t.requires_grad else None for t in mod.tensors]
    return mod, grads if any(g is not None for g in grads) else None


def _document_blocks(bs: int):
    """The kernels' form of a document-causal mask over T (documents of 1000 tokens)."""
    import torch

    from fusedattn.masks import create_block_mask

    doc = torch.arange(T) // 1000
    mask = create_block_mask(lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv), None, None,
                             T, T, device="cpu", BLOCK_SIZE=bs)  # fmt: skip
    return mask.kernel_blocks()


SMEM_LIMIT = 232448  # bytes of shared memory a block may use on sm_90 (227 KB)
SASS_LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")  # as sm90_static.loops reads cuobjdump


def parse_tiles(spec: str):
    """KERNEL=TILES with TILES as Tiles.parse takes them (flags t: tensor descriptors, p: the
    pipelined interior loop, both fwd; m: merged boundary loops, dkdv) -> (kernel, Tiles)."""
    from fusedattn.triton_kernels.attention import Tiles

    kernel, _, rest = spec.partition("=")
    if kernel not in KERNELS:
        raise argparse.ArgumentTypeError(f"tiles look like fwd=128x64w8s3p, got {spec!r}")
    try:
        return kernel, Tiles.parse(rest, kernel)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _load_tool(path: str):
    spec = importlib.util.spec_from_file_location("sm90_static", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.install()
    return tool


def compile_one(tool_path: str, variant: str, kernel: str, tiles=None, D: int = D) -> dict:
    """Compile one kernel of one variant for sm_90; its resources and inner loops."""
    tool = _load_tool(tool_path)
    import torch

    from fusedattn.ops.attention.triton_args import TritonAttentionLaunch
    from fusedattn.triton_kernels import attention as A

    v = VARIANTS[variant]
    fp8 = bool(v.get("fp8"))
    if fp8 and kernel != "fwd":
        raise ValueError("the fp8 attention is inference only: its variants screen fwd")
    cfg = A.attention_config(D, D, on_gpu=True, arch=90,  # the tiles an sm_90 card gets
                             elem_bytes=1 if fp8 else 2,
                             alibi_or_varlen=bool(v.get("alibi") or v.get("varlen")))  # fmt: skip
    if tiles is not None:
        cfg = dataclasses.replace(cfg, **{kernel: tiles})
    elif v.get("blocks") or v.get("mod"):  # the tiles a GPU call with them gets
        from fusedattn.ops.attention.triton_args import block_sparse_config, flex_config

        size = (v["blocks"], v["blocks"]) if v.get("blocks") else None
        cfg = flex_config(block_sparse_config(cfg, *size) if size else cfg, size,
                          bool(v.get("mod")))  # fmt: skip
    bf16 = dict(dtype=torch.bfloat16)
    inputs = dict(dtype=torch.float8_e4m3fn) if fp8 else bf16
    if v.get("varlen"):
        q, k, vv = (torch.empty(B * T, H, D, **inputs) for _ in range(3))
        cu = torch.tensor([0, T // 2, T], dtype=torch.int32)
        varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=T, max_seqlen_k=T)
        out = torch.empty(q.shape, **bf16)
        lse = torch.empty(H, B * T)
    else:
        q, k, vv = (torch.empty(B, T, H, D, **inputs).transpose(1, 2) for _ in range(3))
        varlen = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0)
        out = torch.empty(B, T, H, D, **bf16).transpose(1, 2)
        lse = torch.empty(B, H, T)
    if fp8:  # one descale per (sequence, kv head), as the API passes them
        varlen["descales"] = tuple(torch.empty(max(B, 2), H) for _ in range(3))
    mask = None
    if v.get("mask") == "bool":
        mask = torch.empty(B, 1, T, T, dtype=torch.bool)
    elif v.get("mask") == "float":
        mask = torch.empty(B, 1, T, T, **bf16)
    mod, mod_grads = _score_mod(v["mod"]) if v.get("mod") else (None, None)
    L = TritonAttentionLaunch(
        q, k, vv, mask, torch.empty(B, T, dtype=torch.bool) if v.get("kpm") else None,
        torch.empty(H) if v.get("alibi") else None, torch.empty(H) if v.get("sinks") else None,
        window_left=v.get("window_left", -1), window_right=v.get("window_right", -1),
        bottom_right=False, scale=D**-0.5, softcap=v.get("softcap", 0.0), dropout_p=0.0,
        seed=None, config=cfg, interpreted=False, **varlen,
        block=_document_blocks(v["blocks"]) if v.get("blocks") else None,
        mod=mod,
    )  # fmt: skip
    L.mod_grads = mod_grads
    if kernel == "fwd":
        fn, (grid, args, constexprs) = A.attention_fwd, L.fwd_args(q, k, vv, out, lse)
    elif kernel == "dkdv":
        fn, (grid, args, constexprs) = (
            A.attention_bwd_dkdv,
            L.dkdv_args(q, k, vv, out, lse, lse, torch.empty_like(k), torch.empty_like(vv)),
        )
    else:
        fn, (grid, args, constexprs) = (
            A.attention_bwd_dq,
            L.dq_args(q, k, vv, out, out, lse, lse, torch.empty_like(q), torch.empty(0), False),
        )
    compiled = fn.warmup(*args, grid=grid, **constexprs)
    t = getattr(L.cfg, kernel)  # a block mask's fitted tiles
    row = dict(
        variant=variant,
        head_dim=D,
        kernel=kernel,
        tiles=t.spec,
    )
    row |= {k: v for k, v in tool.report(compiled).items() if k != "name"}
    listing = _sass(tool, compiled)
    sass = [text for _, text in listing]
    if fp8:  # the PTX's fp8 wgmma by shape and types (e4m3 operands, k = 32 expected)
        shapes = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.(\w+)\.(\w+)",
                            compiled.asm["ptx"])  # fmt: skip
        row["wgmma_shapes"] = "; ".join(sorted({f"{m} {a}x{b}" for m, a, b in shapes}))
    ttgir = compiled.asm.get("ttgir", "")
    if t.warp_spec:  # did Triton's Hopper pass apply? (num_warps then counts every partition)
        row["warp_specialized"] = "ttg.warp_specialize" in ttgir
    row["fits_smem"] = row.get("shared_bytes", 0) <= SMEM_LIMIT
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", compiled.asm["ptx"])
    row["wgmma_wait_depths"] = "/".join(sorted(set(waits))) or "-"
    loops = matrix_loops(listing)
    elements = t.block_m * t.block_n
    row["loops"] = " | ".join(
        f"{lp['instructions']} ins ({lp['instructions'] / elements * t.num_warps:.2f}/elem) "
        f"int {lp['int']} fp32 {lp['fp32']} mufu {lp['MUFU']} mma {lp['mma']} "
        f"mufu_under_wgmma {mufu_under_wgmma(sass[lp['lo'] : lp['hi'] + 1])}"
        for lp in loops
    )
    return row


MATRIX_OPS = ("HGMMA", "QGMMA", "HMMA")  # QGMMA: the fp8 wgmma's SASS name
FP32_OPS = ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP")  # as sm90_static counts them
INT_OPS = ("IMAD", "IADD3", "LEA", "ISETP", "SEL", "LOP3", "SHF", "IMNMX", "IABS", "VIADD",
           "VIADDMNMX", "UIADD3", "UIMAD", "ULEA", "USEL", "UISETP")  # fmt: skip


def matrix_loops(listing: list[tuple[int, str]]) -> list[dict]:
    """sm90_static.loops over the kernel's SASS, counting fp8's QGMMA too (the tool knows
    HGMMA and HMMA only): the innermost backward-branch loops holding matrix instructions,
    largest first, with the instruction mix of one iteration per warp."""
    index = {addr: i for i, (addr, _) in enumerate(listing)}
    sass = [text for _, text in listing]
    found = []
    for i, (addr, text) in enumerate(listing):
        m = re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", text)
        if not m or int(m.group(1), 16) >= addr or int(m.group(1), 16) not in index:
            continue
        target = index[int(m.group(1), 16)]
        ops = [
            re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in sass[target : i + 1]
        ]
        c = collections.Counter(ops)
        mma = sum(c[k] for k in MATRIX_OPS)
        if mma:
            found.append(dict(lo=target, hi=i, instructions=len(ops), mma=mma, MUFU=c["MUFU"],
                              fp32=sum(c[k] for k in FP32_OPS), int=sum(c[k] for k in INT_OPS)))  # fmt: skip
    inner = [a for a in found
             if not any(b is not a and a["lo"] <= b["lo"] and b["hi"] <= a["hi"] for b in found)]  # fmt: skip
    return sorted(inner, key=lambda r: -r["instructions"])


def _sass(tool, compiled) -> list[tuple[int, str]]:
    """The kernel's SASS instructions as (address, text), in order."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        text = subprocess.run([os.path.join(tool._BIN, "cuobjdump"), "-sass", cubin],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    return [(int(m.group(1), 16), m.group(2).strip())
            for m in map(SASS_LINE.match, text.splitlines()) if m]  # fmt: skip


def mufu_under_wgmma(body: list[str]) -> int:
    """MUFU instructions (the softmax's exp2) of one loop iteration issued while a wgmma is in
    flight: after an HGMMA and before the WARPGROUP.DEPBAR that waits for all of them (LE 0),
    counting a wgmma left in flight at the back edge into the next iteration's head. What
    Tiles.pipeline is for; with it 0, the softmax and the tensor cores take turns."""
    in_flight, count = False, 0
    for lap in range(2):  # the first lap only finds what crosses the back edge
        for text in body:
            op = re.sub(r"^@!?U?P\w+\s+", "", text)
            if op.startswith(("HGMMA", "QGMMA")):
                in_flight = True
            elif op.startswith("WARPGROUP.DEPBAR") and op.rstrip().endswith("0x0"):
                in_flight = False
            elif op.startswith("MUFU") and in_flight and lap:
                count += 1
    return count


def write_csv(rows: list[dict], path: str) -> None:
    """The screen's rows, columns in first-seen order (an error row adds its own)."""
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def screen_parser(doc: str) -> argparse.ArgumentParser:
    """The screens' common options: --tool (the sm90_static tool, ../shared/tools by default),
    --jobs (processes compiling at once) and --csv (write the rows there too)."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    here = os.path.dirname(os.path.abspath(__file__))
    parser.add_argument(
        "--tool", default=os.path.join(here, "..", "..", "shared", "tools", "sm90_static.py")
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument("--csv", help="write the rows here too")
    return parser


def run_screen(compile_one, jobs: list[tuple], workers: int, error_row) -> list[dict]:
    """compile_one(*job) for every job in a pool of processes, each row printed as it comes;
    a job that raises gives error_row(job) with the error, and the screen goes on."""
    rows = []
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers) as pool:
        futures = {pool.submit(compile_one, *job): job for job in jobs}
        for future in concurrent.futures.as_completed(futures):
            try:
                row = future.result()
            except Exception as exc:  # report and go on: one bad candidate must not stop a screen
                row = error_row(futures[future]) | dict(error=repr(exc)[:300])
            rows.append(row)
            print(", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    return rows


def main(argv=None) -> int:
    parser = screen_parser(__doc__)
    parser.add_argument("--variants", default="plain,causal", help=f"of {','.join(VARIANTS)}")
    parser.add_argument("--kernels", default=",".join(KERNELS))
    parser.add_argument("--tiles", type=parse_tiles, action="append", default=[],
                        help="KERNEL=BMxBNwWsS, repeatable; default: the shipped tiles")  # fmt: skip
    parser.add_argument("--head-dim", type=int, default=D, help="D = Dv")
    args = parser.parse_args(argv)
    jobs = []
    for variant in args.variants.split(","):
        for kernel in args.kernels.split(","):
            mine = [t for k, t in args.tiles if k == kernel] or [None]
            jobs += [(args.tool, variant, kernel, t, args.head_dim) for t in mine]
    rows = run_screen(
        compile_one, jobs, args.jobs,
        lambda job: dict(variant=job[1], kernel=job[2], tiles=job[3].spec if job[3] else "shipped"),
    )  # fmt: skip
    if args.csv:
        write_csv(rows, args.csv)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
