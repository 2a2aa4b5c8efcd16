"""Public ops: validation, backend dispatch and the launchers of every backend."""

from .attention import attention, varlen_attention
from .backends import BackendUnavailableError, available_backends
from .decode import attention_with_kvcache
from .layernorm import layer_norm
from .rmsnorm import rms_norm
from .softmax import softmax

__all__ = [
    "BackendUnavailableError",
    "attention",
    "attention_with_kvcache",
    "available_backends",
    "layer_norm",
    "rms_norm",
    "softmax",
    "varlen_attention",
]
