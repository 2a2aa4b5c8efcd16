"""A one-tile Triton kernel that runs a generated score_mod (fusedattn/score_mod/codegen.py) on
a (rows x keys) tile of scores: its value, and its gradient with the captured tensors'
gradient atomics, as the dQ kernel calls them. tests/test_score_mod.py checks the whole
accepted subset with it against torch on the same tile, without an attention around it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import fusedattn.score_mod as score_mod_package
from fusedattn.ops.core import backends, interpreter
from fusedattn.triton_kernels import score_mod_math as sm

if backends.triton_interpreter_enabled():  # the interpreter as the attention kernels run in it
    interpreter.install()


@triton.jit
def _apply(S, OUT, DS, DY, b, h, Tq, Tk, MOD: tl.constexpr, DMOD: tl.constexpr, A,
           BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    rows = tl.arange(0, BM)[:, None]
    cols = tl.arange(0, BN)[None, :]
    inside = (rows < Tq) & (cols < Tk)
    s = tl.load(S + rows * Tk + cols, mask=inside, other=0.0)
    qi = tl.minimum(rows, Tq - 1)
    kj = tl.minimum(cols, Tk - 1)
    tl.store(OUT + rows * Tk + cols, MOD(s, b, h, qi, kj, A), mask=inside)
    dy = tl.load(DY + rows * Tk + cols, mask=inside, other=0.0)
    tl.store(DS + rows * Tk + cols, DMOD(s, b, h, qi, kj, A, dy, inside), mask=inside)


def run_tile(fn, scores: torch.Tensor, dy: torch.Tensor, b: int, h: int):
    """(mod(scores), dscores, the captures' gradients (None where not wanted)) of fn on one
    (Tq, Tk) float32 tile at batch b, head h; the kernel in the interpreter on a CPU."""
    mod = score_mod_package.prepare(fn, scores.device)
    wanted = tuple(t.requires_grad for t in mod.tensors)
    functions = mod.functions(not scores.is_cuda, wanted)
    grads = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) if w else None
             for t, w in zip(mod.tensors, wanted, strict=True)]  # fmt: skip
    Tq, Tk = scores.shape
    out, ds = torch.empty_like(scores), torch.empty_like(scores)
    dmod = functions.score_mod_grad if any(wanted) else functions.score_mod_dscore
    block = lambda n: max(16, triton.next_power_of_2(n))  # noqa: E731
    _apply[(1,)](scores.contiguous(), out, ds, dy.contiguous(), b, h, Tq, Tk,
                 functions.score_mod, dmod, mod.arguments(grads), BM=block(Tq), BN=block(Tk))  # fmt: skip
    return out, ds, grads


@triton.jit
def _tanh(X, Y, N: tl.constexpr, FAST: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(Y + i, sm.tanh(tl.load(X + i), False, FAST))


def tanh_tile(x: torch.Tensor, fast: bool) -> torch.Tensor:
    """score_mod_math.tanh's compiled forms (INTERPRETED False) on x (a power-of-two length):
    libdevice's (a GPU only) or, FAST, the built-in softcap's exp2 form."""
    y = torch.empty_like(x)
    _tanh[(1,)](x, y, x.numel(), fast)
    return y
