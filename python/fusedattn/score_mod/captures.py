"""What a score_mod closes over, found again on every call without tracing it again.

A call walks the callable's reachable state: its closure cells, the globals its code names,
its defaults, a bound method's object (a C method's too: `table.__getitem__`), a partial's
arguments, nn.Modules' forward, parameters, buffers and own attributes (`self._scale`
included), lists, tuples and dicts (OrderedDict, namedtuple: their items), objects' __dict__
and __slots__, nested functions (the helpers a mod calls), static and class methods and
properties a class holds. The walk gives

- the structure key: code objects, Python scalars by value (the scalars a class or a Python
  module met anywhere in the walk holds under a name some code walked reads, `Config.scale`,
  `settings.Config.scale`, an nn.Module's class attribute, included), tensors by (dtype,
  rank, requires_grad, whether an offset passes 2^31) only, so the cache never holds a
  tensor value and a new value in a captured tensor is the same key (read by pointer: no
  new trace, no recompile), while a new scalar value (a constant of the generated code) is
  a new key;
- the tensors it reached, in a fixed order, and a name for each (`bias`, `self.table`) for the
  error messages.

The trace (tracer.py) records which of those tensors the mod read; later calls with the same
key take them from the walk by position. A mod that reads a tensor the walk cannot reach
(made by a helper each call, say), or reaches a value whose contents it cannot read (a numpy
array, a set) or does not (a list longer than MAX_SEQUENCE, a value past MAX_DEPTH or
MAX_ITEMS: Walk.opaque), is traced again on every call (correct; slower on the host).
About 2.3 µs for a closure over one tensor and one int on the CPU machine.

A walk that met only functions (Python and builtin), scalars, tensors, tuples of scalars,
classes and Python modules also records its Guards: every slot it read (a closure cell, a
global, a default, a function's code) with the object found there. While the same function
object's slots hold the same objects, a new walk would give the same key, tensors and
names, so a call with the same function checks those slots instead (Guards.unchanged:
about 0.3 µs for that closure); the captures' layouts (shape, strides, dtype, device,
requires_grad, alignment: a tensor's can change in place) are checked apart
(score_mod._Guarded). Lists, dicts, nn.Modules and other objects can change with no slot
changing, so a mod that reaches one is walked on every call.
"""

from __future__ import annotations

import functools
import itertools
import types
import weakref

import torch

_SCALARS = frozenset(
    (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)
)  # a set: `type(v) in _SCALARS` is one hash, not nine comparisons (every value walked)
MAX_DEPTH = 6
# past these a walk stops reading: the value's contents are not in the key, so the mod is
# traced on every call and refused under torch.compile (Walk.opaque), as a numpy array is
MAX_ITEMS = 4096  # values visited per walk (a mod that closes over a whole model)
MAX_SEQUENCE = 256  # items of one list, tuple or dict


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


def tensor_key(t: torch.Tensor) -> tuple:
    """What a walk's key holds of a captured tensor (never its values)."""
    return ("T", t.dtype, t.dim(), t.requires_grad, wide_offsets(t))


_MISSING = object()  # a global the code names but the module does not hold (yet)
_CELL, _GLOBAL, _DEFAULT = 0, 1, 2  # the kinds of slot a function's walk reads


def static_attribute(holder, name: str):
    """What a class (through its MRO) or a Python module stores under `name`, read without
    running any descriptor; _MISSING if nothing."""
    if type(holder) is types.ModuleType:
        return vars(holder).get(name, _MISSING)
    for klass in holder.__mro__:
        found = vars(klass).get(name, _MISSING)
        if found is not _MISSING:
            return found
    return _MISSING


def _in_torch(module_name) -> bool:
    """Whether a module of this name is torch's own: it holds no state of a mod's (its
    attributes are ops, dtypes and constants), so the walk keys it by identity."""
    return type(module_name) is str and (module_name == "torch" or module_name.startswith("torch."))


def _torchs_own(fn: types.FunctionType) -> bool:
    """Whether fn is one of torch's own module-level Python functions (F.silu, F.relu): the
    trace's TorchFunctionMode sees it at its entry, and it holds no state of the mod's (its
    globals are torch's; walking its helpers' cost 35 us a walk). A closure torch made
    (flex_attention.and_masks(...)) holds the user's functions: walked."""
    return fn.__closure__ is None and _in_torch(fn.__module__)


# functions written in C (torch.tanh, math.exp, torch.Tensor.exp, object.__init__): no state
# of a mod's, keyed and guarded by identity
_C_FUNCTIONS = frozenset((
    types.BuiltinFunctionType, types.WrapperDescriptorType, types.MethodDescriptorType,
    types.ClassMethodDescriptorType,
))  # fmt: skip
_UNBOUND = frozenset((type(None), types.ModuleType, type))  # such a function's __self__


def _c_function(v) -> bool:
    """Whether v is a C function with no state of a mod's: one bound to an object
    (`table.__getitem__`, `(2.0).__mul__`) reads that object, and is walked instead."""
    return type(v) in _C_FUNCTIONS and type(getattr(v, "__self__", None)) in _UNBOUND


# an nn.Module's own bookkeeping (hook dicts; parameters, buffers and submodules are walked
# by name): every other attribute of a module mod is walked, private ones (`self._scale`) too
_MODULE_INTERNALS = frozenset(k for k in vars(torch.nn.Module()) if k.startswith("_"))


_SLOTS: dict[type, tuple] = {}


def _slot_names(t: type) -> tuple:
    """(name, member descriptor) per slot an instance of t has, through its MRO (a
    `__slots__` class keeps its values there, not in a __dict__ the walk reads); cached for
    eager calls as _global_names is (functools.lru_cache makes Dynamo warn)."""
    compiling = torch.compiler.is_compiling()
    found = None if compiling else _SLOTS.get(t)
    if found is None:
        slots = []
        for klass in t.__mro__:
            declared = vars(klass).get("__slots__", ())
            for k in (declared,) if isinstance(declared, str) else declared:
                if k.startswith("__") and not k.endswith("__"):  # private: stored mangled
                    k = f"_{klass.__name__.lstrip('_')}{k}"
                member = vars(klass).get(k)
                if type(member) is types.MemberDescriptorType:
                    slots.append((k, member))
        found = tuple(slots)
        if not compiling:
            _SLOTS[t] = found
    return found


def _scalars_only(v) -> bool:
    return type(v) in _SCALARS or (type(v) is tuple and all(map(_scalars_only, v)))


class Guards:
    """The slots one walk read and the object it found in each, per function it walked:
    (weakref to the function, its __code__, its number of defaults, slots), a slot being
    (kind, cell index / global name / default index, object, whether the object is held by
    weak reference); and attributes, (holder, name, object) per scalar, class or Python
    module that a class or Python module holds under a name the code reads. Functions and
    tensors are held weakly and every slot is reached through its function, so the guards
    keep no capture alive; scalars, scalar tuples, classes, Python modules and builtin
    functions are held as they are."""

    __slots__ = ("attributes", "functions")

    def __init__(self):
        self.functions: list = []
        self.attributes: list = []

    def unchanged(self) -> bool:
        """Whether every slot still holds the object the walk found there (about 0.1 µs a
        slot on the CPU machine)."""
        try:
            for ref, code, defaults_count, slots in self.functions:
                fn = ref()
                if fn is None or fn.__code__ is not code or fn.__kwdefaults__ is not None:
                    return False
                defaults = fn.__defaults__
                if (0 if defaults is None else len(defaults)) != defaults_count:
                    return False
                cells, namespace = fn.__closure__, fn.__globals__
                for kind, where, value, weak in slots:
                    if kind == _CELL:
                        found = cells[where].cell_contents
                    elif kind == _GLOBAL:
                        found = namespace.get(where, _MISSING)
                    else:
                        found = defaults[where]
                    if found is not (value() if weak else value):
                        return False
            for holder, name, value in self.attributes:
                if static_attribute(holder, name) is not value:
                    return False
        except ValueError:  # a cell emptied since (`del name` in the enclosing function)
            return False
        return True


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
    """One walk of a callable: key (a tuple), tensors and their names; guards (Guards, with
    record=True) the slots it read, None where it met a value a slot check cannot vouch
    for (a list, a dict, an nn.Module, another object, a bound method, a partial, a
    keyword default, an empty cell, a walk cut short, anything but a scalar, class, module
    or C function that a class or Python module holds); opaque names the first value met
    whose contents it cannot or does not read (its mod is traced on every call, refused
    under compile)."""

    __slots__ = (
        "_holders", "_items", "_key", "_read", "_seen", "guards", "names", "opaque", "tensors"
    )  # fmt: skip

    def __init__(self, fn, record: bool = False):
        self._key: list = []
        self.tensors: list[torch.Tensor] = []
        self.names: list[str] = []
        self._seen: dict[int, int] = {}  # id -> a tensor's index, or -1 - the order met
        self._items = 0
        self.guards = Guards() if record else None
        self.opaque: str | None = None  # the first value whose contents are not in the key
        # the classes and Python modules met anywhere (and the classes of the objects and
        # nn.Modules walked), and the names every code walked reads: their attributes are
        # keyed once the whole walk has given both (_holder_attributes)
        self._holders: list = []
        self._read: list[tuple[str, ...]] = []  # per function walked
        self._value(fn, getattr(fn, "__name__", "score_mod"), 0)
        self._holder_attributes()

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
            key.append(tensor_key(v))
            self.tensors.append(v)
            self.names.append(name)
            return
        self._items += 1
        if depth > MAX_DEPTH or self._items > MAX_ITEMS:
            key.append(("deep", t))
            self._unread(name, t, f"past the walk's {MAX_DEPTH} levels or {MAX_ITEMS} values")
            return
        seen = self._seen.get(id(v))
        if seen is not None:  # a cycle, or one object reached twice: which one, by when it
            key.append(("seen", seen))  # was first met (by type, `cfg = cfgs[1]` kept cfgs[0]'s)
            return
        self._seen[id(v)] = -1 - len(self._seen)  # (tensors: their index, >= 0)
        depth += 1
        if t is types.FunctionType:
            if _torchs_own(v):  # an op to the tracer, as a builtin: keyed by identity
                key.append(("value", t, v))
            else:
                self._function(v, name, depth)
            return
        if t is tuple:  # immutable: its items are the ones walked (guarded by their own kinds)
            self._items_of(v, t, name, depth)
            return
        if t is types.ModuleType:
            key.append(("pymodule", v.__name__))
            if not _in_torch(v.__name__):  # (torch.tanh's holder: 1.9 us a walk for nothing)
                self._holders.append(v)  # (unique: _seen)
            return
        if isinstance(v, type):
            key.append(("class", v))
            self._holders.append(v)
            return
        # torch.tanh, math.exp, torch.Tensor.exp: no state of their own (_c_function inline)
        if t in _C_FUNCTIONS and type(getattr(v, "__self__", None)) in _UNBOUND:
            key.append(("value", t, v))
            return
        self.guards = None  # its contents can change with no slot changing
        if t is types.MethodType:
            key.append("method")
            self._value(v.__self__, "self", depth)
            self._value(v.__func__, name, depth)
        elif t in _C_FUNCTIONS or t is types.MethodWrapperType:  # bound: `table.__getitem__`
            key.append(("method", t, v.__name__))
            self._value(v.__self__, f"{name}.__self__", depth)
        elif t is functools.partial:
            key.append("partial")
            self._value(v.func, name, depth)
            self._value(v.args, f"{name}.args", depth)
            self._value(v.keywords, f"{name}.keywords", depth)
        elif isinstance(v, (list, tuple, dict)):  # a namedtuple's, an OrderedDict's items too
            self._items_of(v, t, name, depth)
        elif isinstance(v, torch.nn.Module):
            key.append(("module", t))
            self._hold(t)  # class attributes its code reads (softcap = 30.0)
            forward = getattr(t, "forward", None)
            if type(forward) is types.FunctionType:  # its globals, helpers, defaults
                self._value(forward, f"{name}.forward", depth)
            d = v.__dict__
            for group in ("_parameters", "_buffers", "_modules"):
                for k, item in d[group].items():
                    key.append(k)
                    self._value(item, f"{name}.{k}", depth)
            for k, item in d.items():  # its own attributes (num_heads, self._scale, config)
                if k not in _MODULE_INTERNALS:
                    key.append(k)
                    self._value(item, f"{name}.{k}", depth)
        elif t is staticmethod or t is classmethod:  # a class's helper read by name
            key.append(t)
            self._value(v.__func__, name, depth)
        elif t is property:  # `self.scale` computed: its getter's reads
            key.append(t)
            self._value(v.fget, f"{name}.fget", depth)
        elif hasattr(v, "__dict__") and not callable(getattr(type(v), "__get__", None)):
            key.append(("object", t))
            self._hold(t)  # class attributes read through the instance
            if callable(v) and t.__call__ is not object.__call__:
                self._value(t.__call__, f"{name}.__call__", depth)
            for k, item in vars(v).items():
                key.append(k)
                self._value(item, f"{name}.{k}", depth)
            self._slots(v, t, name, depth)
        elif _slot_names(t):  # a slotted object (dataclass(slots=True)): its slots' values
            key.append(("object", t))
            self._hold(t)
            self._slots(v, t, name, depth)
        else:
            try:
                hash(v)
                key.append(("value", t, v))
            except TypeError:  # a numpy array, a set: its contents unseen, traced every call
                key.append(("opaque", t))
                self._unread(name, t, "whose contents the walk cannot see (no __dict__ or "
                             "__slots__, not hashable by value)")  # fmt: skip

    def _unread(self, name: str, t: type, why: str) -> None:
        """A value whose contents are not in the key (a new value there may be the same
        key): the mod is traced again on every call and refused under torch.compile."""
        self.guards = None
        if self.opaque is None:
            self.opaque = f"`{name}` ({t.__qualname__}), {why}"

    def _items_of(self, v, t: type, name: str, depth: int) -> None:
        """A list's, tuple's or dict's items (a subclass's too: a namedtuple, an OrderedDict,
        a defaultdict, their items and not their __dict__); past MAX_SEQUENCE unread."""
        key = self._key
        key.append((t, len(v)))
        if len(v) > MAX_SEQUENCE:  # (the length alone kept a changed weights[5]: 2.4 error)
            self._unread(name, t, f"longer than the {MAX_SEQUENCE} items a walk reads")
        elif isinstance(v, dict):
            for k, item in v.items():  # (a tuple key by type alone: swapped keys kept one)
                key.append(k if _scalars_only(k) else type(k))
                self._value(item, f"{name}[{k!r}]", depth)
        else:
            for i, item in enumerate(v):
                self._value(item, f"{name}[{i}]", depth)

    def _slots(self, v, t: type, name: str, depth: int) -> None:
        for k, member in _slot_names(t):
            try:
                item = member.__get__(v, t)
            except AttributeError:  # a slot never assigned
                self._key.append((k, "unset"))
                continue
            self._key.append(k)
            self._value(item, f"{name}.{k}", depth)

    def _function(self, fn, name: str, depth: int) -> None:
        key = self._key
        code = fn.__code__
        key.append(code)
        defaults = fn.__defaults__
        record = None
        if self.guards is not None:
            if fn.__kwdefaults__ is not None:  # a dict: its entries can change
                self.guards = None
            else:
                record = (weakref.ref(fn), code, 0 if defaults is None else len(defaults), [])
                self.guards.functions.append(record)
        names = _global_names(code)  # globals, and the attribute names the code reads
        self._read.append(names)
        cells = fn.__closure__ or ()
        for i, (var, cell) in enumerate(zip(code.co_freevars, cells, strict=True)):
            try:
                contents = cell.cell_contents
            except ValueError:  # an empty cell (a name assigned later)
                key.append("empty")
                self.guards = None
                continue
            self._slot(record, _CELL, i, contents)
            self._value(contents, var, depth)
        namespace = fn.__globals__
        for var in names:
            value = namespace.get(var, _MISSING)
            self._slot(record, _GLOBAL, var, value)
            if value is not _MISSING:
                key.append(var)
                self._value(value, var, depth)
        if defaults:
            for i, item in enumerate(defaults):
                self._slot(record, _DEFAULT, i, item)
            self._value(defaults, f"{name}.__defaults__", depth)
        if fn.__kwdefaults__:
            self._value(fn.__kwdefaults__, f"{name}.__kwdefaults__", depth)

    def _holder_attributes(self) -> None:
        """The scalars a class or Python module met anywhere in the walk holds under a name
        some code walked reads (`Config.scale`, `math.pi`, `cfgs[0].scale`, `self.cfg.scale`
        with cfg a class, an nn.Module's class attribute): the trace makes them constants,
        so they enter the key (a new value is a new structure, as a captured scalar's) and
        the guards; and the classes and modules such a holder holds under a read name
        (`settings.Config.scale`), whose own attributes follow the same way. Anything else
        held there (`Config.table`, `Config.weights[1]`, `settings.CONFIG.softcap`,
        `helpers.softcap(s)`, a method `self.bias(h)`, a staticmethod, a property) is walked
        as a closure's would be, and the mod is walked on every call (the guards would hold
        it); torch's own functions are keyed by identity (_torchs_own)."""
        holders = self._holders
        if not holders:
            return
        read = self._read  # one tuple per function walked
        # rounds until nothing new: a function walked below (a helper method, a
        # classmethod) reads names of its own, which the holders already checked may hold
        # (`cls.k`), and a holder found below is checked against every name
        checked_names, checked_holders, functions = frozenset(), 0, -1
        while True:
            if len(read) != functions:
                names, functions = frozenset(itertools.chain(*read)), len(read)
            if checked_holders == len(holders) and names is checked_names:
                return
            fresh, end = names - checked_names, len(holders)
            for i in range(end):
                wanted = names if i >= checked_holders else fresh
                if wanted:
                    self._attributes_of(holders[i], wanted)
            checked_names, checked_holders = names, end

    def _attributes_of(self, holder, names: frozenset) -> None:
        """Key (and guard, or walk) what one holder stores under these read names."""
        # the read names it holds: a C-level intersection per dict (a helper of torch's
        # walked reads ~40 names, torch holds ~1500; a loop over names cost 4 holders x
        # 38 names of static_attribute, 60 us a walk)
        if type(holder) is types.ModuleType:
            hits = vars(holder).keys() & names
        else:
            hits = set()
            for klass in holder.__mro__:
                hits |= vars(klass).keys() & names
        for attribute in sorted(hits):
            value = static_attribute(holder, attribute)
            if value is holder:
                continue
            t = type(value)
            if _scalars_only(value) or _c_function(value):
                pass  # keyed by value (a C function by identity) and guarded
            elif isinstance(value, type) or t is types.ModuleType:
                if t is not types.ModuleType or not _in_torch(value.__name__):
                    self._hold(value)
            elif t is types.FunctionType and _torchs_own(value):
                pass
            elif t is types.MemberDescriptorType or t is types.GetSetDescriptorType:
                continue  # a slot, a C field: the instance's own values are walked
            else:  # a tensor, a helper, a list, a dict, an object, a property, ...
                self.guards = None
                self._key.append(("attribute", attribute))
                self._value(value, f"{holder.__name__}.{attribute}", 1)
                continue
            self._key.append(("attribute", attribute, value))
            if self.guards is not None:
                self.guards.attributes.append((holder, attribute, value))

    def _hold(self, holder) -> None:
        """A class or Python module whose read attributes _holder_attributes keys (once)."""
        if id(holder) not in self._seen:
            self._seen[id(holder)] = -1 - len(self._seen)
            self._holders.append(holder)

    def _slot(self, record, kind: int, where, value) -> None:
        """Guard one slot of a function being walked (record: its Guards entry)."""
        if self.guards is None or record is None:
            return
        if (
            value is _MISSING
            or _scalars_only(value)
            or isinstance(value, type)
            or type(value) is types.ModuleType
            or _c_function(value)
        ):
            record[3].append((kind, where, value, False))
        elif isinstance(value, torch.Tensor) or type(value) is types.FunctionType:
            record[3].append((kind, where, weakref.ref(value), True))
        else:  # a container or an object: the walk drops the guards when it meets it
            self.guards = None
