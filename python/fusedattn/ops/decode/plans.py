"""Plans for attention_with_kvcache's eager calls: what a call's metadata decides, decided once.

A decode loop repeats one call with new tensors of the same shapes, step after step, layer
after layer. Everything but the values is the same each time: the validation of the arguments,
the backend's refusals and auto's choice, the kernel's tiles, key splits, grid, scalar
arguments and compiled kernel. A plan holds those for one key: every tensor argument's shape,
strides, dtype, device, requires_grad and 16-byte alignment, every Python argument, grad mode,
the current CUDA device and the environment switches the call reads (FUSEDATTN_BACKEND under
`auto`, FUSEDATTN_CHECK_VALUES). A call whose key has a plan runs it: the value checks where
they apply (the CPU, the reference and torch backends), the outputs' allocation, and the
launches through the launchers bound at the plan's first call (core/triton_launch.prepare) — one
for the append, one for the decode, one for the combine of its key splits (FlashInfer's
plan/run split, on fusedattn's own key). A new key goes through the full validation once,
which raises the errors of a bad call as before and builds the plan. Tracing (torch.compile,
jit.trace) never uses plans: it records the custom ops (custom_ops.py).

Host time of a decode step with its append, Llama-3-8B heads, 1k cache, on the 2-core CPU
machine with the kernels compiled for sm_90 and the driver launch stubbed
(benchmarks/bench_host.py): see benchmarks/results/host-cpu/.
"""

from __future__ import annotations

import os

from ...checks import check_kvcache_values
from ..core.kernels import dense
from ..core.plans import Cache, meta, process_state
from ..shared import decode_launch
from ..shared.decode_launch import TritonAppend, TritonDecode, key_mask_bounds


def fp8_descales(descales) -> dict | None:
    """The descales of an fp8 call by name, for the value checks (None without fp8)."""
    if descales[1] is None:
        return None
    return dict(q_descale=descales[0], k_descale=descales[1], v_descale=descales[2])


PLANS = Cache("attention_with_kvcache")


def key(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, scale, is_causal,
        window_size, softcap, alibi_slopes, sinks, num_splits, return_lse, backend, q_descale=None,
        k_descale=None, v_descale=None):  # fmt: skip
    """The call's plan key, or None when an argument is not of a kind plans key (the full
    path then takes the call, and raises if it is bad)."""
    try:
        lengths = cache_seqlens if type(cache_seqlens) is int else meta(cache_seqlens)
        return (
            meta(q), meta(k_cache), meta(v_cache), meta(k), meta(v), lengths, meta(block_table),
            meta(cache_leftpad), meta(alibi_slopes), meta(sinks), scale, is_causal,
            None if window_size is None else tuple(window_size), softcap, num_splits,
            return_lse, backend, *process_state(q, backend),
            os.environ.get("FUSEDATTN_CHECK_VALUES"), meta(q_descale), meta(k_descale),
            meta(v_descale),
        )  # fmt: skip
    except (AttributeError, TypeError, RuntimeError):
        return None


class Plan:
    """One call's decisions: the backend's implementation, its keyword arguments but the
    tensors, whether to check values, the append. Runs a call of the same key."""

    def __init__(self, impl, window, scale, softcap, num_splits, return_lse, check_values,
                 seqlens, Tnew: int):  # fmt: skip
        self.impl = impl
        self.run = impl.run
        self.kwargs = dict(scale=scale, window=window, softcap=float(softcap),
                           num_splits=int(num_splits), return_lse=return_lse, key_mask=None)  # fmt: skip
        self.check_values = check_values
        self.seqlens = seqlens  # the tensor an int cache_seqlens became (read only), or None
        self.Tnew = Tnew
        self.append = decode_launch.append

    def lengths(self, cache_seqlens):
        return self.seqlens if self.seqlens is not None else cache_seqlens

    def __call__(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad,
                 alibi_slopes, sinks, descales):  # fmt: skip
        seqlens = self.lengths(cache_seqlens)
        q_descale, k_descale, v_descale = descales
        if self.check_values:
            check_kvcache_values(seqlens, cache_leftpad, block_table, k_cache, self.Tnew,
                                 descales=fp8_descales(descales))  # fmt: skip
        if k is not None:
            self.append(k_cache, v_cache, k, v, seqlens, block_table, k_descale, v_descale)
            seqlens = seqlens + self.Tnew
        return self.run(q=q, k_cache=k_cache, v_cache=v_cache, seqlens_k=seqlens,
                        block_table=block_table, cache_leftpad=cache_leftpad,
                        alibi_slopes=alibi_slopes, sinks=sinks, q_descale=q_descale,
                        k_descale=k_descale, v_descale=v_descale, **self.kwargs)  # fmt: skip


class TritonPlan(Plan):
    """The Triton backend's plan: the append and the decode launches built once (TritonAppend,
    TritonDecode), the new keys counted in the kernel (seqlen_add) rather than by adding to the
    lengths on the host; the dense copies the key's strides call for, made per call."""

    def __init__(self, impl, q, k_cache, v_cache, k, v, seqlens, block_table, cache_leftpad,
                 scale, window, softcap, alibi_slopes, sinks, num_splits, return_lse,
                 check_values, int_seqlens, descales):  # fmt: skip
        Tnew = 0 if k is None else k.shape[1]
        super().__init__(impl, window, scale, softcap, num_splits, return_lse, check_values,
                         int_seqlens, Tnew)  # fmt: skip
        self.dense = dense
        self.copy_q = q.stride(-1) != 1
        self.copy_k = k is not None and k.stride(-1) != 1
        self.copy_v = v is not None and v.stride(-1) != 1
        q = q.contiguous() if self.copy_q else q
        self.decode = TritonDecode(
            q, k_cache, v_cache, dense(block_table), dense(cache_leftpad), None, None,
            q.shape[0], q.shape[1], scale, window, softcap, dense(alibi_slopes), dense(sinks),
            num_splits, seqlen_add=Tnew, descales=descales,
        )  # fmt: skip
        self.triton_append = None
        if k is not None and decode_launch.append_uses_kernel(k_cache):  # else torch's writes
            kk, vv = (k.contiguous() if self.copy_k else k), (v.contiguous() if self.copy_v else v)
            self.triton_append = TritonAppend(k_cache, v_cache, kk, vv, dense(block_table),
                                              *descales[1:])  # fmt: skip

    def __call__(self, q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad,
                 alibi_slopes, sinks, descales):  # fmt: skip
        dense = self.dense
        seqlens = dense(self.lengths(cache_seqlens))
        block_table, cache_leftpad = dense(block_table), dense(cache_leftpad)
        if self.check_values:
            check_kvcache_values(seqlens, cache_leftpad, block_table, k_cache, self.Tnew,
                                 descales=fp8_descales(descales))  # fmt: skip
        if k is not None:
            k = k.contiguous() if self.copy_k else k
            v = v.contiguous() if self.copy_v else v
            if self.triton_append is not None:
                self.triton_append(k_cache, v_cache, k, v, seqlens, block_table, *descales[1:])
            else:
                self.append(k_cache, v_cache, k, v, seqlens, block_table, *descales[1:])
        q = q.contiguous() if self.copy_q else q
        out, lse = self.decode.outputs(q)
        self.decode(q, k_cache, v_cache, out, lse, seqlens, cache_leftpad, block_table,
                    dense(alibi_slopes), dense(sinks), None, None, descales)  # fmt: skip
        return (out, lse) if self.kwargs["return_lse"] else out


# ---- the Hugging Face decode step (decode_with_key_mask) --------------------------------------

MASKED = Cache("attention_with_kvcache")


def masked_key(q, k_cache, v_cache, key_mask, sinks, scale, is_causal, window_size, softcap,
               backend, k_descale=None, v_descale=None):  # fmt: skip
    """decode_with_key_mask's plan key, or None (the full path then takes the call)."""
    try:
        return (
            "masked", meta(q), meta(k_cache), meta(v_cache), meta(key_mask), meta(sinks), scale,
            is_causal, None if window_size is None else tuple(window_size), softcap, backend,
            *process_state(q, backend), meta(k_descale), meta(v_descale),
        )  # fmt: skip
    except (AttributeError, TypeError, RuntimeError):
        return None


class MaskedPlan:
    """A Hugging Face decode step's decisions for one key: the backend, its keyword arguments,
    and where the keys' bounds come from: the key mask (key_mask_bounds), or every slot (the
    lengths tensor of the first call, read only)."""

    def __init__(self, impl, window, scale, softcap, masked, seqlens):
        self.impl, self.run = impl, impl.run
        self.masked, self.seqlens = masked, seqlens
        self.kwargs = dict(block_table=None, scale=scale, window=window, softcap=float(softcap),
                           alibi_slopes=None, num_splits=0, return_lse=False)  # fmt: skip

    def __call__(self, q, k_cache, v_cache, key_mask, sinks, descales):
        if self.masked:
            return self.launch(q, k_cache, v_cache, key_mask, sinks, *key_mask_bounds(key_mask),
                               descales)  # fmt: skip
        return self.launch(q, k_cache, v_cache, key_mask, sinks, self.seqlens, None, descales)

    def launch(self, q, k_cache, v_cache, key_mask, sinks, seqlens, leftpad, descales):
        """The step for these lengths (the full path's first call has them already)."""
        rows = None if key_mask is None else key_mask.view(q.shape[0], k_cache.shape[1])
        _, k_descale, v_descale = descales
        return self.run(q=q, k_cache=k_cache, v_cache=v_cache, seqlens_k=seqlens,
                        cache_leftpad=leftpad, key_mask=rows, sinks=sinks, q_descale=None,
                        k_descale=k_descale, v_descale=v_descale, **self.kwargs)  # fmt: skip


class TritonMaskedPlan(MaskedPlan):
    """The Triton backend's: the decode launches built once (TritonDecode, as TritonPlan), the
    keys' bounds of a padding mask found by the kernel itself (mask_bounds): a padded step
    launches and allocates what an unpadded one does (benchmarks/bench_host.py's hf rows)."""

    def __init__(self, impl, q, k_cache, v_cache, key_mask, sinks, window, scale, softcap,
                 masked, seqlens, descales):  # fmt: skip
        super().__init__(impl, window, scale, softcap, masked, seqlens)
        self.copy_q = q.stride(-1) != 1
        q = q.contiguous() if self.copy_q else q
        self.decode = TritonDecode(q, k_cache, v_cache, None, None, key_mask, None, q.shape[0],
                                   q.shape[1], scale, window, softcap, None, dense(sinks), 0,
                                   mask_bounds=masked, descales=descales)  # fmt: skip

    def __call__(self, q, k_cache, v_cache, key_mask, sinks, descales):
        return self.launch(q, k_cache, v_cache, key_mask, sinks, self.seqlens, None, descales)

    def launch(self, q, k_cache, v_cache, key_mask, sinks, seqlens, leftpad, descales):
        q = q.contiguous() if self.copy_q else q
        out, lse = self.decode.outputs(q)
        self.decode(q, k_cache, v_cache, out, lse, seqlens if not self.masked else None, None,
                    None, None, dense(sinks), key_mask, None, descales)  # fmt: skip
        return out
