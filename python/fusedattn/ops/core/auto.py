"""`auto`'s per-call choice: the backend measured fastest for calls like this one.

A committed table (auto_table.py, built by scripts/build_auto_table.py from the benchmark
CSVs under benchmarks/results/<card>/) maps (GPU capability, op, mode, bucket) to backends
ordered fastest first, where the bucket is a few coarse facts of the call: dtype, head-dim
and key-length buckets, causal and the mask kind for attention; dtype and row-length bucket
for the norms and softmax. Mode is "fwd+bwd" when the call will be differentiated, else
"fwd". Calls on cards or in buckets never measured keep the default order.

Everything here reads shapes and flags only (no tensor data, no device sync), so it is cheap
and torch.compile traces it without graph breaks.
"""

from __future__ import annotations

import math

import torch

from . import auto_table

TABLE: dict = auto_table.TABLE
TABLE_SOURCE: str = getattr(auto_table, "SOURCE", "")

MODES = ("fwd", "fwd+bwd")  # inference calls, and calls whose backward will run

# The names of a table key's fields, per op (`python -m fusedattn.info --auto-table` heads its
# columns with them): the mode, then the buckets below.
_ATTENTION_KEY = ("mode", "dtype", "head dim <=", "causal", "mask", "keys")
_DECODE_KEY = ("mode", "dtype", "head dim <=", "cache", "new queries", "batch", "cache keys",
               "kind")  # fmt: skip
KEY_COLUMNS = {
    "attention": _ATTENTION_KEY,
    "varlen_attention": _ATTENTION_KEY,
    "layer_norm": ("mode", "dtype", "row length"),
    "rms_norm": ("mode", "dtype", "row length"),
    "softmax": ("mode", "dtype", "mask", "row length"),
    "attention_with_kvcache": _DECODE_KEY,
}


def head_dim_bucket(D: int) -> int:
    return 64 if D <= 64 else 128 if D <= 128 else 256


def length_bucket(T: int) -> str:
    """Keys per call: a bucket at each length the attention benchmark measures (256, 512, 1k,
    2k, 4k), so no bucket is decided by rows of another length (the <=1k bucket once held
    T = 256 calls decided at T = 1024)."""
    for limit, name in ((256, "<=256"), (512, "<=512"), (1024, "<=1k"), (2048, "<=2k"),
                        (4096, "<=4k")):  # fmt: skip
        if limit >= T:
            return name
    return ">4k"


def row_bucket(N: int) -> str:
    return "<=1k" if N <= 1024 else "<=4k" if N <= 4096 else "<=8k" if N <= 8192 else ">8k"


def batch_bucket(B: int) -> str:
    return "1" if B == 1 else "<=8" if B <= 8 else ">8"


def cache_bucket(S: int) -> str:
    """Decoding is bandwidth-bound and batch 1 must fill the GPU from the keys alone, so the
    order can change with the cache length: buckets at the measured 1k, 8k, 32k (and 128k)."""
    return "<=1k" if S <= 1024 else "<=8k" if S <= 8192 else "<=32k" if S <= 32768 else ">32k"


def attention_key_of(dtype: str, D: int, causal: bool, mask: str, Tk: int) -> tuple:
    return (dtype, head_dim_bucket(D), causal, mask, length_bucket(Tk))


def decode_key_of(dtype: str, D: int, paged: bool, Tq: int, B: int, S: int, kind: str) -> tuple:
    """A decode call (attention_with_kvcache): S is the cache's capacity per sequence (its
    lengths live on the device; reading them would sync), kind "plain" or "variant"."""
    layout = "paged" if paged else "contiguous"
    return (dtype, head_dim_bucket(D), layout, "1" if Tq == 1 else ">1", batch_bucket(B),
            cache_bucket(S), kind)  # fmt: skip


def rowwise_key_of(dtype: str, N: int, mask: str | None = None) -> tuple:
    """mask: softmax only (none / bool / other): a masked torch softmax is a masked_fill and
    a softmax, so its measured order differs from the unmasked call's (H100: the Triton
    fwd+bwd wins by 2x masked and loses by 1.2x unmasked at N = 32768)."""
    return (dtype, row_bucket(N)) if mask is None else (dtype, mask, row_bucket(N))


def _softmax_mask_kind(inputs: dict) -> str:
    """none / bool as the benchmarks measure them; "other" (float masks, is_causal) keeps the
    default order."""
    mask = inputs.get("mask")
    if inputs.get("is_causal"):
        return "other"
    if mask is None:
        return "none"
    return "bool" if mask.dtype == torch.bool else "other"


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _mask_kind(inputs: dict) -> str:
    """none / key_padding / bool / float / window / varlen, or "variant" / "paged" for what the
    benchmarks do not cover (softcap, ALiBi, sinks; a paged prefill): those keep the default
    order."""
    if inputs.get("softcap") or inputs.get("alibi_slopes") is not None:
        return "variant"
    if inputs.get("sinks") is not None:
        return "variant"
    if inputs.get("block_table") is not None:  # paged prefill: not benchmarked yet
        return "paged"
    if "cu_seqlens_q" in inputs:
        return "varlen"
    mask = inputs.get("attn_mask")
    if mask is not None:
        return "bool" if mask.dtype == torch.bool else "float"
    if inputs.get("key_padding_mask") is not None:
        return "key_padding"
    window = inputs["window"]
    if window.left >= 0 or (window.right > 0) or window.bottom_right:
        return "window"
    return "none"


def _decode_key(inputs: dict) -> tuple:
    """Plain decoding (bottom-right causal, padding, left padding included) is what the decode
    benchmark measures; softcap, ALiBi, sinks and a left window are "variant" (default order)."""
    q, table, window = inputs["q"], inputs["block_table"], inputs["window"]
    B, Tq, D = q.shape[0], q.shape[1], q.shape[-1]
    S = inputs["k_cache"].shape[1] * (1 if table is None else table.shape[1])
    variant = inputs.get("softcap") or inputs.get("alibi_slopes") is not None
    variant = variant or inputs.get("sinks") is not None or window.left >= 0
    kind = "variant" if variant else "plain"
    return ("fwd", *decode_key_of(_dtype_name(q), D, table is not None, Tq, B, S, kind))


def call_key(op: str, inputs: dict) -> tuple:
    """(mode, *bucket) of one call."""
    if op == "attention_with_kvcache":  # inference only: always "fwd"
        return _decode_key(inputs)
    tensors = [t for t in inputs.values() if isinstance(t, torch.Tensor)]
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    mode = MODES[grad]
    if op in ("attention", "varlen_attention"):
        q, k, window = inputs["q"], inputs["k"], inputs["window"]
        Tk = inputs["max_seqlen_k"] if op == "varlen_attention" else k.shape[-2]
        causal = window.right == 0
        return (
            mode,
            *attention_key_of(_dtype_name(q), q.shape[-1], causal, _mask_kind(inputs), Tk),
        )
    x = inputs["x"]
    if op == "softmax":
        N = x.shape[inputs["dim"]]
        return (mode, *rowwise_key_of(_dtype_name(x), N, _softmax_mask_kind(inputs)))
    return (mode, *rowwise_key_of(_dtype_name(x), math.prod(inputs["normalized_shape"])))


def capability(index: int) -> str:
    """'sm_90' for CUDA device `index` ('' without CUDA). torch.cuda.is_available and
    get_device_properties are constants to torch.compile (get_device_capability is not)."""
    if not torch.cuda.is_available():
        return ""
    props = torch.cuda.get_device_properties(index)
    return f"sm_{props.major}{props.minor}"


def measured_order(op: str, device: torch.device, inputs: dict, table=None) -> tuple[str, ...]:
    """Backends measured fastest first for this call on this card; () when never measured."""
    if device.type != "cuda":
        return ()
    table = TABLE if table is None else table
    per_op = table.get(capability(device.index or 0), {}).get(op)
    if not per_op:
        return ()
    return per_op.get(call_key(op, inputs), ())
