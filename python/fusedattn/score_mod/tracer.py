"""Tracing a score_mod once: the callable runs on stand-in values for (score, b, h, q_idx,
kv_idx) and every operation it applies is recorded as a node of an ir.Graph, as Flex's
tracing does before Inductor; here the graph becomes a Triton function (codegen.py) instead.

Operations reach the tracer three ways: Python operators on the stand-ins (`score * 2`,
`q_idx - kv_idx`), torch functions and Tensor methods given a stand-in (`torch.tanh(score)`,
`bias[h, q_idx - kv_idx]`: torch hands them to `__torch_function__`), and, while the trace
runs, a TorchFunctionMode that sees every other torch call, so that what the kernels cannot
do (an in-place write to a captured tensor, a random draw, a reduction, a tensor made inside
the mod) is refused by name instead of running once at trace time and being baked in.

Refusals raise ScoreModError naming the mod (its qualified name and where it is defined), the
construct, and the file:line in the mod's code where it happened.
"""

from __future__ import annotations

import math
import os
import sys
import threading

import torch
from torch.overrides import TorchFunctionMode

from . import ir
from .captures import wide_offsets
from .ir import BOOL, FLOAT, INT32, INT64, Node

SUBSET_DOC = "docs/block_masks.md#the-accepted-subset"


class ScoreModError(ValueError):
    """A score_mod that fusedattn's tracer cannot write out as a kernel function."""


_HERE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _user_location() -> str:
    """file:line of the innermost frame outside this package and torch: the mod's line that
    did what is refused."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_HERE) and not path.startswith(_TORCH):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "<unknown>"


def describe_mod(fn) -> str:
    """`name (file:line)` of a score_mod: a function, a bound method, a partial or an object
    with __call__."""
    target = fn
    while hasattr(target, "func") and not hasattr(target, "__code__"):  # functools.partial
        target = target.func
    target = getattr(target, "__func__", target)
    code = getattr(target, "__code__", None)
    if code is None and callable(target):  # an object with __call__
        code = getattr(type(target).__call__, "__code__", None)
    name = getattr(target, "__qualname__", type(target).__qualname__)
    if code is None:
        return name
    return f"{name} ({code.co_filename}:{code.co_firstlineno})"


class _Trace:
    """What one trace is building: the graph, the captured tensors in order of first use, the
    names the caller found for them (captures.py) and the mod's description."""

    def __init__(self, mod: str, names: dict[int, str], device: torch.device):
        self.graph = ir.Graph()
        self.tensors: list[torch.Tensor] = []
        self._index: dict[int, int] = {}
        # the tensors whose shape or strides the mod read (id -> tensor): the graph's
        # constants depend on them (score_mod._Structure.read, checked on every lookup)
        self.read_layout: dict[int, torch.Tensor] = {}
        self.names = names
        self.mod = mod
        self.device = device

    def fail(self, what: str, hint: str = "") -> ScoreModError:
        where = _user_location()
        message = f"score_mod {self.mod}: {what} at {where}"
        if hint:
            message += f"; {hint}"
        return ScoreModError(message)

    def name(self, tensor: torch.Tensor) -> str:
        return self.names.get(id(tensor), f"a captured tensor of shape {tuple(tensor.shape)}")

    def capture(self, tensor: torch.Tensor) -> int:
        found = self._index.get(id(tensor))
        if found is not None:
            return found
        if ir.compute_dtype(tensor.dtype) is None:
            raise self.fail(f"captured tensor `{self.name(tensor)}` has dtype {tensor.dtype}",
                            "the kernels load bool, integer and floating-point tensors")  # fmt: skip
        if tensor.is_sparse or tensor.layout != torch.strided:
            raise self.fail(f"captured tensor `{self.name(tensor)}` is not strided")
        self._index[id(tensor)] = len(self.tensors)
        self.tensors.append(tensor)
        self.graph.captures.append((tensor.dtype, tensor.dim(), wide_offsets(tensor)))
        return self._index[id(tensor)]


_STATE = threading.local()


def _current() -> _Trace:
    trace = getattr(_STATE, "trace", None)
    if trace is None:
        raise ScoreModError("a score_mod's traced value was used after its trace ended")
    return trace


# ---- operands ---------------------------------------------------------------------------------


def _operand(x, what: str):
    """A node or a Python scalar (weakly typed, as torch's scalars) for x."""
    trace = _current()
    if isinstance(x, Traced):
        return x.node
    if isinstance(x, Node):
        return x
    if isinstance(x, bool | int | float):
        return x
    if isinstance(x, Indexed):
        raise trace.fail(f"`{x.name}` indexed in {len(x.index)} of its {x.tensor.dim()} "
                         f"dimensions is used in {what}", "index every dimension")  # fmt: skip
    if isinstance(x, torch.Tensor):
        if x.dim() == 0:
            return _load(x, ())
        raise trace.fail(
            f"captured tensor `{trace.name(x)}` of shape {tuple(x.shape)} is used in {what} "
            "without an index", "index every dimension with b, h, q_idx, kv_idx expressions",
        )  # fmt: skip
    if hasattr(x, "item") and hasattr(x, "dtype"):  # numpy scalars
        return x.item()
    raise trace.fail(f"{type(x).__name__} operand in {what}",
                     "operands are the traced values, Python numbers and captured tensors")  # fmt: skip


def _cast(x, dtype: torch.dtype):
    """Node or Python scalar x as a node of dtype (constants converted, nodes cast)."""
    graph = _current().graph
    if not isinstance(x, Node):
        value = bool(x) if dtype == BOOL else (int(x) if dtype in (INT32, INT64) else float(x))
        return graph.node("const", (), dtype, (value,))
    if x.dtype == dtype:
        return x
    if x.op == "const":
        value = x.attrs[0]
        value = bool(value) if dtype == BOOL else (int(value) if dtype in (INT32, INT64)
                                                   else float(value))  # fmt: skip
        return graph.node("const", (), dtype, (value,))
    return graph.node("cast", (x,), dtype, (str(dtype).removeprefix("torch."),))


def _wrap(x):
    """A result back to the mod: a stand-in for a node, a Python scalar as it is."""
    return Traced(x) if isinstance(x, Node) else x


def _binary(op: str, a, b, what: str | None = None):
    what = what or f"`{op}`"
    a, b = _operand(a, what), _operand(b, what)
    trace = _current()
    if not isinstance(a, Node) and not isinstance(b, Node):
        return ir.fold(op, a, b)
    dtype = ir.promote(a, b)
    if op in ir.LOGICAL:
        if dtype == FLOAT:
            raise trace.fail(f"{what} on floating-point values",
                             "bitwise and logical operators take bools and integers")  # fmt: skip
    elif op not in ir.COMPARISONS and op not in ("min", "max") and dtype == BOOL:
        dtype = INT64  # torch: arithmetic on bools counts them as integers
    if op == "div" and dtype != FLOAT:
        dtype = FLOAT
    if op in ("mod", "fmod", "floordiv", "truncdiv") and isinstance(b, int | float) and b == 0:
        raise trace.fail(f"{what} by the constant 0")
    graph = trace.graph
    node = graph.node(op, (_cast(a, dtype), _cast(b, dtype)),
                      BOOL if op in ir.COMPARISONS else dtype)  # fmt: skip
    return node


def _unary(op: str, x, attrs: tuple = ()):
    trace = _current()
    x = _operand(x, f"`{op}`")
    if not isinstance(x, Node):
        x = _cast(x, FLOAT if isinstance(x, float) else (BOOL if isinstance(x, bool) else INT64))
    if op in ir.UNARY_FLOAT:
        return trace.graph.node(op, (_cast(x, FLOAT),), FLOAT, attrs)
    if op == "not":
        return trace.graph.node("not", (_cast(x, BOOL),), BOOL)
    if op == "invert":
        if x.dtype == FLOAT:
            raise trace.fail("`~` on a floating-point value", "it takes bools and integers")
        return trace.graph.node("not" if x.dtype == BOOL else "invert", (x,), x.dtype)
    if x.dtype == BOOL:
        if op == "abs":
            return x
        raise trace.fail(f"`{op}` on a bool", "cast it first")
    if x.dtype != FLOAT and op in ("floor", "ceil", "trunc"):
        return x  # exact on integers, as in torch
    return trace.graph.node(op, (x,), x.dtype, attrs)


def _where(cond, a, b):
    trace = _current()
    c = _operand(cond, "`where`'s condition")
    if not isinstance(c, Node) or c.dtype != BOOL:
        raise trace.fail("`where` with a condition that is not a bool comparison of traced "
                         "values")  # fmt: skip
    a, b = _operand(a, "`where`"), _operand(b, "`where`")
    if not isinstance(a, Node) and not isinstance(b, Node):
        kinds = {ir.scalar_category(a), ir.scalar_category(b)}
        dtype = FLOAT if 2 in kinds else (INT64 if 1 in kinds else BOOL)
    else:
        dtype = ir.promote(a, b)
    return trace.graph.node("where", (c, _cast(a, dtype), _cast(b, dtype)), dtype)


def _pow(base, exponent):
    trace = _current()
    base, exponent = _operand(base, "`**`"), _operand(exponent, "`**`")
    if isinstance(exponent, Node):
        if isinstance(base, Node):
            raise trace.fail("`**` with a traced exponent and a traced base",
                             "write exp2(y * log2(x)) for x > 0")  # fmt: skip
        if base <= 0:
            raise trace.fail(f"`{base} ** x` with a traced exponent and a base <= 0")
        return _unary("exp2", _binary("mul", _cast(exponent, FLOAT), math.log2(base)))
    if isinstance(exponent, float) and exponent.is_integer():
        exponent = int(exponent) if base.dtype == FLOAT else exponent
    if isinstance(exponent, int) and not isinstance(exponent, bool):
        if base.dtype != FLOAT and exponent < 0:
            raise trace.fail("an integer to a negative integer power (torch refuses it too)")
        if abs(exponent) > 64:
            raise trace.fail(f"`** {exponent}`", "integer powers up to 64")
        dtype = INT64 if base.dtype == BOOL else base.dtype
        return trace.graph.node("pow", (_cast(base, dtype),), dtype, (exponent,))
    # a float exponent: 2^(e log2 x), x > 0 exact in form; x = 0 gives 0 (e > 0) or inf
    x = _cast(base, FLOAT)
    return trace.graph.node("exp2", (_binary("mul", _unary("log2", x), float(exponent)),), FLOAT)


def _clamp(x, min=None, max=None):  # torch's keyword names
    if min is not None:
        x = _binary("max", x, min, "`clamp`")
    if max is not None:
        x = _binary("min", x, max, "`clamp`")
    return _operand(x, "`clamp`")


# ---- captured tensors ---------------------------------------------------------------------------


def _load(tensor: torch.Tensor, index: tuple) -> Node:
    trace = _current()
    name = trace.name(tensor)
    if tensor.device != trace.device:
        raise trace.fail(f"captured tensor `{name}` is on {tensor.device}, the call's tensors "
                         f"on {trace.device}", "move it to their device")  # fmt: skip
    nodes = []
    for i, item in enumerate(index):
        if isinstance(item, Traced):
            node = item.node
        elif isinstance(item, bool):
            raise trace.fail(f"`{name}` indexed with a bool", "index with integers")
        elif isinstance(item, int):
            node = trace.graph.const(item)
        elif isinstance(item, torch.Tensor) and item.dim() == 0 and not item.is_floating_point():
            node = _load(item, ())
        else:
            kind = "a slice" if isinstance(item, slice) else type(item).__name__
            raise trace.fail(f"`{name}` indexed with {kind} in dimension {i}",
                             "index each dimension with one integer expression of b, h, "
                             "q_idx, kv_idx")  # fmt: skip
        if node.dtype == BOOL:
            raise trace.fail(f"`{name}` indexed with a bool (a mask) in dimension {i}",
                             "index with integers; use where() for masks")  # fmt: skip
        if node.dtype == FLOAT:
            raise trace.fail(f"`{name}` indexed with a float in dimension {i}",
                             "cast the index to an integer")  # fmt: skip
        nodes.append(node)
    c = trace.capture(tensor)
    return trace.graph.node("load", tuple(nodes), ir.compute_dtype(tensor.dtype), (c,))


def _getitem(base, index):
    trace = _current()
    if isinstance(base, Traced):
        raise trace.fail("indexing a traced value", "each traced value is one scalar")
    if not isinstance(index, tuple):
        index = (index,)
    if any(item is Ellipsis or item is None for item in index):
        raise trace.fail(f"`{trace.name(base)}` indexed with ... or None",
                         "index every dimension with one integer expression")  # fmt: skip
    if len(index) > base.dim():
        raise trace.fail(f"`{trace.name(base)}` has {base.dim()} dimensions, indexed with "
                         f"{len(index)}")  # fmt: skip
    if len(index) < base.dim():
        return Indexed(base, index, trace.name(base))
    return Traced(_load(base, index))


class Indexed:
    """A captured tensor indexed in its first dimensions only (`table[h]` of `table[h][q]`):
    the next index completes it; any other use is refused."""

    def __init__(self, tensor, index, name):
        self.tensor, self.index, self.name = tensor, tuple(index), name

    def __getitem__(self, more):
        more = more if isinstance(more, tuple) else (more,)
        return _getitem(self.tensor, self.index + more)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise _current().fail(f"`{_name(func)}` on a partly indexed captured tensor",
                              "index every dimension")  # fmt: skip

    def __getattr__(self, attr):
        raise _current().fail(f"`.{attr}` of a partly indexed captured tensor",
                              "index every dimension")  # fmt: skip

    def __bool__(self):
        raise _current().fail("a partly indexed captured tensor in a Python condition")


# ---- torch functions and methods ------------------------------------------------------------


def _name(func) -> str:
    name = getattr(func, "__name__", None) or str(func)
    return name


_DTYPES = {
    torch.float32: FLOAT, torch.float64: FLOAT, torch.float16: "float16",
    torch.bfloat16: "bfloat16", torch.int32: INT32, torch.int64: INT64, torch.bool: BOOL,
}  # fmt: skip


def _to_dtype(x, dtype):
    trace = _current()
    target = _DTYPES.get(dtype)
    if target is None:
        raise trace.fail(f"a cast to {dtype}", "casts go to float16, bfloat16, float32, "
                         "float64 (computed in float32), int32, int64 and bool")  # fmt: skip
    node = _operand(x, "a cast")
    if isinstance(target, str):  # rounded to half precision, computed in float32
        node = _cast(node, FLOAT)
        return trace.graph.node("cast", (node,), FLOAT, (target,))
    return _cast(node, target)


def _to(x, *args, **kwargs):
    dtype = kwargs.get("dtype")
    for arg in args:
        if isinstance(arg, torch.dtype):
            dtype = arg
        elif isinstance(arg, torch.Tensor | Traced):
            dtype = arg.dtype
    return _operand(x, "a cast") if dtype is None else _to_dtype(x, dtype)


def _div(a, b, rounding_mode=None):
    if rounding_mode == "floor":
        return _binary("floordiv", a, b, "`div(rounding_mode='floor')`")
    if rounding_mode == "trunc":
        return _binary("truncdiv", a, b, "`div(rounding_mode='trunc')`")
    return _binary("div", a, b, "`/`")


def _gelu(x, approximate="none"):
    return _unary("gelu_tanh" if approximate == "tanh" else "gelu", x)


def _softplus(x, beta=1.0, threshold=20.0):
    return _unary("softplus", x, (float(beta), float(threshold)))


def _min_max(op):
    def handler(a, b=None, *rest, **kwargs):
        # torch.max(x) and torch.max(x, dim) reduce; torch.max(x, other) is maximum
        if b is None or "dim" in kwargs or (isinstance(b, int) and not isinstance(b, bool)):
            raise _current().fail(f"`{op}` over one value or a dim (a reduction)",
                                  f"use torch.{op}imum(a, b) for two values")  # fmt: skip
        return _binary(op, a, b, f"`{op}`")

    return handler


def _like(value):
    def handler(x, *args, **kwargs):
        _operand(x, "a *_like constructor")
        fill = args[0] if args else kwargs.get("fill_value", value)
        dtype = kwargs.get("dtype")
        node = _cast(fill, x.node.dtype if isinstance(x, Traced) else FLOAT)
        return node if dtype is None else _to_dtype(node, dtype)

    return handler


def _reversed(op):
    return lambda a, b, *rest, **kwargs: _binary(op, b, a)


def _add(a, b, alpha=1):
    return _binary("add", a, b if alpha == 1 else _binary("mul", b, alpha))


def _sub(a, b, alpha=1):
    return _binary("sub", a, b if alpha == 1 else _binary("mul", b, alpha))


def _rsub(a, b, alpha=1):
    return _binary("sub", b, a if alpha == 1 else _binary("mul", a, alpha))


def _binop(op, what=None):
    return lambda a, b, *rest, **kwargs: _binary(op, a, b, what)


def _unop(op):
    return lambda x, *rest, **kwargs: _unary(op, x)


def _cast_to(dtype):
    return lambda x, *rest, **kwargs: _to_dtype(x, dtype)


HANDLERS = {
    "add": _add, "__add__": _add, "__radd__": _reversed("add"),
    "sub": _sub, "subtract": _sub, "__sub__": _sub, "__rsub__": _rsub, "rsub": _rsub,
    "mul": _binop("mul", "`*`"), "multiply": _binop("mul", "`*`"), "__mul__": _binop("mul", "`*`"),
    "__rmul__": _reversed("mul"),
    "div": _div, "divide": _div, "true_divide": _binop("div", "`/`"),
    "__truediv__": _binop("div", "`/`"), "__rtruediv__": _reversed("div"),
    "__div__": _binop("div", "`/`"), "__rdiv__": _reversed("div"),
    "floor_divide": _binop("floordiv", "`//`"), "__floordiv__": _binop("floordiv", "`//`"),
    "__rfloordiv__": _reversed("floordiv"),
    "remainder": _binop("mod", "`%`"), "__mod__": _binop("mod", "`%`"),
    "__rmod__": _reversed("mod"), "fmod": _binop("fmod", "`fmod`"),
    "pow": lambda a, b, **kw: _pow(a, b), "__pow__": lambda a, b, *r, **kw: _pow(a, b),
    "__rpow__": lambda a, b, *r, **kw: _pow(b, a), "float_power": lambda a, b, **kw: _pow(a, b),
    "square": lambda x, **kw: _pow(x, 2),
    "neg": _unop("neg"), "negative": _unop("neg"), "__neg__": _unop("neg"),
    "__pos__": lambda x, **kw: x, "positive": lambda x, **kw: x,
    "abs": _unop("abs"), "absolute": _unop("abs"), "__abs__": _unop("abs"),
    "sign": _unop("sign"), "relu": _unop("relu"), "floor": _unop("floor"), "ceil": _unop("ceil"),
    "trunc": _unop("trunc"), "fix": _unop("trunc"),
    "gelu": _gelu, "softplus": _softplus,
    "minimum": _binop("min", "`minimum`"), "maximum": _binop("max", "`maximum`"),
    "min": _min_max("min"), "max": _min_max("max"),
    "clamp": _clamp, "clip": _clamp,
    "clamp_min": lambda x, lo, **kw: _clamp(x, min=lo),
    "clamp_max": lambda x, hi, **kw: _clamp(x, max=hi),
    "reciprocal": lambda x, **kw: _binary("div", 1.0, x, "`reciprocal`"),
    "where": lambda c, a=None, b=None, **kw: _where(c, a, b),
    "eq": _binop("eq"), "__eq__": _binop("eq"), "ne": _binop("ne"), "__ne__": _binop("ne"),
    "not_equal": _binop("ne"), "lt": _binop("lt"), "__lt__": _binop("lt"), "less": _binop("lt"),
    "le": _binop("le"), "__le__": _binop("le"), "less_equal": _binop("le"),
    "gt": _binop("gt"), "__gt__": _binop("gt"), "greater": _binop("gt"),
    "ge": _binop("ge"), "__ge__": _binop("ge"), "greater_equal": _binop("ge"),
    "logical_and": lambda a, b, **kw: _binary("and", _to_dtype(a, torch.bool),
                                              _to_dtype(b, torch.bool)),
    "logical_or": lambda a, b, **kw: _binary("or", _to_dtype(a, torch.bool),
                                             _to_dtype(b, torch.bool)),
    "logical_xor": lambda a, b, **kw: _binary("xor", _to_dtype(a, torch.bool),
                                              _to_dtype(b, torch.bool)),
    "logical_not": lambda x, **kw: _unary("not", x),
    "bitwise_and": _binop("and", "`&`"), "__and__": _binop("and", "`&`"),
    "__rand__": _reversed("and"), "bitwise_or": _binop("or", "`|`"),
    "__or__": _binop("or", "`|`"), "__ror__": _reversed("or"),
    "bitwise_xor": _binop("xor", "`^`"), "__xor__": _binop("xor", "`^`"),
    "__rxor__": _reversed("xor"), "bitwise_not": _unop("invert"), "__invert__": _unop("invert"),
    "to": _to, "type_as": lambda x, other, **kw: _to_dtype(x, other.dtype),
    "float": _cast_to(torch.float32), "double": _cast_to(torch.float64),
    "half": _cast_to(torch.float16), "bfloat16": _cast_to(torch.bfloat16),
    "int": _cast_to(torch.int32), "long": _cast_to(torch.int64), "bool": _cast_to(torch.bool),
    "zeros_like": _like(0), "ones_like": _like(1), "full_like": _like(None),
    "__getitem__": _getitem,
    "clone": lambda x, **kw: x, "contiguous": lambda x, **kw: x, "detach": _unop("detach"),
}  # fmt: skip
for _op in ir.UNARY_FLOAT:
    if _op not in ("gelu", "gelu_tanh", "softplus"):
        HANDLERS[_op] = _unop(_op)
HANDLERS["special_erf"] = _unop("erf")
HANDLERS["special_expit"] = _unop("sigmoid")
HANDLERS["expit"] = _unop("sigmoid")

_RANDOM = {"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "bernoulli",
           "multinomial", "normal", "poisson", "dropout", "uniform_", "normal_", "random_",
           "exponential_", "bernoulli_", "alpha_dropout", "feature_alpha_dropout", "randperm"}  # fmt: skip
_REDUCTIONS = {"sum", "mean", "prod", "amax", "amin", "std", "var", "norm", "logsumexp",
               "softmax", "log_softmax", "argmax", "argmin", "cumsum", "cumprod", "all", "any",
               "nansum", "median", "mode", "topk", "sort", "count_nonzero"}  # fmt: skip
_CREATION = {"tensor", "as_tensor", "arange", "zeros", "ones", "full", "empty", "linspace",
             "from_numpy", "eye", "empty_like", "new_tensor", "new_zeros", "new_ones",
             "new_full", "new_empty", "scalar_tensor"}  # fmt: skip
# reads of a tensor's metadata and printing: allowed on captured tensors inside the mod (not
# data_ptr or storage_offset: as a constant of the generated code, stale with the next tensor,
# and torch.compile cannot guard on them)
_ACCESSORS = {"__get__", "size", "dim", "numel", "stride", "is_floating_point", "__len__",
              "__repr__", "__format__", "__str__", "element_size", "is_contiguous",
              "__hash__", "ndimension", "nelement"}  # fmt: skip
# accessors and properties whose answer the walk's key holds (rank, dtype, requires_grad:
# captures.tensor_key) or that put no number in the graph (printing, the device); any other
# makes the tensor's shape and strides part of the trace (_reads_layout: `table.shape[1]` is
# a constant of the generated code); one missing here costs a walk per call, never a value
_KEYED_ACCESSORS = {"dim", "ndimension", "is_floating_point", "element_size", "__repr__",
                    "__format__", "__str__", "__hash__"}  # fmt: skip
_KEYED_PROPERTIES = {"dtype", "ndim", "itemsize", "requires_grad", "device", "is_cuda",
                     "is_cpu", "is_meta", "layout", "is_sparse", "is_quantized", "is_leaf"}  # fmt: skip


def _reads_layout(func, name: str) -> bool:
    """Whether an accessor (its name: _name) may answer with a tensor's shape or strides."""
    if name == "__get__":  # a property: its getset descriptor's name (`shape`, `dtype`)
        return getattr(getattr(func, "__self__", None), "__name__", None) not in _KEYED_PROPERTIES
    return name not in _KEYED_ACCESSORS


def _is_inplace(name: str) -> bool:
    return (name.endswith("_") and not name.endswith("__")) or name in (
        "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
        "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "copy_",
    )  # fmt: skip


def _has_traced(values) -> bool:
    for v in values:
        if isinstance(v, Traced | Indexed):
            return True
        if isinstance(v, tuple | list) and _has_traced(v):
            return True
    return False


def _refusal(name: str, trace: _Trace, on_traced: bool) -> ScoreModError:
    if name in _RANDOM:
        return trace.fail(f"the random op `{name}`", "a score_mod must give the same score "
                          "in the forward and the backward's recomputation")  # fmt: skip
    if _is_inplace(name):
        return trace.fail(f"the in-place op `{name}`", "a score_mod may not mutate a "
                          "captured tensor or a traced value: compute a new value")  # fmt: skip
    if name in _REDUCTIONS:
        return trace.fail(f"the reduction `{name}`", "each score is computed on its own; "
                          "reduce outside the mod and capture the result")  # fmt: skip
    if name in _CREATION:
        return trace.fail(f"`torch.{name}` makes a tensor inside the mod",
                          "create it outside and capture it")  # fmt: skip
    if on_traced:
        return trace.fail(f"the op `{name}` is not in the accepted subset",
                          f"see {SUBSET_DOC}")  # fmt: skip
    return trace.fail(f"`{name}` on captured tensors (no traced value involved) is not "
                      "traced", "compute it outside the mod and capture the result")  # fmt: skip


def _torch_call(func, args, kwargs):
    trace = _current()
    name = _name(func)
    if _is_inplace(name) or name in _RANDOM or name in _REDUCTIONS:
        raise _refusal(name, trace, True)
    if func is torch.Tensor.where:  # x.where(cond, other) is where(cond, x, other)
        x, cond, *other = args
        return _wrap(_where(cond, x, other[0] if other else kwargs["other"]))
    handler = HANDLERS.get(name)
    if handler is None:
        raise _refusal(name, trace, True)
    return _wrap(handler(*args, **kwargs))


class _Mode(TorchFunctionMode):
    """Every torch call while the mod runs: those given a traced value are recorded, reads of
    a tensor's metadata run, anything else is refused."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _has_traced(args) or _has_traced(kwargs.values()):
            return _torch_call(func, args, kwargs)
        name = _name(func)
        if name in _ACCESSORS:
            if _reads_layout(func, name):
                read = _current().read_layout
                for a in args:
                    if isinstance(a, torch.Tensor):
                        read.setdefault(id(a), a)
            with torch._C.DisableTorchFunction():
                return func(*args, **kwargs)
        if name == "__getitem__" and isinstance(args[0], torch.Tensor):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if all(isinstance(i, int) for i in index) and len(index) == args[0].dim():
                return Traced(_load(args[0], index))  # a constant entry: read by the kernel
        raise _refusal(name, _current(), False)


class Traced:
    """The stand-in for one traced scalar: operators and methods record nodes."""

    __slots__ = ("node",)

    def __init__(self, node: Node):
        self.node = node

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _torch_call(func, args, kwargs or {})

    # Python's conversions branch or leave the trace: refused with the reason
    def __bool__(self):
        raise _current().fail(
            "Python control flow on a traced value (`if`, `and`/`or`, `min()`/`max()` or a "
            "chained comparison)", "use torch.where, &, |, torch.minimum and torch.maximum",
        )  # fmt: skip

    def item(self):
        raise _current().fail("`.item()` on a traced value", "it has no value at trace time")

    def __int__(self):
        raise _current().fail("int() of a traced value", "use .to(torch.int32) or .long()")

    def __float__(self):
        raise _current().fail("float() (or a math function) of a traced value",
                              "use the torch functions of the subset")  # fmt: skip

    def __index__(self):
        raise _current().fail("a traced value used as a Python index (a list or tuple "
                              "subscript)", "capture the values as a tensor and index it")  # fmt: skip

    def __iter__(self):
        raise _current().fail("iterating over a traced value")

    def __len__(self):
        raise _current().fail("len() of a traced value")

    __hash__ = object.__hash__

    @property
    def dtype(self):
        return torch.float32 if self.node.dtype == FLOAT else self.node.dtype

    @property
    def shape(self):
        return torch.Size([])

    @property
    def device(self):
        return _current().device

    ndim = 0

    def dim(self):
        return 0

    def size(self, dim=None):
        if dim is not None:
            raise _current().fail("size(dim) of a traced value (it is 0-dimensional)")
        return torch.Size([])

    def numel(self):
        return 1

    def __getattr__(self, attr):
        raise _current().fail(f"`.{attr}` of a traced value is not in the accepted subset",
                              f"see {SUBSET_DOC}")  # fmt: skip


def _method(name):
    def method(self, *args, **kwargs):
        return _torch_call(_Named(name), (self, *args), kwargs)

    method.__name__ = name
    return method


class _Named:
    def __init__(self, name):
        self.__name__ = name


_OWN = set(Traced.__dict__)
for _handled in HANDLERS:  # operators and methods record their node
    if _handled not in _OWN:
        setattr(Traced, _handled, _method(_handled))
Traced.where = lambda self, cond, other: _wrap(_where(cond, self, other))
for _inplace in ("add_", "sub_", "mul_", "div_", "clamp_", "__setitem__", "copy_", "fill_"):
    setattr(Traced, _inplace, _method(_inplace))  # refused by name


def trace(fn, names: dict[int, str], device: torch.device):
    """Run fn on stand-ins: -> (the output node as float32, its ir.Graph, the captured tensors
    in capture order, the tensors whose shape or strides the mod read)."""
    t = _Trace(describe_mod(fn), names, device)
    previous = getattr(_STATE, "trace", None)
    _STATE.trace = t
    try:
        inputs = [Traced(t.graph.inputs[n]) for n in ir.INPUTS]
        with _Mode():
            out = fn(*inputs)
        if isinstance(out, Indexed | Traced | torch.Tensor | bool | int | float):
            out = _operand(out, "the mod's result")
        else:
            raise t.fail(f"the mod returned {type(out).__name__}",
                         "it returns one score (a traced value or a number)")  # fmt: skip
        out = _cast(out, FLOAT)
    except TypeError as e:  # a wrong call signature (not 5 positional arguments) or a torch
        # function given a stand-in where it wants a real tensor
        raise ScoreModError(f"score_mod {t.mod}: {e} (a score_mod takes (score, b, h, q_idx, "
                            f"kv_idx); see {SUBSET_DOC})") from e  # fmt: skip
    finally:
        _STATE.trace = previous
    return out, t.graph, t.tensors, list(t.read_layout.values())
