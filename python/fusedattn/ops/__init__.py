"""fusedattn's ops: the public functions, their backends and the machinery below them.

One package per op family, each laid out the same way, on two shared layers (an arrow is
"imports"; nothing imports upward, and no family imports another):

    ops/__init__.py           the public functions, re-exported
      attention/  decode/  mla/  rowwise/  linear/  the op families
        api.py                public functions, dispatch, the backends' registration
        plans.py              eager calls' plans
        <name>_backend.py     one file per backend: reference, torch, triton, cuda
        custom_ops.py / *_ops.py   torch.library ops, autograd, kernel launches
      shared/                 what two families share: torch's SDPA to fusedattn's semantics
                              (sdpa.py), the Triton decode kernel's launcher (decode_launch.py)
      core/                   machinery: backend registry and selection (backends.py), auto's
                              table (auto.py, auto_table.py), plans' cache (plans.py), Triton
                              launching (triton_launch.py), the extension loader
                              (extension.py), kernel facts (kernels.py), outputs (outputs.py)
    below ops: fusedattn.reference (naive ops) and the level-0 modules (checks, masks,
    cache_layout, autocast, nn_interfaces)

tests/test_import_graph.py holds the package to this, deferred imports included.
"""

from .attention.api import attention, varlen_attention
from .core.backends import BackendUnavailableError, available_backends
from .decode.api import attention_with_kvcache
from .linear.api import linear
from .mla.api import mla_attention_with_kvcache
from .mla.sparse_prefill import mla_sparse_attention
from .rowwise.api import layer_norm, rms_norm, softmax

__all__ = [
    "BackendUnavailableError",
    "attention",
    "attention_with_kvcache",
    "available_backends",
    "layer_norm",
    "linear",
    "mla_attention_with_kvcache",
    "mla_sparse_attention",
    "rms_norm",
    "softmax",
    "varlen_attention",
]
