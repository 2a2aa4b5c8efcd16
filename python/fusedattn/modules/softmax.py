"""fusedattn.Softmax: nn.Softmax computed by fusedattn.softmax."""

from __future__ import annotations

from torch import nn

from ..nn_interfaces import FusedModule, softmax_dim
from ..ops import softmax


class Softmax(nn.Softmax, FusedModule):
    """Drop-in `nn.Softmax` (same constructor, repr and legacy implicit dim) whose forward runs
    `fusedattn.softmax`; a row of -inf gives 0 instead of NaN."""

    def __init__(self, dim=None, *, backend="auto"):
        super().__init__(dim)
        self.backend = backend
        self._register_fused_hooks()

    @classmethod
    def from_torch(cls, module: nn.Softmax, *, backend="auto") -> Softmax:
        return cls(module.dim, backend=backend).train(module.training)

    def forward(self, input):
        return softmax(input, softmax_dim(self.dim, input), backend=self.backend)
