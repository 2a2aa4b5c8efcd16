"""The triton backend of `fusedattn.attention_with_kvcache`: the split-key decode kernel
(triton_kernels/decode.py) reading the cache in place, launched by shared/decode_launch.py."""

from __future__ import annotations

from ...fp8 import is_fp8
from ..core.kernels import KERNEL_DTYPES, MAX_HEAD_DIM, dense
from ..shared.decode_launch import TritonDecode


def refusals(*, q, k_cache, v_cache, alibi_slopes=None, **_inputs) -> list[str]:
    reasons = []
    if q.dtype not in KERNEL_DTYPES and not (is_fp8(q) and is_fp8(k_cache)):
        reasons.append(
            f"the Triton decode kernel takes float16, bfloat16 and float32, got {q.dtype}"
        )
    D, Dv = q.shape[-1], v_cache.shape[-1]
    if max(D, Dv) > MAX_HEAD_DIM:
        reasons.append(f"head dims up to {MAX_HEAD_DIM}, got D={D}, Dv={Dv}")
    return reasons


def attention(q, k_cache, v_cache, seqlens_k, block_table, cache_leftpad, key_mask, scale,
              window, softcap, alibi_slopes, sinks, num_splits, return_lse, q_descale=None,
              k_descale=None, v_descale=None):  # fmt: skip
    if q.stride(-1) != 1:
        q = q.contiguous()
    # one-dimensional per-sequence values and the parameters are read at b / h: dense
    seqlens_k, cache_leftpad, block_table, alibi_slopes, sinks = map(
        dense, (seqlens_k, cache_leftpad, block_table, alibi_slopes, sinks)
    )
    descales = (q_descale, k_descale, v_descale)
    launch = TritonDecode(q, k_cache, v_cache, block_table, cache_leftpad, key_mask, None,
                          q.shape[0], q.shape[1], scale, window, softcap, alibi_slopes, sinks,
                          num_splits, descales=descales)  # fmt: skip
    out, lse = launch.outputs(q)
    launch(q, k_cache, v_cache, out, lse, seqlens_k, cache_leftpad, block_table, alibi_slopes,
           sinks, key_mask, None, descales)  # fmt: skip
    return (out, lse) if return_lse else out
