"""fusedattn.Softmax: nn.Softmax computed by fusedattn.softmax."""

from __future__ import annotations

import warnings

from torch import nn

from ..ops import softmax
from ._torch_compat import FusedModule


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
        dim = self.dim
        if dim is None:  # nn.Softmax's legacy implicit dim, with its warning
            warnings.warn(
                "Implicit dimension choice for softmax has been deprecated. "
                "Change the call to include dim=X as an argument.",
                stacklevel=2,
            )
            dim = 0 if input.dim() in (0, 1, 3) else 1
        return softmax(input, dim, backend=self.backend)
