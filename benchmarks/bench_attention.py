"""Attention: fusedattn backends vs the naive O(T²) path vs F.scaled_dot_product_attention.

    python benchmarks/bench_attention.py [--quick] [--out DIR]

Every impl gets the same mask (SDPA through one merged mask, as a user would pass it;
`fusedattn-torch`, fusedattn's torch backend, through its own path: the torch entry of auto's
table). The
`pass` column checks each impl's forward against float64 with the k× rule on a slice of the
case (one batch, two heads), so the check stays cheap at large T.

Three variant rows (mask column):
- `window`: causal sliding window (Mistral-style, W keys); fusedattn takes `window_size` and
  skips the tiles outside it, `fusedattn-<b>+dense` is the same attention given the window as
  a dense bool mask (what a user without window support passes), SDPA gets that dense mask,
  FlexAttention a block mask. TFLOP/s count the window's FLOPs (visible pairs), not T².
- `varlen`: a packed batch of sequences with lengths uniform in [T/2, T];
  `fusedattn.varlen_attention` on the packed tokens against SDPA and the naive path on the
  padded batch with key padding. TFLOP/s count the useful FLOPs (sum of L² per sequence).
- `softcap` (full GPU runs and the CPU smoke run): causal attention with Gemma 2's logit
  softcap of 50 (s = 50·tanh(s / 50)); SDPA cannot apply it, so fusedattn runs against the
  naive path (and FlexAttention's score_mod in full runs). Compare with the plain causal row
  of the same shape for what the softcap costs.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import harness
import torch
import torch.nn.functional as F

import fusedattn
from fusedattn import masks, reference

MASKS = ("none", "key_padding", "dense")
VARIANT_MASKS = ("window", "varlen")
SOFTCAP = 50.0  # Gemma 2's attention logit softcap


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
        return [Case(1, 2, T, D, c, m, torch.float32) for T, D, c, m in grid] + [
            Case(1, 2, 256, 64, True, "window", torch.float32),
            Case(3, 2, 128, 64, False, "varlen", torch.float32),
            Case(1, 2, 128, 64, True, "softcap", torch.float32),
        ]
    # GPU: H = 16 and B·T = 16k tokens, the ENVIRONMENT.md comparison point.
    # quick: every length bucket of auto's table (256, 512, 1k, 2k, 4k; issue #70)
    lengths = [256, 512, 1024, 2048, 4096] if quick else [256, 512, 1024, 2048, 4096, 8192, 16384]
    mask_kinds = ["none", "key_padding"] if quick else list(MASKS)
    grid = itertools.product(lengths, [64, 128], [False, True], mask_kinds)
    variants = [
        Case(1, 16, 16384, 128, True, "window", torch.bfloat16),  # issue #16: W = 4096
        Case(8, 16, 4096, 128, False, "varlen", torch.bfloat16),
        Case(8, 16, 4096, 128, True, "varlen", torch.bfloat16),
    ]
    if not quick:  # gpu-check's quick pass has no time left for it: tune_triton_attention.py
        variants.append(Case(4, 16, 4096, 128, True, "softcap", torch.bfloat16))
    return [
        Case(max(1, 16384 // T), 16, T, D, c, m, torch.bfloat16) for T, D, c, m in grid
    ] + variants


def window_size(case: Case) -> int:
    """Keys a query of the window case sees (itself and W - 1 before it)."""
    return case.T // 4


def window_mask(case: Case, device) -> torch.Tensor:
    """The window as the dense (T, T) bool mask a user without window support passes."""
    return masks.window_mask(masks.Window(window_size(case) - 1, 0), case.T, case.T, device)


def make_inputs(case: Case, device):
    shape = (case.B, case.H, case.T, case.D)
    q, k, v = (torch.randn(shape, device=device, dtype=case.dtype) for _ in range(3))
    attn_mask = key_padding_mask = None
    if case.mask == "key_padding":
        lengths = torch.randint(case.T // 2, case.T + 1, (case.B,), device=device)
        key_padding_mask = masks.padding_mask_from_lengths(lengths, case.T)
    elif case.mask == "dense":
        attn_mask = torch.rand(case.B, 1, case.T, case.T, device=device) > 0.1
    elif case.mask == "window":
        attn_mask = window_mask(case, device)
    elif case.mask == "varlen":
        lengths = torch.randint(case.T // 2, case.T + 1, (case.B,), device=device)
        key_padding_mask = masks.padding_mask_from_lengths(lengths, case.T)
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
                    keep = keep & (m[qi, ki] if m.dim() == 2 else m[b, 0, qi, ki])
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
    # fusedattn-torch: the torch backend as a call reaches it (its own mask merge, SDPA's own
    # choice of kernel), what `auto` runs when it picks torch: the table's torch entry
    for backend in ("torch", *harness.kernel_backends("attention", device)):
        impls[f"fusedattn-{backend}"] = lambda q, k, v, m, kpm, c, b=backend: fusedattn.attention(
            q, k, v, m, is_causal=c, key_padding_mask=kpm, backend=b
        )
    return impls


def check_on_slice(fn, inputs, causal, softcap=0.0):
    """k× verdict for fn on batch 0, heads 0-1 of the case, against float64."""
    q, k, v, m, kpm = inputs
    sl = (slice(0, 1), slice(0, 2))
    qs, ks, vs = (t[sl].detach() for t in (q, k, v))
    ms = None if m is None else (m[:1] if m.dim() == 4 else m)
    kpms = None if kpm is None else kpm[:1]
    with torch.no_grad():
        out = fn(qs, ks, vs, ms, kpms, causal)
        kw = dict(is_causal=causal, key_padding_mask=kpms, softcap=softcap)
        ref = reference.attention(qs.double(), ks.double(), vs.double(), ms, **kw)
        base = reference.attention(qs, ks, vs, ms, **kw)
    return harness.correctness(out, ref, base)


def window_impls(case: Case, base: dict) -> dict:
    """The window case: the dense-mask impls as they are, each fusedattn backend twice (its
    window_size, and the same attention through the dense mask)."""
    impls = {n: fn for n, fn in base.items() if not n.startswith("fusedattn-")}
    window = (window_size(case) - 1, 0)
    for name in (n for n in base if n.startswith("fusedattn-")):
        b = name.split("-", 1)[1]
        impls[name] = lambda q, k, v, m, kpm, c, b=b: fusedattn.attention(
            q, k, v, is_causal=True, window_size=window, backend=b
        )
        impls[name + "+dense"] = lambda q, k, v, m, kpm, c, b=b: fusedattn.attention(
            q, k, v, m, backend=b
        )
    return impls


def softcap_impls(base: dict) -> dict:
    """The softcap case: the naive path and each fusedattn backend with softcap=SOFTCAP (SDPA
    and fusedattn's torch backend refuse it; the CUDA backend refuses it too, and says so)."""
    impls = {
        "naive": lambda q, k, v, m, kpm, c: reference.attention(
            q, k, v, m, is_causal=c, key_padding_mask=kpm, softcap=SOFTCAP
        )
    }
    if "flex" in base:  # softcap as a score_mod, causal (the case always is) as a block mask
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention, dynamic=False)
        block_masks = {}

        def softcap_mod(score, b, h, qi, ki):
            return SOFTCAP * torch.tanh(score / SOFTCAP)

        def flex(q, k, v, m, kpm, c):
            key = (q.shape[2], k.shape[2], q.device)
            if key not in block_masks:
                block_masks[key] = create_block_mask(
                    lambda b, h, qi, ki: ki <= qi, None, None, *key[:2], device=q.device
                )
            return compiled(q, k, v, score_mod=softcap_mod, block_mask=block_masks[key])

        impls["flex"] = flex
    for name in (n for n in base if n.startswith("fusedattn-") and n != "fusedattn-torch"):
        b = name.split("-", 1)[1]
        impls[name] = lambda q, k, v, m, kpm, c, b=b: fusedattn.attention(
            q, k, v, m, is_causal=c, key_padding_mask=kpm, softcap=SOFTCAP, backend=b
        )
    return impls


class Packed:
    """A padded batch's valid tokens packed back to back, as a packing dataloader gives them:
    the leaves of the varlen rows (packing is not timed)."""

    def __init__(self, q, k, v, kpm):
        keep = ~kpm
        lengths = keep.sum(-1).int()
        self.cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        self.longest = int(lengths.max())
        self.q, self.k, self.v = (t.transpose(1, 2)[keep].contiguous() for t in (q, k, v))

    def impls(self, device, causal) -> dict:
        """{fusedattn-<b>: fn(q, k, v) on the packed tokens}."""
        return {
            f"fusedattn-{b}": lambda q, k, v, b=b: fusedattn.varlen_attention(
                q,
                k,
                v,
                self.cu,
                self.cu,
                self.longest,
                self.longest,
                is_causal=causal,
                backend=b,
            )
            for b in ("torch", *harness.kernel_backends("varlen_attention", device))
        }

    def check(self, impl, causal, heads=2):
        """k× verdict of `fusedattn-<backend>` on the first sequence's first heads, against
        float64 (its own cu_seqlens: the packed impls close over the whole batch's)."""
        n = int(self.cu[1])
        cu = self.cu[:2].clone()
        qs, ks, vs = (t[:n, :heads].detach() for t in (self.q, self.k, self.v))
        args = (cu, cu, n, n)
        with torch.no_grad():
            out = fusedattn.varlen_attention(qs, ks, vs, *args, is_causal=causal,
                                             backend=impl.split("-", 1)[1])  # fmt: skip
            ref = reference.varlen_attention(qs.double(), ks.double(), vs.double(), *args,
                                             is_causal=causal)  # fmt: skip
            base = reference.varlen_attention(qs, ks, vs, *args, is_causal=causal)
        return harness.correctness(out, ref, base)


def variant_flops(case: Case, inputs, mode: str) -> float:
    """Useful FLOPs of the variant cases: the window's visible pairs, or sum of L^2."""
    per_pair = harness.attention_flops(1, case.H, 1, 1, case.D, mode=mode)
    if case.mask == "window":
        pairs = int(window_mask(case, "cpu").sum())
        return case.B * per_pair * pairs
    lengths = (~inputs[4]).sum(-1).double()
    pairs = (lengths * (lengths + 1) / 2 if case.causal else lengths**2).sum().item()
    return per_pair * pairs


def case_fields(case: Case) -> dict:
    """The case's shape columns of the CSV."""
    return dict(dtype=str(case.dtype)[6:], B=case.B, H=case.H, Tq=case.T, Tk=case.T, D=case.D,
                causal=case.causal, mask=case.mask)  # fmt: skip


def measurements(case: Case, base_impls: dict, inputs) -> list[tuple[dict, list, Callable]]:
    """What one case times: (impls {name: fn(*leaves)}, leaves, check(name) -> verdict) for the
    padded tensors and, for a varlen case, fusedattn's impls on the packed tokens."""
    impls = base_impls
    if case.mask == "window":
        impls = window_impls(case, base_impls)
    elif case.mask == "softcap":
        impls = softcap_impls(base_impls)
    elif case.mask == "varlen":  # fusedattn runs the packed tokens (below)
        impls = {n: fn for n, fn in base_impls.items() if not n.startswith("fusedattn-")}
    q, k, v, m, kpm = inputs
    sc = SOFTCAP if case.mask == "softcap" else 0.0
    out = [(
        {name: (lambda q, k, v, fn=fn: fn(q, k, v, m, kpm, case.causal))
         for name, fn in impls.items()},
        [q, k, v],
        lambda name: check_on_slice(impls[name], inputs, case.causal, sc),
    )]  # fmt: skip
    if case.mask == "varlen":
        packed = Packed(q, k, v, kpm)
        out.append((packed.impls(q.device, case.causal), [packed.q, packed.k, packed.v],
                    lambda name: packed.check(name, case.causal)))  # fmt: skip
    return out


def run(quick: bool, device: torch.device, env: dict) -> list[dict]:
    base_impls = implementations(device, quick)
    rows = []
    for case in cases(quick, device):
        inputs = make_inputs(case, device)

        def work(mode, case=case, inputs=inputs):
            if case.mask in VARIANT_MASKS:
                return variant_flops(case, inputs, mode), None
            flops = harness.attention_flops(
                case.B, case.H, case.T, case.T, case.D, causal=case.causal, mode=mode
            )
            return flops, None

        for impls, leaves, check in measurements(case, base_impls, inputs):
            rows += harness.measure(env, device, op="attention", impls=impls, leaves=leaves,
                                    check=check, fields=case_fields(case), work=work)  # fmt: skip
    harness.add_speedups(rows)
    return rows


def warm(index: int, quick: bool, device: torch.device) -> list[str]:
    """Compile what case `index` of `cases(quick, device)` runs of fusedattn's Triton kernels
    (its check, forward and forward+backward, once each) into Triton's on-disk cache, without
    timing: `harness.warm_in_parallel` runs this for every case at once in child processes, so
    the timing run loads its kernels instead of compiling them one after another (the quick
    GPU grid has some 30-50 kernel specialisations; compiling the forward, dQ and dK/dV
    kernels of one D=128 case for sm_90 took 15 s on the 2-core CPU machine, process start
    included, 2026-11-27). Returns what failed."""
    case = cases(quick, device)[index]
    inputs = make_inputs(case, device)
    base = {n: fn for n, fn in implementations(device, quick).items() if n == "fusedattn-triton"}
    failed = []
    for impls, leaves, check in measurements(case, base, inputs):
        failed += harness.run_once(
            {n: fn for n, fn in impls.items() if n.startswith("fusedattn-triton")}, leaves, check
        )
    return [f"{case}: {f}" for f in failed]


if __name__ == "__main__":
    harness.cli(run, "attention.csv")
