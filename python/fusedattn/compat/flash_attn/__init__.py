"""flash-attention 2's Python API on fusedattn's kernels: switch by changing the import, or
make `import flash_attn` itself answer with fusedattn.

    # from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    from fusedattn.compat.flash_attn import (
        flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache,
    )

    # or, once at start-up, for code you do not edit (PyMySQL's install_as_MySQLdb() idea):
    import fusedattn.compat.flash_attn
    fusedattn.compat.flash_attn.install()
    import flash_attn                     # fusedattn's, with its submodules:
    from flash_attn.bert_padding import pad_input, unpad_input
    from flash_attn.layers.rotary import RotaryEmbedding, apply_rotary_emb

The surface: the attention functions of `flash_attn_interface` (also at the top level), the
packed forms, `bert_padding` and `layers.rotary`. `__version__` is the flash-attention release
whose Python API this follows. What it cannot honour is refused by name (see
flash_attn_interface's docstring). `install()` does not make flash-attention's CUDA extension
modules (`flash_attn_2_cuda`) or package metadata exist: code that imports those, or checks
for an installed `flash-attn` distribution (transformers' `is_flash_attn_2_available()`), still
sees none.
"""

from __future__ import annotations

import sys

from . import bert_padding, flash_attn_interface, layers
from .flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)
from .layers import rotary

__version__ = "2.7.4"  # the flash-attention 2 API this module follows

__all__ = [
    "bert_padding",
    "flash_attn_func",
    "flash_attn_interface",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "install",
    "layers",
    "uninstall",
]

_MODULES = {
    "flash_attn": sys.modules[__name__],
    "flash_attn.flash_attn_interface": flash_attn_interface,
    "flash_attn.bert_padding": bert_padding,
    "flash_attn.layers": layers,
    "flash_attn.layers.rotary": rotary,
}


def install() -> None:
    """Register fusedattn's flash-attention API as `flash_attn` and its submodules in
    sys.modules, so `import flash_attn` (and `from flash_attn.bert_padding import ...`) in code
    you do not edit runs fusedattn. Refused if a real flash_attn is already imported (two
    implementations under one name would be a silent mix)."""
    present = sys.modules.get("flash_attn")
    if present is not None and present is not _MODULES["flash_attn"]:
        raise RuntimeError(
            f"a flash_attn module is already imported ({getattr(present, '__file__', present)}):"
            " call fusedattn.compat.flash_attn.install() before anything imports flash_attn"
        )
    sys.modules.update(_MODULES)


def uninstall() -> None:
    """Remove what install() registered (and nothing else)."""
    for name, module in _MODULES.items():
        if sys.modules.get(name) is module:
            del sys.modules[name]
