"""Triton helpers of the generated score_mod functions (fusedattn/score_mod/codegen.py): the
operations whose Triton form is not one builtin. Python's floor division and modulo on
integers (Triton's // and % follow the hardware: truncated), and the float functions the CPU
interpreter has no libdevice for (tanh, log1p, expm1, tan: there they compute in float64,
which keeps them accurate near 0; on a GPU libdevice's float32 forms)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

LN2 = 0.6931471805599453


@triton.jit
def floordiv(a, b):
    """a // b with Python's (and torch's) floor rounding for integers, whichever rounding
    Triton's own // has (truncation on a GPU): the quotient moves down by one where the
    remainder is non-zero and its sign differs from b's."""
    q = a // b
    r = a - q * b
    return q - ((r != 0) & ((r < 0) != (b < 0))).to(q.dtype)


@triton.jit
def floormod(a, b):
    """a % b with Python's sign (that of b) for integers."""
    r = a - (a // b) * b
    return r + tl.where((r != 0) & ((r < 0) != (b < 0)), b, 0)


@triton.jit
def truncdiv(a, b):
    """a / b rounded toward zero, for integers."""
    q = floordiv(a, b)
    return q + ((a - q * b != 0) & ((a < 0) != (b < 0))).to(q.dtype)


@triton.jit
def tanh(x, INTERPRETED: tl.constexpr, FAST: tl.constexpr = False):
    """FAST (the kernel's dots at reduced precision, as for the built-in softcap): one ex2
    and one division, ~3e-7 absolute error (attention_loops._tanh): a softcap mod's sm_90
    forward loop 1284 -> 836 instructions per iteration, the built-in softcap's 773 (its
    scales fold into one multiply each side); else libdevice's (the interpreter: fp64)."""
    if INTERPRETED:
        e = tl.exp(2.0 * x.to(tl.float64))
        return (1.0 - 2.0 / (e + 1.0)).to(tl.float32)
    if FAST:
        e = tl.exp2(x * 2.885390081777927)  # 2 log2(e); inf / 0 at the ends give +1 / -1
        return 1.0 - 2.0 / (e + 1.0)
    return libdevice.tanh(x)


@triton.jit
def log1p(x, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        return tl.log(1.0 + x.to(tl.float64)).to(tl.float32)
    return libdevice.log1p(x)


@triton.jit
def expm1(x, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        return (tl.exp(x.to(tl.float64)) - 1.0).to(tl.float32)
    return libdevice.expm1(x)


@triton.jit
def tan(x, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        x64 = x.to(tl.float64)
        return (tl.sin(x64) / tl.cos(x64)).to(tl.float32)
    return libdevice.tan(x)


@triton.jit
def trunc(x):
    return tl.where(x < 0.0, tl.ceil(x), tl.floor(x))


@triton.jit
def sign(x):
    one = tl.full(x.shape, 1, x.dtype)
    return tl.where(x > 0, one, tl.where(x < 0, -one, one - one))


@triton.jit
def softplus(x, beta, threshold, INTERPRETED: tl.constexpr):
    """torch's softplus: log(1 + e^(beta x)) / beta, x itself past beta x > threshold."""
    return tl.where(x * beta > threshold, x, log1p(tl.exp(x * beta), INTERPRETED) / beta)


@triton.jit
def gelu(x):
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))


@triton.jit
def gelu_tanh(x, INTERPRETED: tl.constexpr):
    inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + tanh(inner, INTERPRETED))


@triton.jit
def d_gelu(x):
    cdf = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
    pdf = tl.exp(-0.5 * x * x) * 0.3989422804014327
    return cdf + x * pdf


@triton.jit
def d_gelu_tanh(x, INTERPRETED: tl.constexpr):
    """torch's derivative of the tanh-approximated gelu."""
    x_sq = x * x
    inner = 0.7978845608028654 * (x + 0.044715 * x_sq * x)
    t = tanh(inner, INTERPRETED)
    left_derivative = 0.5 * (1.0 + t)
    right_derivative = 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x_sq)
    return left_derivative + right_derivative


@triton.jit
def wrap_index(i, n, WIDE: tl.constexpr):
    """A negative index counts from the end (Python's, torch's and compiled Flex's rule), in
    int64 where the capture's offsets may pass 2^31 - 1 (WIDE), else in the index's own
    type (int32 from b, h, q_idx, kv_idx: half the integer instructions of int64 math)."""
    if WIDE:
        i = i.to(tl.int64)
    return tl.where(i < 0, i + n, i)


@triton.jit
def in_range(i, n):
    """0 <= i < n, as one unsigned comparison (a negative i is a huge unsigned one)."""
    if i.dtype == tl.int64:
        return i.to(tl.uint64, bitcast=True) < n
    return i.to(tl.uint32, bitcast=True) < n


@triton.jit
def sum_to(g, ON_ROWS: tl.constexpr, ON_COLS: tl.constexpr):
    """g (a tile, rows along axis 0 and keys along axis 1) summed over the axes an index
    does not depend on, so that a table entry shared by a tile's row (or column, or the whole
    tile) gets one atomic add instead of one per element."""
    if not ON_COLS:
        g = tl.sum(g, axis=1, keep_dims=True)
    if not ON_ROWS:
        g = tl.sum(g, axis=0, keep_dims=True)
    return g
