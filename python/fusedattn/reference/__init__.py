"""Naive O(T²) twins of every fusedattn op, with the same signatures and semantics.

`attention`, `varlen_attention`, `attention_with_kvcache`, `layer_norm`, `rms_norm` and
`softmax` are the correctness references and the baseline the benchmarks beat;
`transformer` is the reference model (built from `fusedattn.modules.naive`: the drop-in
modules pinned to these ops, torch's state_dict layout). Nothing here imports fusedattn.ops
or fusedattn.modules at import time: ops/ imports the naive ops, not the other way round.
"""

from . import decode
from .attention import attention, varlen_attention
from .decode import attention_with_kvcache
from .layernorm import layer_norm
from .rmsnorm import rms_norm
from .softmax import softmax

__all__ = [
    "attention",
    "attention_with_kvcache",
    "decode",
    "layer_norm",
    "rms_norm",
    "softmax",
    "varlen_attention",
]
