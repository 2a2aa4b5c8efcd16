"""Naive O(T²) twins of every fusedattn op, with the same signatures and semantics.

`attention`, `varlen_attention`, `attention_with_kvcache`, `layer_norm`, `rms_norm` and
`softmax` are the correctness references and the baseline the benchmarks beat; `modules` holds naive nn.Modules with torch's state_dict layout and
`transformer` the reference model built from them.
"""

from . import decode
from .attention import attention, varlen_attention
from .decode import attention_with_kvcache
from .layernorm import layer_norm
from .modules import LayerNorm, MultiheadAttention, RMSNorm, Softmax
from .rmsnorm import rms_norm
from .softmax import softmax

__all__ = [
    "LayerNorm",
    "MultiheadAttention",
    "RMSNorm",
    "Softmax",
    "attention",
    "attention_with_kvcache",
    "decode",
    "layer_norm",
    "rms_norm",
    "softmax",
    "varlen_attention",
]
