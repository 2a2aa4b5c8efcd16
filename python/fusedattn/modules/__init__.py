"""Drop-in nn.Modules backed by fusedattn's ops, and swap_modules."""

from .attention import MultiheadAttention
from .layernorm import LayerNorm
from .linear import Linear
from .rmsnorm import RMSNorm
from .softmax import Softmax
from .swap import swap_modules

__all__ = ["LayerNorm", "Linear", "MultiheadAttention", "RMSNorm", "Softmax", "swap_modules"]
