"""The support matrix: which backend takes which feature, read off the backends' own refusal
rules, so the README's table cannot drift from the code.

Each feature is one small call of a public op. The call runs up to dispatch (validation,
autocast, the float-mask shift) and the inputs it would hand a backend are taken there; each
backend's refusal function then says whether it takes them. Reasons that depend on the machine
(device-level ones are never asked; an extension built before an op existed is left out) say
nothing about the feature, so the table is the same on every machine.

    python -m fusedattn.support                 # print the table and the refusals (markdown)
    python -m fusedattn.support --update README.md --refusals docs/backends.md
                                                # rewrite the README's table, the doc's list
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import distributed, ops
from .ops.core import backends, kernels

START = "<!-- support-matrix:start (python -m fusedattn.support --update README.md) -->"
END = "<!-- support-matrix:end -->"
REFUSALS_START = "<!-- refusals:start (python -m fusedattn.support --refusals docs/backends.md) -->"
REFUSALS_END = "<!-- refusals:end -->"
YES, NO, NONE = "✓", "✗", "—"


@dataclass(frozen=True)
class Feature:
    name: str
    call: Callable[[], tuple[Callable, tuple, dict]]  # -> (public op, args, kwargs)


def _qkv(dtype=torch.bfloat16, D=64, Hq=2, Hkv=2, T=8):
    return (
        torch.zeros(1, Hq, T, D, dtype=dtype),
        torch.zeros(1, Hkv, T, D, dtype=dtype),
        torch.zeros(1, Hkv, T, D, dtype=dtype),
    )


def _attention(*args_override, **kwargs):
    def call():
        qkv = args_override[0] if args_override else _qkv()
        return ops.attention, tuple(qkv), kwargs

    return call


def _descales(*names):
    """One descale (a single value) for each named fp8 tensor."""
    return {f"{name}_descale": torch.ones(()) for name in names}


def _packed(paged=False, fp8=False, **kwargs):
    def call():
        q, k, v = (torch.zeros(8, 2, 64, dtype=torch.bfloat16) for _ in range(3))
        cu = torch.tensor([0, 3, 8], dtype=torch.int32)
        if paged:  # two sequences' keys in pages of 4 slots
            dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
            k, v = (torch.zeros(6, 4, 2, 64, dtype=dtype) for _ in range(2))
            kwargs["block_table"] = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
            if fp8:
                kwargs.update(_descales("k", "v"))
        return ops.varlen_attention, (q, k, v, cu, cu, 5, 5), kwargs

    return call


def _norm_input(dtype=torch.bfloat16):
    return torch.zeros(4, 64, dtype=dtype)


def _norm(fn, dtype, *extra, **kwargs):
    def call():
        return fn, (_norm_input(dtype), *extra), kwargs

    return call


ATTENTION = [
    Feature("attention, fp16 / bf16", _attention()),
    Feature("attention, fp32", _attention(_qkv(torch.float32))),
    Feature("attention, fp64", _attention(_qkv(torch.float64))),
    Feature("head dim 256", _attention(_qkv(D=256))),
    Feature("head dim not a multiple of 8 (e.g. 20)", _attention(_qkv(D=20))),
    Feature("head dim above 256", _attention(_qkv(D=320))),
    Feature("bool attn_mask", _attention(attn_mask=torch.ones(8, 8, dtype=torch.bool))),
    Feature("float attn_mask (and its gradient)", _attention(attn_mask=torch.zeros(8, 8))),
    Feature("key_padding_mask", _attention(key_padding_mask=torch.zeros(1, 8, dtype=torch.bool))),
    Feature("is_causal (top-left)", _attention(is_causal=True)),
    Feature(
        "causal bottom-right (Tq ≠ Tk)",
        _attention(
            (torch.zeros(1, 2, 4, 64, dtype=torch.bfloat16), *_qkv()[1:]),
            is_causal=True,
            causal_alignment="bottom_right",
        ),
    ),
    Feature("grouped-query attention", _attention(_qkv(Hq=4, Hkv=2), enable_gqa=True)),
    Feature("sliding window_size", _attention(is_causal=True, window_size=(3, 0))),
    Feature("softcap", _attention(softcap=30.0)),
    Feature(
        "ALiBi, fp32 inputs",
        _attention(_qkv(torch.float32), alibi_slopes=torch.ones(2), is_causal=True),
    ),
    Feature("ALiBi, fp16 / bf16 inputs", _attention(alibi_slopes=torch.ones(2), is_causal=True)),
    Feature("sinks", _attention(sinks=torch.zeros(2, dtype=torch.bfloat16))),
    Feature("dropout", _attention(dropout_p=0.1)),
    Feature("return_lse", _attention(return_lse=True)),
    Feature("varlen_attention (packed)", _packed()),
    Feature(
        "varlen_attention + window, softcap, sinks",
        _packed(
            is_causal=True,
            window_size=(2, 0),
            softcap=5.0,
            sinks=torch.zeros(2, dtype=torch.bfloat16),
        ),
    ),
    Feature(
        "varlen_attention over a paged cache (block_table), causal",
        _packed(paged=True, is_causal=True, causal_alignment="bottom_right"),
    ),
    Feature("fp8 forward (e4m3 q, k, v with descales; inference)", _attention(
        _qkv(torch.float8_e4m3fn), is_causal=True, **_descales("q", "k", "v"))),
    Feature("paged prefill over an fp8 cache", _packed(
        paged=True, fp8=True, is_causal=True, causal_alignment="bottom_right")),
]  # fmt: skip


def _decode(dtype=torch.bfloat16, paged=False, D=64, cache_dtype=None, **kwargs):
    def call():
        q = torch.zeros(2, 1, 4, D, dtype=dtype)
        shape = (5, 16, 2, D) if paged else (2, 32, 2, D)
        cache = torch.zeros(shape, dtype=cache_dtype or dtype)
        table = dict(block_table=torch.zeros(2, 2, dtype=torch.int32)) if paged else {}
        kw = dict(cache_seqlens=20, **table, **kwargs)
        return ops.attention_with_kvcache, (q, cache, cache), kw

    return call


DECODE = [
    Feature("attention_with_kvcache, contiguous cache", _decode()),
    Feature("attention_with_kvcache, paged cache", _decode(paged=True)),
    Feature("decode, fp32", _decode(torch.float32)),
    Feature("decode, fp64", _decode(torch.float64)),
    Feature("decode, head dim above 256", _decode(D=320)),
    Feature(
        "decode + window, sinks",
        _decode(is_causal=True, window_size=(8, 0), sinks=torch.zeros(4, dtype=torch.bfloat16)),
    ),
    Feature(
        "decode + sinks in another dtype than q (fp32 with bf16)", _decode(sinks=torch.zeros(4))
    ),
    Feature(
        "decode + ALiBi, fp32", _decode(torch.float32, alibi_slopes=torch.ones(4), is_causal=True)
    ),
    Feature("decode + ALiBi, fp16 / bf16", _decode(alibi_slopes=torch.ones(4), is_causal=True)),
    Feature("decode + softcap", _decode(softcap=30.0)),
    Feature("decode + return_lse", _decode(return_lse=True)),
    Feature("decode over an fp8 cache (e4m3 / e5m2), bf16 q", _decode(
        cache_dtype=torch.float8_e4m3fn, **_descales("k", "v"))),
    Feature("decode over a paged fp8 cache, fp8 q", _decode(
        torch.float8_e4m3fn, paged=True, **_descales("q", "k", "v"))),
]  # fmt: skip
NORMS = [
    Feature("layer_norm, fp16 / bf16 / fp32", _norm(ops.layer_norm, torch.bfloat16, 64)),
    Feature("layer_norm, fp64", _norm(ops.layer_norm, torch.float64, 64)),
    Feature("rms_norm, fp16 / bf16 / fp32", _norm(ops.rms_norm, torch.bfloat16, 64)),
    Feature(
        "softmax, masked / causal",
        _norm(
            ops.softmax, torch.bfloat16, mask=torch.ones(4, 64, dtype=torch.bool), is_causal=True
        ),
    ),
    Feature(
        "softmax, float mask with a gradient",
        _norm(ops.softmax, torch.bfloat16, mask=torch.zeros(4, 64).requires_grad_()),
    ),
]
FEATURES = ATTENTION + DECODE + NORMS


class _Dispatched(Exception):
    def __init__(self, op: str, inputs: dict):
        super().__init__(op)
        self.op, self.inputs = op, inputs


def dispatch_inputs(fn: Callable, *args, **kwargs) -> tuple[str, dict]:
    """(op, inputs) that `fn(*args, **kwargs)` hands its backend, without running one."""

    def stop(op, _backend, _device, inputs):
        raise _Dispatched(op, inputs)

    original = backends.select
    backends.select = stop
    try:
        fn(*args, **kwargs)
    except _Dispatched as dispatched:
        return dispatched.op, dispatched.inputs
    finally:
        backends.select = original
    raise RuntimeError(f"{fn.__name__} returned without dispatching")


def _impl_refusals(op: str, backend: str, inputs: dict) -> list[str] | None:
    impl = backends._REGISTRY[op].get(backend)
    return None if impl is None else impl.refusals(**inputs)


def _environment_reasons() -> set[str]:
    """Refusals that depend on this machine, not on the call: an extension built before an op
    existed (that it is not built at all is a device-level reason, never asked here)."""
    return {
        r
        for op in backends.OPS
        if "cuda" in backends._REGISTRY[op]  # linear has no CUDA C++ kernel to be built with
        for r in kernels.extension_op_refusals(op)
    }


def feature_refusals(feature: Feature) -> dict[str, list[str] | None]:
    """{backend: reasons it refuses the feature ([] = takes it; None = no implementation)}."""
    fn, args, kwargs = feature.call()
    op, inputs = dispatch_inputs(fn, *args, **kwargs)
    environment = _environment_reasons()
    result = {}
    for backend in backends.BACKENDS:
        reasons = _impl_refusals(op, backend, inputs)
        result[backend] = None if reasons is None else [r for r in reasons if r not in environment]
    return result


def _rows() -> tuple[list[str], list[str]]:
    """(the table's rows, every refusal as "- backend, feature: reason")."""
    header = "| feature | " + " | ".join(backends.BACKENDS) + " |"
    lines = [header, "|---" * (len(backends.BACKENDS) + 1) + "|"]
    notes = []
    for feature in FEATURES:
        cells = []
        for backend, reasons in feature_refusals(feature).items():
            if reasons is None:
                cells.append(NONE)
            elif reasons:
                cells.append(NO)
                notes.extend(f"- {backend}, {feature.name}: {r}" for r in reasons)
            else:
                cells.append(YES)
        lines.append(f"| {feature.name} | " + " | ".join(cells) + " |")
    lines.append(_context_parallel_row())
    return lines, notes


def markdown() -> str:
    """The table (features x backends) and its legend: the README's block."""
    lines, _ = _rows()
    legend = (
        f"{YES} runs, {NO} refused with a clear error (`auto` picks another backend), "
        f"{NONE} no implementation. Every refusal as the code words it: "
        "[docs/backends.md](docs/backends.md#refusals-as-the-code-words-them)."
    )
    return "\n".join([*lines, "", legend])


def refusals_markdown() -> str:
    """Every ✗ of the table with its reason, as the code words it: docs/backends.md's block."""
    return "\n".join(_rows()[1])


def _context_parallel_row() -> str:
    """fusedattn.distributed runs its blocks through the backends it names (its BACKENDS), with
    every option of attention but dropout; the others have no context-parallel path."""
    cells = [YES if b in distributed.BACKENDS else NONE for b in backends.BACKENDS]
    return "| context_parallel_attention (no dropout) | " + " | ".join(cells) + " |"


def update_block(path: str, start: str, end: str, text: str) -> bool:
    """Put `text` between the marker lines `start` and `end` of the file at `path` (a README's
    generated block); True if the file changed. ValueError when the markers are missing."""
    with open(path, encoding="utf-8") as f:
        old = f.read()
    head, sep, rest = old.partition(start)
    _, sep2, tail = rest.partition(end)
    if not sep or not sep2:
        raise ValueError(f"{path} has no generated block ({start} ... {end})")
    new = f"{head}{start}\n{text}\n{end}{tail}"
    if new != old:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return new != old


def update(path: str) -> bool:
    """Rewrite the support matrix between START and END in `path`; True if it changed."""
    return update_block(path, START, END, markdown())


def update_refusals(path: str) -> bool:
    """Rewrite the refusals between REFUSALS_START and REFUSALS_END in `path`."""
    return update_block(path, REFUSALS_START, REFUSALS_END, refusals_markdown())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", metavar="README", help="rewrite this file's table")
    parser.add_argument("--refusals", metavar="DOC", help="rewrite this file's refusals")
    args = parser.parse_args(argv)
    for path, fn in ((args.update, update), (args.refusals, update_refusals)):
        if path:
            print(f"{path}: {'updated' if fn(path) else 'already current'}")
    if not (args.update or args.refusals):
        print(markdown() + "\n\nRefusals, as the code words them:\n\n" + refusals_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
