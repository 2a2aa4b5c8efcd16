"""fusedattn: fused attention, LayerNorm, RMSNorm and softmax kernels (Triton and CUDA C++).

    import fusedattn
    out = fusedattn.attention(q, k, v, is_causal=True)          # backend="auto"
    fusedattn.available_backends()                              # what runs here
    python -m fusedattn.info                                    # versions, build, GPU

Importing fusedattn never initialises CUDA and never imports triton.
"""

from . import masks, reference
from ._version import __version__
from .invariance import batch_invariant
from .modules import LayerNorm, Linear, MultiheadAttention, RMSNorm, Softmax, swap_modules
from .ops import (
    BackendUnavailableError,
    attention,
    attention_with_kvcache,
    available_backends,
    layer_norm,
    linear,
    mla_attention_with_kvcache,
    mla_sparse_attention,
    rms_norm,
    softmax,
    varlen_attention,
)

__all__ = [
    "BackendUnavailableError",
    "LayerNorm",
    "Linear",
    "MultiheadAttention",
    "RMSNorm",
    "Softmax",
    "__version__",
    "attention",
    "attention_with_kvcache",
    "available_backends",
    "batch_invariant",
    "layer_norm",
    "linear",
    "masks",
    "mla_attention_with_kvcache",
    "mla_sparse_attention",
    "reference",
    "rms_norm",
    "softmax",
    "swap_modules",
    "varlen_attention",
]
