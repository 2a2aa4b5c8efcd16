"""fusedattn.RMSNorm: nn.RMSNorm computed by fusedattn.rms_norm, and the stand-in for the
RMSNorm modules of Hugging Face Llama-family models."""

from __future__ import annotations

from torch import nn

from ..nn_interfaces import FusedModule, norm_shape
from ..ops import rms_norm


def is_hf_llama_rms_norm(module: nn.Module) -> bool:
    """True for a Hugging Face RMSNorm whose forward is LlamaRMSNorm's, bytecode for bytecode
    (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm and every "copied from Llama" twin): exactly
    y = weight * (x * rsqrt(mean(x^2) + variance_epsilon)).to(x.dtype). Variants with other
    math (Gemma's `1 + weight` in fp32) differ in bytecode and are left alone."""
    if not type(module).__module__.startswith("transformers."):
        return False
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm
    except ImportError:
        return False
    mine, llama = type(module).forward, LlamaRMSNorm.forward
    same = all(
        getattr(mine.__code__, a) == getattr(llama.__code__, a)
        for a in ("co_code", "co_consts", "co_names", "co_varnames")
    )
    weight = getattr(module, "weight", None)
    return (
        same
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 1
        and hasattr(module, "variance_epsilon")
    )


class RMSNorm(nn.RMSNorm, FusedModule):
    """Drop-in `nn.RMSNorm` (same constructor, parameters, state_dict and repr) whose forward
    runs `fusedattn.rms_norm`; `backend` (keyword-only) picks the kernel backend."""

    def __init__(
        self,
        normalized_shape,
        eps=None,
        elementwise_affine=True,
        device=None,
        dtype=None,
        *,
        backend="auto",
    ):
        super().__init__(norm_shape(normalized_shape), eps, elementwise_affine, device, dtype)
        self.backend = backend
        # Hugging Face's LlamaRMSNorm semantics (from_hf): weight * normalised.to(x.dtype)
        self.weight_after_rounding = False
        self._register_fused_hooks()

    @property
    def variance_epsilon(self):
        """Hugging Face's name of eps (its models read it off their norms)."""
        return self.eps

    @classmethod
    def from_torch(cls, norm: nn.RMSNorm, *, backend="auto") -> RMSNorm:
        p = norm.weight
        new = cls(
            norm.normalized_shape,
            eps=norm.eps,
            elementwise_affine=norm.elementwise_affine,
            device=None if p is None else p.device,
            dtype=None if p is None else p.dtype,
            backend=backend,
        )
        new.load_state_dict(norm.state_dict())
        return new.train(norm.training)

    @classmethod
    def from_hf(cls, norm: nn.Module, *, backend="auto") -> RMSNorm:
        """The stand-in for a Hugging Face Llama-family RMSNorm (is_hf_llama_rms_norm): same
        state_dict ('weight'), eps, output dtype (weight's and x's promoted)."""
        w = norm.weight
        new = cls(tuple(w.shape), eps=float(norm.variance_epsilon), device=w.device,
                  dtype=w.dtype, backend=backend)  # fmt: skip
        new.load_state_dict(norm.state_dict())
        new.weight_after_rounding = True
        return new.train(norm.training)

    def forward(self, input):
        w = self.weight
        if self.weight_after_rounding and w is not None and w.dtype != input.dtype:
            # HF rounds the normalised x to its dtype, then multiplies by the weight in the
            # promoted dtype (fp32 weights give an fp32 output): the same here
            return w * rms_norm(input, self.normalized_shape, None, self.eps, backend=self.backend)
        return rms_norm(input, self.normalized_shape, w, self.eps, backend=self.backend)
