"""Triton's CPU interpreter (TRITON_INTERPRET=1) as fusedattn runs it: a `tl.dot` whose rows
do not depend on each other, boolean masks on Triton 3.9, and float32 -> bfloat16 rounded to
nearest even.

The interpreter runs `tl.dot` as numpy's matmul, which hands it to the BLAS. OpenBLAS's
kernels compute a product's rows in groups whose order of operations depends on where a row
sits in the tile (and on M: below 4 rows it takes another routine): on the AMD EPYC CPU of
the 2-core CI machine, 1463 of 2000 random 16x16 fp32 products gave a row other bits when it
sat elsewhere in the tile (2026-12-01). A query's attention then depended on the rows beside
it, and batch invariance (fusedattn.batch_invariant: a row's bits whatever its batch) failed
in the interpreter: in the tests and in vLLM's CPU build on fusedattn's Triton backend, while
a GPU's MMA computes each row alone. So the interpreter's dot runs as one (1 x K)(K x N)
product per row, the same routine for every row and every M: 1.4-3.5x the time of numpy's
matmul on 16-128 wide tiles, a small share of the interpreter's time per kernel.

Masks on Triton 3.9 (what vLLM's CPU build installs): the interpreter keeps a comparison's
result in its left operand's dtype (`binary_op`: tl_dtype = lhs.dtype, so `pos >= 0` with an
int64 pos holds int64 0/1 data under an int1 type), and splatting such a scalar to a block
(`ok & (d < D)`, the append kernel's and the decode kernels' masks) makes an int64 array. 3.6 -
3.8 load and store through numpy, which takes it; 3.9's C++ load and store refuse it
("mask has unsupported dtype"). The compiled kernel is not affected: there the mask is i1
(the splat of an i1). So the interpreter's load and store get their masks as bool.

bfloat16: the interpreter's `x.to(tl.bfloat16)` from float32 truncates (Triton 3.6-3.9 call
their float conversion without a rounding mode; its own round-to-nearest mode does not carry
into the exponent either), where a GPU rounds to nearest even. A bfloat16 attention's output
and P·V operand were biased toward zero: its mean error was twice naive bfloat16 PyTorch's on
the CPU (2026-12-02), against Flex's 1.1x. The interpreter's cast rounds to nearest even here,
on the bits, NaN kept NaN.
"""

from __future__ import annotations

import types

_installed = False


def _rowwise_matmul(numpy):
    matmul, contiguous = numpy.matmul, numpy.ascontiguousarray

    def rowwise(a, b, *args, **kwargs):
        """matmul(a, b) as a stack of one-row products (a, b at least 2-D), else matmul. The
        operands are made contiguous first: numpy takes another loop for strided ones (a
        transposed tile, a descriptor's block), whose sums then differ in their last bits."""
        if getattr(a, "ndim", 0) < 2 or getattr(b, "ndim", 0) < 2 or args:
            return matmul(a, b, *args, **kwargs)
        a, b = contiguous(a), contiguous(b)
        return matmul(a[..., :, None, :], b[..., None, :, :], **kwargs)[..., 0, :]

    return rowwise


def _bool_masks(native):
    """The interpreter's C++ module, its load and store taking masks as bool."""
    proxy = types.ModuleType(native.__name__, "triton's interpreter module, bool masks")
    for name in dir(native):
        if not name.startswith("__"):
            setattr(proxy, name, getattr(native, name))

    def boolean(mask):
        """An int mask array as bool; anything else (a bool array, another caller's buffer)
        as it is."""
        dtype = getattr(mask, "dtype", None)
        if dtype is not None and dtype.kind in "iu":
            return mask.astype(bool)
        return mask

    def load(ptrs, mask, *args):
        return native.load(ptrs, boolean(mask), *args)

    def store(ptrs, value, mask, *args):
        return native.store(ptrs, value, boolean(mask), *args)

    proxy.load, proxy.store = load, store
    return proxy


def _rounded_bfloat16(numpy):
    def rounded(values):
        """float32 array -> its bfloat16 bits (uint16), rounded to nearest, ties to even."""
        bits = numpy.ascontiguousarray(values, dtype=numpy.float32).view(numpy.uint32)
        half = (bits + numpy.uint32(0x7FFF) + ((bits >> 16) & numpy.uint32(1))) >> 16
        nan = numpy.isnan(values)
        return numpy.where(nan, (bits >> 16) | numpy.uint32(0x0040), half).astype(numpy.uint16)

    return rounded


def _bfloat16_casts(builder, numpy):
    """The interpreter builder's cast, float32 -> bfloat16 rounded to nearest even."""
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    cast, rounded = builder.cast_impl, _rounded_bfloat16(numpy)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return TensorHandle(rounded(src.data), tl.bfloat16)
        return cast(self, src, dst_type)

    builder.cast_impl = cast_impl


def install() -> None:
    """Give the interpreter's module a numpy whose matmul is row by row (Triton 3.6-3.9 run
    every dot, tl.dot and the scaled dots, through `np.matmul` in
    triton/runtime/interpreter.py; its other numpy calls unchanged), a float32 -> bfloat16
    cast that rounds to nearest even, and on Triton 3.9 a load and store that take int
    masks as bool. Once per process."""
    global _installed
    if _installed:
        return
    from triton.runtime import interpreter

    numpy = interpreter.np
    rowwise = types.ModuleType("numpy_rowwise_matmul", "numpy, with a row-by-row matmul")
    rowwise.__dict__.update(numpy.__dict__)
    rowwise.matmul = _rowwise_matmul(numpy)
    interpreter.np = rowwise
    if hasattr(interpreter, "InterpreterBuilder"):
        _bfloat16_casts(interpreter.InterpreterBuilder, numpy)
    native = getattr(interpreter, "_interpreter", None)
    if native is not None and hasattr(native, "load") and hasattr(native, "store"):
        interpreter._interpreter = _bool_masks(native)
    _installed = True
