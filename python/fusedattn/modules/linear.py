"""fusedattn.Linear: nn.Linear computed by fusedattn.linear, so that a swapped model's
projections follow fusedattn.batch_invariant (F.linear itself while the switch is off)."""

from __future__ import annotations

from torch import nn

from ..nn_interfaces import FusedModule
from ..ops import linear


class Linear(nn.Linear, FusedModule):
    """Drop-in `nn.Linear` (same constructor, parameters, state_dict and repr) whose forward
    runs `fusedattn.linear`; `backend` (keyword-only) picks the kernel backend. With `auto`
    that is F.linear unless batch invariance is on, then the batch-invariant Triton matmul."""

    def __init__(
        self, in_features, out_features, bias=True, device=None, dtype=None, *, backend="auto"
    ):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.backend = backend
        self._register_fused_hooks()

    @classmethod
    def from_torch(cls, module: nn.Linear, *, backend="auto") -> Linear:
        """The stand-in for `module`, holding its very parameters (not copies): weights tied
        to others (a language model's head and its embedding) stay tied."""
        w = module.weight
        new = cls(module.in_features, module.out_features, bias=module.bias is not None,
                  device="meta", dtype=w.dtype, backend=backend)  # fmt: skip
        new.weight, new.bias = module.weight, module.bias
        return new.train(module.training)

    def forward(self, input):
        return linear(input, self.weight, self.bias, backend=self.backend)
