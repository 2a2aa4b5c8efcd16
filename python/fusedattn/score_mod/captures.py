"""What a score_mod closes over, found again on every call without tracing it again.

A call walks the callable's reachable state: its closure cells, the globals its code names,
its defaults, a bound method's object, a partial's arguments, nn.Modules' parameters, buffers
and public attributes, lists, tuples and dicts, nested functions (the helpers a mod calls).
The walk gives

- the structure key: code objects, Python scalars by value, tensors by (dtype, rank,
  requires_grad, whether an offset passes 2^31) only, so the cache never holds a tensor value and a new value in a captured
  tensor is the same key (read by pointer: no new trace, no recompile), while a new scalar
  value (a constant of the generated code) is a new key;
- the tensors it reached, in a fixed order, and a name for each (`bias`, `self.table`) for the
  error messages.

The trace (tracer.py) records which of those tensors the mod read; later calls with the same
key take them from the walk by position. A mod that reads a tensor the walk cannot reach
(made by a helper each call, say) is traced again on every call (correct; slower on the host).
About 2 µs for a closure over one tensor (benchmarks/bench_host.py's score_mod row).
"""

from __future__ import annotations

import functools
import types

import torch

_SCALARS = frozenset(
    (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
)  # a set: `type(v) in _SCALARS` is one hash, not nine comparisons (every value walked)
MAX_DEPTH = 6
MAX_ITEMS = 4096  # values visited per walk: a mod that closes over a whole model stops there
MAX_SEQUENCE = 256  # longer lists, tuples and dicts enter the key as their length only


_NAMES: dict[types.CodeType, tuple[str, ...]] = {}


def wide_offsets(t: torch.Tensor) -> bool:
    """Whether an element offset of t (or of its float32 gradient buffer, t's shape
    contiguous) can pass 2^31 - 1: the generated loads then index in int64, else in int32
    (int64 index math doubled the integer instructions of a gathered bias: sm_90 screen)."""
    if t.numel() >= 2**31:
        return True
    if t.is_contiguous():  # offsets below numel (0.15 µs; the sum below 0.9, every call)
        return False
    return sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride(), strict=True)) >= 2**31


def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """Names a code object (and the functions and comprehensions defined in it) may read
    as globals; cached for eager calls (torch.compile traces the computation instead: its
    guards cannot name a dict entry keyed by a code object)."""
    compiling = torch.compiler.is_compiling()
    found = None if compiling else _NAMES.get(code)
    if found is None:
        names = list(code.co_names)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                names.extend(_global_names(const))
        found = tuple(dict.fromkeys(names))
        if not compiling:
            _NAMES[code] = found
    return found


class Walk:
    """One walk of a callable: key (a tuple), tensors and their names."""

    __slots__ = ("_items", "_key", "_seen", "names", "tensors")

    def __init__(self, fn):
        self._key: list = []
        self.tensors: list[torch.Tensor] = []
        self.names: list[str] = []
        self._seen: dict[int, int] = {}
        self._items = 0
        self._value(fn, getattr(fn, "__name__", "score_mod"), 0)

    @property
    def key(self) -> tuple:
        return tuple(self._key)

    def names_by_id(self) -> dict[int, str]:
        return {id(t): n for t, n in zip(self.tensors, self.names, strict=True)}

    def _value(self, v, name: str, depth: int) -> None:
        key = self._key
        t = type(v)
        if t in _SCALARS:
            key.append(t)
            key.append(v)
            return
        if isinstance(v, torch.Tensor):
            if id(v) in self._seen:
                key.append(("ref", self._seen[id(v)]))
                return
            self._seen[id(v)] = len(self.tensors)
            key.append(("T", v.dtype, v.dim(), v.requires_grad, wide_offsets(v)))
            self.tensors.append(v)
            self.names.append(name)
            return
        self._items += 1
        if depth > MAX_DEPTH or self._items > MAX_ITEMS:
            key.append(("deep", t))
            return
        if id(v) in self._seen:  # a cycle, or one object reached twice
            key.append(("seen", t))
            return
        self._seen[id(v)] = -1
        depth += 1
        if t is types.FunctionType:
            self._function(v, name, depth)
        elif t is types.MethodType:
            key.append("method")
            self._value(v.__self__, "self", depth)
            self._value(v.__func__, name, depth)
        elif t is functools.partial:
            key.append("partial")
            self._value(v.func, name, depth)
            self._value(v.args, f"{name}.args", depth)
            self._value(v.keywords, f"{name}.keywords", depth)
        elif t is list or t is tuple:
            key.append((t, len(v)))
            if len(v) <= MAX_SEQUENCE:
                for i, item in enumerate(v):
                    self._value(item, f"{name}[{i}]", depth)
        elif t is dict:
            key.append((dict, len(v)))
            if len(v) <= MAX_SEQUENCE:
                for k, item in v.items():
                    key.append(k if type(k) in _SCALARS else type(k))
                    self._value(item, f"{name}[{k!r}]", depth)
        elif isinstance(v, torch.nn.Module):
            key.append(("module", t))
            d = v.__dict__
            for group in ("_parameters", "_buffers", "_modules"):
                for k, item in d[group].items():
                    key.append(k)
                    self._value(item, f"{name}.{k}", depth)
            for k, item in d.items():  # public scalar attributes (num_heads, scale, ...)
                if not k.startswith("_") and type(item) in _SCALARS:
                    key.append(k)
                    key.append(item)
        elif t is types.ModuleType:
            key.append(("pymodule", v.__name__))
        elif isinstance(v, type):
            key.append(("class", v))
        elif hasattr(v, "__dict__") and not callable(getattr(type(v), "__get__", None)):
            key.append(("object", t))
            if callable(v) and t.__call__ is not object.__call__:
                self._value(t.__call__, f"{name}.__call__", depth)
            for k, item in vars(v).items():
                key.append(k)
                self._value(item, f"{name}.{k}", depth)
        else:
            try:
                hash(v)
                key.append(("value", t, v))
            except TypeError:
                key.append(("opaque", t))

    def _function(self, fn, name: str, depth: int) -> None:
        key = self._key
        code = fn.__code__
        key.append(code)
        cells = fn.__closure__ or ()
        for var, cell in zip(code.co_freevars, cells, strict=True):
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell (a name assigned later)
                key.append("empty")
                continue
            self._value(contents, var, depth)
        namespace = fn.__globals__
        for var in _global_names(code):
            if var in namespace:
                key.append(var)
                self._value(namespace[var], var, depth)
        if fn.__defaults__:
            self._value(fn.__defaults__, f"{name}.__defaults__", depth)
        if fn.__kwdefaults__:
            self._value(fn.__kwdefaults__, f"{name}.__kwdefaults__", depth)
