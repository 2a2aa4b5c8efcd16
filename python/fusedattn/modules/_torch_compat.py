"""What every fused module does to sit where a torch module sat.

- torch's `nn.TransformerEncoderLayer` has an inference fast path that reads the layer's
  weights and calls torch's own fused kernel, bypassing the attention *and* the norm modules.
  It is skipped when any submodule has a forward hook, so each fused module attaches one no-op
  pre-hook: inside torch's layers fusedattn's kernels run in train and in eval, whichever
  modules were swapped.
- TorchScript cannot compile fusedattn's ops (keyword-only arguments, torch.library custom
  ops); `torch.jit.script` then fails deep inside the compiler. `__prepare_scriptable__`,
  which `torch.jit.script` calls on every module first, says so plainly instead.
"""

from __future__ import annotations

from torch import nn


def _keep_torch_fast_path_off(module, args):
    """No-op forward pre-hook; its presence disables torch's encoder-layer fast path."""
    return None


class FusedModule(nn.Module):
    """Mixin of the fused modules: the fast-path hook and a clear TorchScript refusal."""

    def _register_fused_hooks(self) -> None:
        self.register_forward_pre_hook(_keep_torch_fast_path_off)

    def __prepare_scriptable__(self):
        raise TypeError(
            f"fusedattn.{type(self).__name__} is not scriptable with torch.jit.script (its ops "
            "are torch.library custom ops called with keyword-only arguments); use "
            "torch.compile instead (TorchScript, jit.trace included, is deprecated in torch 2.14)"
        )
