"""Plans of `fusedattn.attention`'s eager calls (core/plans.py says what a plan is): the
backend, its keyword arguments, the float-mask shift, and for the Triton kernels a launch
template whose launchers are bound at their first call. A block-mask or score_mod call on the
Triton kernels has its own (FlexPlan): its key adds the mask's and the mod's metadata, and
each call binds its own lists and captures."""

from __future__ import annotations

import torch

from ...block_mask import as_block_mask
from ...masks import shift_float_mask, visible_keys
from ...score_mod import prepare as prepare_score_mod
from ..core.plans import Cache, meta, process_state
from . import custom_ops, flex, triton_backend

PLANS = Cache("attention")


def key(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask,
              window_size, softcap, alibi_slopes, sinks, causal_alignment, return_lse,
              backend):  # fmt: skip
    """fusedattn.attention's plan key (core/plans.py), or None for a call plans do not cover:
    under autocast, or with an argument of a kind they do not key (the full path takes it)."""
    try:
        if torch.is_autocast_enabled(q.device.type):
            return None
        return (
            meta(q), meta(k), meta(v), meta(attn_mask),
            meta(key_padding_mask), meta(alibi_slopes), meta(sinks),
            dropout_p, is_causal, scale, enable_gqa,
            None if window_size is None else tuple(window_size), softcap, causal_alignment,
            return_lse, backend, *process_state(q, backend),
            torch.backends.cuda.matmul.allow_tf32,
        )  # fmt: skip
    except (AttributeError, TypeError, RuntimeError):
        return None


def fp8_key(key, q_descale, k_descale, v_descale, out_dtype):
    """An fp8 call's key: the plain key with its descales' metadata and out_dtype."""
    if key is None:
        return None
    return (*key, meta(q_descale), meta(k_descale), meta(v_descale), out_dtype)


class AttentionPlan:
    """fusedattn.attention's decisions for one key: the backend, its keyword arguments, the
    float-mask shift, and for the Triton kernels a TritonAttentionLaunch template (its launch
    arguments worked out once, its launchers bound at their first call, the backward's
    included: custom_ops._forward)."""

    def __init__(self, impl, inputs: dict):
        self.impl = impl
        self.window = inputs["window"]
        tensors = (inputs[n] for n in ("q", "k", "v", "attn_mask", "key_padding_mask",
                                       "alibi_slopes", "sinks"))  # fmt: skip
        self.autograd = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in tensors
        )
        self.shift = inputs["attn_mask"] is not None and inputs["sinks"] is None
        self.kwargs = {n: inputs[n] for n in ("dropout_p", "scale", "enable_gqa", "window",
                                              "softcap", "return_lse")}  # fmt: skip
        self.fp8 = "k_descale" in inputs  # an fp8 call: its descales come with each call
        if self.fp8:
            self.kwargs["out_dtype"] = inputs["out_dtype"]
        self.template = None
        if impl.run is triton_backend.attention and not self.fp8:  # Triton's own, not a wrapper
            self.template = custom_ops.attention_template(
                inputs["q"], inputs["k"], inputs["v"], inputs["attn_mask"],
                inputs["key_padding_mask"], inputs["alibi_slopes"], inputs["sinks"],
                self.window, inputs["scale"], inputs["softcap"], inputs["dropout_p"],
            )  # fmt: skip

    def run(self, inputs: dict):
        """One call's inputs (after the shift) through the backend."""
        if self.template is not None:
            return self.impl.run(**inputs, template=self.template)
        return self.impl.run(**inputs)

    def __call__(self, q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, descales):
        shift = None
        if self.shift:
            visible = visible_keys(key_padding_mask, self.window, q.shape[2], k.shape[2], q.device)
            attn_mask, shift = shift_float_mask(attn_mask, visible)
        if self.template is not None:  # straight to the Triton forward, positionally
            kw = self.kwargs
            result = custom_ops._forward(
                q, k, v, attn_mask, key_padding_mask, None, None, 0, 0, kw["dropout_p"],
                kw["scale"], self.window, kw["softcap"], alibi_slopes, sinks, kw["return_lse"],
                "triton", self.template, self.autograd,
            )  # fmt: skip
        else:
            inputs = dict(q=q, k=k, v=v, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                          alibi_slopes=alibi_slopes, sinks=sinks, **self.kwargs)  # fmt: skip
            if self.fp8:
                inputs.update(q_descale=descales[0], k_descale=descales[1],
                              v_descale=descales[2])  # fmt: skip
            result = self.run(inputs)
        if shift is not None and self.kwargs["return_lse"]:
            out, lse = result
            return out, lse + shift.float()
        return result


def flex_key(key, q, attn_mask, block_mask, score_mod):
    """A block-mask or score_mod call's plan key: the dense key (`key`), the kernels' form of
    the mask by its metadata (KernelBlocks.metadata: a new mask of the same shapes is the
    same key, its lists bound per call), the mod by its traced structure and its captures'
    metadata (new values or new tensors of the same layout: the same key), and whether
    deterministic algorithms are asked for (the captures' gradient refusal). -> (key, the
    call's KernelBlocks or None, its ScoreMod or None); (None, None, None) for a call plans
    do not cover: a block mask beside an attn_mask (merged densely each call), or anything
    the lookups refuse (the full path then raises it, in its order)."""
    if key is None or (block_mask is not None and attn_mask is not None):
        return None, None, None
    try:
        bm = None if block_mask is None else as_block_mask(block_mask, q.device)
        # _eager: api.attention asks for a plan only when not tracing (no compile check)
        mod = None if score_mod is None else prepare_score_mod(score_mod, q.device, _eager=True)
    except (TypeError, ValueError, RuntimeError):
        return None, None, None
    mod_key = None if mod is None else (mod.name, *mod.layouts)  # layouts: meta's fields
    return (
        key, None if bm is None else bm.metadata(), mod_key,
        torch.are_deterministic_algorithms_enabled(),
    ), bm, mod  # fmt: skip


class FlexPlan:
    """A block-mask or score_mod call's decisions on the Triton kernels (api._flex_call made
    them once, flex.run checked the captures' gradients): the float-mask shift, the kernels'
    scalars, whether a backward is recorded (grad mode and every requires_grad are in the
    key), and a TritonAttentionLaunch template (launch arguments, tiles, the mod's generated
    functions) each call binds to its own KernelBlocks and ScoreMod; its launchers are bound
    at their first call, each call handing them its lists and captures
    (TritonAttentionLaunch.flex_values)."""

    def __init__(self, impl, inputs: dict, bm, mod):
        self.impl = impl  # the Cache serves a plan while this is the registered backend
        self.window = window = inputs["window"]
        self.shift = inputs["attn_mask"] is not None and inputs["sinks"] is None
        self.return_lse = inputs["return_lse"]
        self.dropout_p = inputs["dropout_p"]
        self.template = custom_ops.attention_template(
            inputs["q"], inputs["k"], inputs["v"], inputs["attn_mask"],
            inputs["key_padding_mask"], inputs["alibi_slopes"], inputs["sinks"], window,
            inputs["scale"], inputs["softcap"], self.dropout_p, block=bm, mod=mod,
        )  # fmt: skip
        # the template keeps no call's mask or captures (each call binds its own)
        self.template.block = self.template.mod = None
        self.scalars = (window.left, window.right, window.bottom_right,
                        self.template.scalars[0], inputs["softcap"], self.dropout_p)  # fmt: skip
        tensors = [inputs[n] for n in ("q", "k", "v", "attn_mask", "key_padding_mask",
                                       "alibi_slopes", "sinks")]  # fmt: skip
        tensors += [] if mod is None else mod.tensors
        self.autograd = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in tensors
        )

    def run(self, inputs: dict, bm):
        """The first call's checked inputs (after the shift) through the Triton kernels: the
        full flex.run, its refusals included."""
        return flex.run(block_mask=bm, template=self.template, **inputs)

    def __call__(self, q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, bm, mod):
        shift = None
        if self.shift:
            visible = visible_keys(key_padding_mask, self.window, q.shape[2], k.shape[2], q.device)
            attn_mask, shift = shift_float_mask(attn_mask, visible)
        seed = custom_ops.dropout_seed(self.dropout_p, q.device)  # (the layout: the kernels')
        out, lse = flex.eager(
            (q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, None, None),
            (0, 0, *self.scalars, seed), bm, mod, self.autograd, self.template,
        )  # fmt: skip
        if not self.return_lse:
            return out
        return out, lse if shift is None else lse + shift.float()
