"""Naive O(T²) twins of every fusedattn op, with the same signatures and semantics.

`attention`, `varlen_attention`, `attention_with_kvcache`, `mla_attention_with_kvcache`,
`layer_norm`, `rms_norm`, `softmax` and `linear` are the correctness references and the baseline the benchmarks beat;
`modules` holds naive twins of the drop-in modules (torch's interfaces and state_dicts,
computed by these ops) and `transformer` the reference model built from them.

The layer below fusedattn.ops: the package imports only torch and fusedattn's level-0
modules (checks, masks, cache_layout, autocast, nn_interfaces), never fusedattn.ops or
fusedattn.modules, deferred imports included (tests/test_import_graph.py).
"""

from . import decode, mla
from .attention import apply_score_mod, attention, varlen_attention
from .decode import attention_with_kvcache
from .layernorm import layer_norm
from .linear import linear
from .mla import mla_attention_with_kvcache
from .rmsnorm import rms_norm
from .softmax import softmax

__all__ = [
    "apply_score_mod",
    "attention",
    "attention_with_kvcache",
    "decode",
    "layer_norm",
    "linear",
    "mla",
    "mla_attention_with_kvcache",
    "rms_norm",
    "softmax",
    "varlen_attention",
]
