"""fusedattn.LayerNorm: nn.LayerNorm computed by fusedattn.layer_norm."""

from __future__ import annotations

from torch import nn

from ..nn_interfaces import FusedModule, norm_shape
from ..ops import layer_norm


class LayerNorm(nn.LayerNorm, FusedModule):
    """Drop-in `nn.LayerNorm` (same constructor, parameters, state_dict and repr) whose forward
    runs `fusedattn.layer_norm`; `backend` (keyword-only) picks the kernel backend."""

    def __init__(
        self,
        normalized_shape,
        eps=1e-5,
        elementwise_affine=True,
        bias=True,
        device=None,
        dtype=None,
        *,
        backend="auto",
    ):
        super().__init__(norm_shape(normalized_shape), eps, elementwise_affine, bias, device, dtype)
        self.backend = backend
        self._register_fused_hooks()

    @classmethod
    def from_torch(cls, norm: nn.LayerNorm, *, backend="auto") -> LayerNorm:
        p = norm.weight if norm.weight is not None else None
        new = cls(
            norm.normalized_shape,
            eps=norm.eps,
            elementwise_affine=norm.elementwise_affine,
            bias=norm.bias is not None,
            device=None if p is None else p.device,
            dtype=None if p is None else p.dtype,
            backend=backend,
        )
        new.load_state_dict(norm.state_dict())
        return new.train(norm.training)

    def forward(self, input):
        return layer_norm(
            input, self.normalized_shape, self.weight, self.bias, self.eps, backend=self.backend
        )
