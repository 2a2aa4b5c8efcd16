"""Attention: fusedattn backends vs the naive O(T²) path vs F.scaled_dot_product_attention.

    python benchmarks/bench_attention.py [--quick] [--out DIR]

Every impl gets the same mask (SDPA through one merged mask, as a user would pass it). The
`pass` column checks each impl's forward against float64 with the k× rule on a slice of the
case (one batch, two heads), so the check stays cheap at large T.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import harness
import torch
import torch.nn.functional as F

import fusedattn
from fusedattn import masks, reference

MASKS = ("none", "key_padding", "dense")


@dataclass(frozen=True)
class Case:
    B: int
    H: int
    T: int
    D: int
    causal: bool
    mask: str
    dtype: torch.dtype


def cases(quick: bool, device: torch.device) -> list[Case]:
    if device.type != "cuda":
        # CPU: small shapes that show the harness works; speed there is not the product.
        grid = itertools.product([128, 256], [64], [False, True], ["none", "key_padding"])
        return [Case(1, 2, T, D, c, m, torch.float32) for T, D, c, m in grid]
    # GPU: H = 16 and B·T = 16k tokens, the ENVIRONMENT.md comparison point.
    lengths = [1024, 4096] if quick else [512, 1024, 2048, 4096, 8192, 16384]
    mask_kinds = ["none", "key_padding"] if quick else list(MASKS)
    grid = itertools.product(lengths, [64, 128], [False, True], mask_kinds)
    return [Case(max(1, 16384 // T), 16, T, D, c, m, torch.bfloat16) for T, D, c, m in grid]


def make_inputs(case: Case, device):
    shape = (case.B, case.H, case.T, case.D)
    q, k, v = (torch.randn(shape, device=device, dtype=case.dtype) for _ in range(3))
    attn_mask = key_padding_mask = None
    if case.mask == "key_padding":
        lengths = torch.randint(case.T // 2, case.T + 1, (case.B,), device=device)
        key_padding_mask = masks.padding_mask_from_lengths(lengths, case.T)
    elif case.mask == "dense":
        attn_mask = torch.rand(case.B, 1, case.T, case.T, device=device) > 0.1
    return q, k, v, attn_mask, key_padding_mask


def sdpa_backends(device):
    """(impl name, context manager factory) for each SDPA backend to measure."""
    if device.type != "cuda":
        return [("sdpa", contextlib.nullcontext)]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    named = {
        "sdpa-flash": SDPBackend.FLASH_ATTENTION,
        "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
        "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
        "sdpa-math": SDPBackend.MATH,
    }
    return [(name, lambda b=b: sdpa_kernel(b)) for name, b in named.items()]


def flex_attention_impl():
    """FlexAttention (compiled) with the case's masks as a block mask built once per case;
    any failure to build or compile reads as the impl refusing the case."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    block_masks = {}

    def flex(q, k, v, m, kpm, c):
        key = (q.shape, k.shape, id(m), id(kpm), c)
        if key not in block_masks:

            def mask_mod(b, h, qi, ki):
                keep = ki >= 0
                if c:
                    keep = keep & (ki <= qi)
                if kpm is not None:
                    keep = keep & ~kpm[b, ki]
                if m is not None:
                    keep = keep & m[b, 0, qi, ki]
                return keep

            block_masks[key] = create_block_mask(
                mask_mod, q.shape[0], None, q.shape[2], k.shape[2], device=q.device
            )
        try:
            return compiled(q, k, v, block_mask=block_masks[key])
        except Exception as exc:  # a compile failure is a refusal, reported and skipped
            raise RuntimeError(f"flex_attention failed: {exc}") from exc

    return flex


def implementations(device, quick: bool = True) -> dict:
    """{impl name: fn(q, k, v, attn_mask, key_padding_mask, causal) -> out}."""
    impls = {
        "naive": lambda q, k, v, m, kpm, c: reference.attention(
            q, k, v, m, is_causal=c, key_padding_mask=kpm
        )
    }
    for name, ctx in sdpa_backends(device):

        def sdpa(q, k, v, m, kpm, c, ctx=ctx):
            merged = masks.merge_masks(
                m,
                kpm,
                c and (m is not None or kpm is not None),
                q.shape[-2],
                k.shape[-2],
                device=q.device,
            )
            causal_only = c and merged is None
            with ctx():
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=merged, is_causal=causal_only
                )

        impls[name] = sdpa
    if device.type == "cuda" and not quick:  # compiles per mask: full runs only
        impls["flex"] = flex_attention_impl()
    for backend in harness.kernel_backends("attention", device):
        impls[f"fusedattn-{backend}"] = lambda q, k, v, m, kpm, c, b=backend: fusedattn.attention(
            q, k, v, m, is_causal=c, key_padding_mask=kpm, backend=b
        )
    return impls


def check_on_slice(fn, inputs, causal):
    """k× verdict for fn on batch 0, heads 0-1 of the case, against float64."""
    q, k, v, m, kpm = inputs
    sl = (slice(0, 1), slice(0, 2))
    qs, ks, vs = (t[sl].detach() for t in (q, k, v))
    ms = None if m is None else m[:1]
    kpms = None if kpm is None else kpm[:1]
    with torch.no_grad():
        out = fn(qs, ks, vs, ms, kpms, causal)
        ref = reference.attention(
            qs.double(), ks.double(), vs.double(), ms, is_causal=causal, key_padding_mask=kpms
        )
        base = reference.attention(qs, ks, vs, ms, is_causal=causal, key_padding_mask=kpms)
    return harness.correctness(out, ref, base)


def run(quick: bool, device: torch.device, env: dict) -> list[dict]:
    impls = implementations(device, quick)
    rows = []
    for case in cases(quick, device):
        inputs = make_inputs(case, device)
        q, k, v, m, kpm = inputs
        fields = dict(
            dtype=str(case.dtype)[6:],
            B=case.B,
            H=case.H,
            Tq=case.T,
            Tk=case.T,
            D=case.D,
            causal=case.causal,
            mask=case.mask,
        )

        def work(mode, case=case):
            flops = harness.attention_flops(
                case.B, case.H, case.T, case.T, case.D, causal=case.causal, mode=mode
            )
            return flops, None

        rows += harness.measure(
            env, device, op="attention",
            impls={name: (lambda q, k, v, fn=fn, m=m, kpm=kpm, c=case.causal:
                          fn(q, k, v, m, kpm, c)) for name, fn in impls.items()},
            leaves=[q, k, v],
            check=lambda name, inputs=inputs, c=case.causal: check_on_slice(impls[name], inputs, c),
            fields=fields, work=work,
        )  # fmt: skip
    harness.add_speedups(rows)
    return rows


if __name__ == "__main__":
    harness.cli(run, "attention.csv")
