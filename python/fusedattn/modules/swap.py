"""swap_modules: put fusedattn's modules in place of torch's (and the reference ones)."""

from __future__ import annotations

from torch import nn

from ..ops.core.backends import BACKENDS
from ..reference import modules as naive
from .attention import MultiheadAttention
from .layernorm import LayerNorm
from .linear import Linear
from .rmsnorm import RMSNorm, is_hf_llama_rms_norm
from .softmax import Softmax

# Exact types replaced: torch's modules and the naive twins (fusedattn.reference.modules).
# Subclasses that users wrote are left alone: their forward may do more than the base class.
REPLACED = {
    "attention": (nn.MultiheadAttention, naive.MultiheadAttention),
    "layernorm": (nn.LayerNorm, naive.LayerNorm),
    "rmsnorm": (nn.RMSNorm, naive.RMSNorm),
    "softmax": (nn.Softmax, naive.Softmax),
    "linear": (nn.Linear,),
}


BACKEND_NAMES = (*BACKENDS, "auto")
FUSED = {"attention": MultiheadAttention, "layernorm": LayerNorm, "rmsnorm": RMSNorm,
         "softmax": Softmax, "linear": Linear}  # fmt: skip


def _replacement(module, backend, wanted):
    """The fused module to put in `module`'s place, or None to keep it. A module that is
    already fused only has its backend retargeted."""
    kind = type(module)
    for family, cls in FUSED.items():
        if not wanted[family]:
            continue
        if kind in REPLACED[family]:
            return cls.from_torch(module, backend=backend)
        if kind is cls:
            module.backend = backend
    if wanted["rmsnorm"] and is_hf_llama_rms_norm(module):
        return RMSNorm.from_hf(module, backend=backend)
    return None


def swap_modules(
    model: nn.Module,
    *,
    backend="auto",
    attention=True,
    layernorm=True,
    rmsnorm=True,
    softmax=True,
    linear=False,
) -> nn.Module:
    """Replace, in place, every nn.MultiheadAttention, nn.LayerNorm, nn.RMSNorm and nn.Softmax
    (and their reference twins), and the RMSNorm of Hugging Face Llama-family models
    (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, ...: those whose forward is Llama's; Gemma's
    `1 + weight` variant is left alone), by fusedattn's, with the same weights, device, dtype
    and train/eval mode; returns `model` (or the replacement, if `model` itself is one of
    those modules).

    nn.TransformerEncoder's nested-tensor inference path is turned off wherever a module inside
    it is fused (it would hand nested tensors to the fused modules); the encoder-layer fast
    path is kept off by the fused modules themselves, so fusedattn's kernels run inside
    torch's transformer layers whichever families are swapped.

    linear=True also replaces every nn.Linear (exact type) by fusedattn.Linear, holding the
    same parameters (tied weights stay tied): F.linear while batch invariance is off, the
    batch-invariant Triton matmul while it is on (docs/batch_invariance.md). Off by default:
    it changes nothing else.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"model must be an nn.Module, got {type(model).__name__} (swap_modules takes an "
            "nn.Module; wrap a list of modules in nn.ModuleList or nn.Sequential)"
        )
    if backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {backend!r}")
    wanted = dict(attention=attention, layernorm=layernorm, rmsnorm=rmsnorm, softmax=softmax,
                  linear=linear)  # fmt: skip
    root = _replacement(model, backend, wanted)
    if root is not None:
        return root
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            new = _replacement(child, backend, wanted)
            if new is not None:
                setattr(parent, name, new)
    fused = tuple(FUSED.values())
    for encoder in model.modules():
        if isinstance(encoder, nn.TransformerEncoder) and any(
            isinstance(m, fused) for m in encoder.modules()
        ):
            encoder.use_nested_tensor = False
    return model
