"""score_mod's guards (issue #84, the host cost of a cached mod): a call with the same function
object checks the slots its last walk read (closure cells, globals, its code and defaults)
instead of walking it again. Whatever changes, prepare() must give what a full walk gives:
the same traced graph, the same capture objects, the same names, the same refusals.

Host-side only (prepare() traces; no kernel runs): each case changes one thing a walk reads
and compares the guarded answer with a fresh walk's.
"""

from __future__ import annotations

import gc
import weakref
from typing import ClassVar

import pytest
import torch

import fusedattn
import fusedattn.score_mod as score_mod_package
from fusedattn.score_mod import ScoreModError
from fusedattn.score_mod.captures import Walk

CPU = torch.device("cpu")


def _primed(fn):
    """prepare(fn) until its guards are recorded (at its second walk), -> the ScoreMod."""
    score_mod_package.prepare(fn, CPU)
    mod = score_mod_package.prepare(fn, CPU)
    assert id(fn) in score_mod_package._GUARDED
    return mod


def _walked(fn):
    """What a full walk gives now (the guarded entry dropped first)."""
    score_mod_package._GUARDED.pop(id(fn), None)
    return score_mod_package.prepare(fn, CPU)


def _same(a, b) -> None:
    assert a.compiled is b.compiled
    assert len(a.tensors) == len(b.tensors)
    assert all(x is y for x, y in zip(a.tensors, b.tensors, strict=True))
    assert a.names == b.names


@pytest.fixture
def walks(monkeypatch):
    """Counts full walks (captures.Walk built by prepare)."""
    count = []

    class Counting(Walk):
        __slots__ = ()

        def __init__(self, *args, **kwargs):
            count.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(score_mod_package, "Walk", Counting)
    return count


def _closure(table, alpha):
    """A mod over a closure cell holding a tensor and one holding a float, with setters."""

    def mod(s, b, h, q, kv):
        return s * alpha + table[h, q - kv + 9]

    def set_table(t):
        nonlocal table
        table = t

    def set_alpha(a):
        nonlocal alpha
        alpha = a

    return mod, set_table, set_alpha


def test_the_same_function_is_walked_twice_while_its_slots_hold(walks):
    """Its guards are recorded at its second walk (a mod defined anew in each forward is
    walked once: recording its guards would cost that call more than it saves)."""
    table = torch.randn(2, 20)
    mod, _, _ = _closure(table, 0.5)
    first = score_mod_package.prepare(mod, CPU)
    assert id(mod) not in score_mod_package._GUARDED
    for _ in range(3):
        _same(score_mod_package.prepare(mod, CPU), first)
    assert len(walks) == 2
    for _ in range(3):  # new closures of the same code: one walk each, no guards kept
        fresh, _, _ = _closure(table, 0.5)
        _same(score_mod_package.prepare(fresh, CPU), first)
        assert id(fresh) not in score_mod_package._GUARDED
    assert len(walks) == 5


def test_a_rebound_cell_is_seen_tensor_dtype_and_scalar(walks):
    mod, set_table, set_alpha = _closure(torch.randn(2, 20), 0.5)
    first = _primed(mod)
    new = torch.randn(2, 20)
    set_table(new)  # same layout, new tensor: the same graph, the new capture
    got = score_mod_package.prepare(mod, CPU)
    assert got.tensors[0] is new and got.compiled is first.compiled
    _same(got, _walked(mod))
    _primed(mod)
    set_table(new.double())  # another dtype: another graph (its load casts)
    got = score_mod_package.prepare(mod, CPU)
    assert got.compiled is not first.compiled
    _same(got, _walked(mod))
    _primed(mod)
    set_alpha(0.25)  # a scalar is a constant of the graph
    got = score_mod_package.prepare(mod, CPU)
    assert "0.25" in got.name
    _same(got, _walked(mod))


def test_a_capture_changed_in_place_is_seen():
    table = torch.randn(2, 20)
    mod, _, _ = _closure(table, 0.5)
    first = _primed(mod)
    table.data = torch.randn(2, 20, dtype=torch.float64)  # same object, another dtype
    got = score_mod_package.prepare(mod, CPU)
    assert got.compiled is not first.compiled
    _same(got, _walked(mod))
    _primed(mod)
    table.requires_grad_()  # the key holds requires_grad: checked, not assumed
    _same(score_mod_package.prepare(mod, CPU), _walked(mod))


def test_globals_code_defaults_and_helpers_are_guarded():
    space = {"torch": torch, "table": torch.randn(2, 20), "helper": lambda x: x * 2}
    exec(
        "def mod(s, b, h, q, kv, off=9):\n"
        "    return helper(s) + table[h, abs(q - kv) + off]\n"
        "def other(s, b, h, q, kv, off=9):\n"
        "    return helper(s) - table[h, abs(q - kv) + off]\n",
        space,
    )
    mod = space["mod"]
    first = _primed(mod)
    space["table"] = new = torch.randn(2, 20)  # a rebound global
    got = score_mod_package.prepare(mod, CPU)
    assert got.tensors[0] is new
    _same(got, _walked(mod))
    _primed(mod)
    space["helper"] = lambda x: x * 3  # a rebound helper function
    got = score_mod_package.prepare(mod, CPU)
    assert got.compiled is not first.compiled
    _same(got, _walked(mod))
    _primed(mod)
    space["abs"] = lambda x: x  # a global that shadows a builtin now
    got = score_mod_package.prepare(mod, CPU)
    assert "abs" not in got.name
    _same(got, _walked(mod))
    _primed(mod)
    mod.__defaults__ = (4,)  # new defaults
    got = score_mod_package.prepare(mod, CPU)
    _same(got, _walked(mod))
    _primed(mod)
    mod.__code__ = space["other"].__code__  # new code
    got = score_mod_package.prepare(mod, CPU)
    assert "sub" in got.name
    _same(got, _walked(mod))


def test_containers_and_objects_are_walked_on_every_call(walks):
    """A list's items (or a module's parameters) change with no slot changing."""
    tables = [torch.randn(2, 20)]

    def listed(s, b, h, q, kv):
        return s + tables[0][h, q - kv + 9]

    score_mod_package.prepare(listed, CPU)
    score_mod_package.prepare(listed, CPU)
    assert id(listed) not in score_mod_package._GUARDED
    tables[0] = new = torch.randn(2, 20)
    assert score_mod_package.prepare(listed, CPU).tensors[0] is new
    module = torch.nn.Module()
    module.bias = torch.nn.Parameter(torch.randn(2, 20))

    def from_module(s, b, h, q, kv):
        return s + module.bias[h, q - kv + 9]

    score_mod_package.prepare(from_module, CPU)
    score_mod_package.prepare(from_module, CPU)
    module.bias = new = torch.nn.Parameter(torch.randn(2, 20))
    assert score_mod_package.prepare(from_module, CPU).tensors[0] is new
    assert len(walks) == 6


def test_the_guards_keep_no_capture_alive():
    table = torch.randn(2, 20)
    mod, set_table, _ = _closure(table, 0.5)
    _primed(mod)
    ref = weakref.ref(table)
    del table
    set_table(torch.randn(2, 20))
    gc.collect()
    assert ref() is None
    mod, _, _ = _closure(torch.randn(2, 20), 0.5)  # an old entry of a dead function
    _primed(mod)
    entry = score_mod_package._GUARDED[id(mod)]
    del mod
    gc.collect()
    assert entry.fn() is None and all(r() is None for r in entry.captures)


def test_a_capture_on_another_device_is_refused_after_a_guarded_call():
    table = torch.randn(2, 20)
    mod, set_table, _ = _closure(table, 0.5)
    _primed(mod)
    with pytest.raises(ScoreModError, match="captured tensor `table` is on cpu"):
        score_mod_package.prepare(mod, torch.device("meta"))
    _primed(mod)
    set_table(torch.empty(2, 20, device="meta"))
    with pytest.raises(ScoreModError, match="captured tensor `table` is on meta"):
        score_mod_package.prepare(mod, CPU)


@pytest.mark.kernels
def test_a_planned_call_reads_a_rebound_capture(kernel_device):
    """End to end on the Triton kernels: the same function over three calls (the second
    planned, the third guarded too), its table rebound before each."""
    device = torch.get_default_device()
    q, k, v = (torch.randn(1, 2, 10, 16, device=device) for _ in range(3))
    mod, set_table, _ = _closure(torch.randn(2, 20, device=device), 0.5)
    for _ in range(3):
        table = torch.randn(2, 20, device=device)
        set_table(table)
        got = fusedattn.attention(q, k, v, score_mod=mod, backend="triton")
        want = fusedattn.reference.attention(q.double(), k.double(), v.double(),
                                             score_mod=mod)  # fmt: skip
        torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)


def test_a_captures_layout_is_a_plans_meta():
    """ScoreMod.layouts stand for ops/core/plans.meta in a flex plan's key."""
    from fusedattn.ops.core.plans import meta

    base = torch.randn(4, 6, dtype=torch.float64)
    for t in (base, base[:, 1:], base.t(), base.float().requires_grad_(), torch.randn(())):
        assert score_mod_package.capture_layout(t) == meta(t)


def test_the_compile_time_lookup_finds_a_structure_the_cache_dropped():
    """torch.compile's lookup (_trace_while_compiling) reads the structure cache; a guarded
    function whose structure was dropped from it (least recently used) is walked again."""
    mod, _, _ = _closure(torch.randn(2, 20), 0.5)
    _primed(mod)
    score_mod_package._STRUCTURES.clear()
    name, positions, names, read = score_mod_package._trace_while_compiling(mod, "cpu")
    assert positions == (0,) and names == ("table",) and "load" in name and read == ()


class _Base:
    scale = 2.0


class _Config(_Base):
    pass


def test_a_scalar_a_class_or_module_holds_is_part_of_the_structure():
    """`Config.scale` or `module.alpha` read by a mod is a constant of its trace: a new
    value is a new structure, through the walk and through the guards (a class attribute,
    one inherited and then shadowed, a module attribute); before 2026-12-07 the walk keyed
    a class or module by its identity alone and a changed value kept the old trace."""
    import types

    space = types.ModuleType("settings")
    space.alpha = 1.0

    def mod(s, b, h, q, kv):
        return s * _Config.scale + space.alpha

    first = _primed(mod)
    assert "2.0" in first.name and "1.0" in first.name
    changes = ((lambda: setattr(_Base, "scale", 0.5), "0.5"),
               (lambda: setattr(_Config, "scale", 3.0), "3.0"),
               (lambda: setattr(space, "alpha", 0.25), "0.25"))  # fmt: skip
    try:
        for change, constant in changes:
            change()
            got = score_mod_package.prepare(mod, CPU)  # the guards' answer
            assert constant in got.name, (constant, got.name)
            _same(got, _walked(mod))  # the walk's
            _primed(mod)
    finally:
        _Base.scale = 2.0
        if "scale" in vars(_Config):
            del _Config.scale


class _Held:
    scale = 2.0


_SOFTCAP = 4.0  # a global the forward of an nn.Module mod reads
_OFFSET = 1.0  # a global a method of that module reads


class _ConfigObject:
    def __init__(self):
        self.scale = 2.0


class _ModuleMod(torch.nn.Module):
    bias_scale = 2.0  # a class attribute read through self

    def __init__(self):
        super().__init__()
        self.cfg = _ConfigObject()  # an object attribute (a model's config)
        self.table = torch.randn(2, 20)  # a plain tensor attribute: a named capture

    def forward(self, s, b, h, q, kv):
        scaled = (s * self.cfg.scale + _SOFTCAP) * self.bias_scale
        return scaled + self.offset() + self.table[h, q - kv + 9]

    def offset(self):  # a helper method: found by its name on the class, walked
        return _OFFSET


class _HoldsObject:
    inner = _ConfigObject()  # an object a class holds (Config.inner.scale)
    table = torch.randn(2, 20)  # a tensor a class holds: a capture, found by the walk


class _CallableMod:
    scale = 2.0  # a class attribute a callable object's __call__ reads through self

    def __call__(self, s, b, h, q, kv):
        return s * self.scale


def _set_softcap(value):
    global _SOFTCAP
    _SOFTCAP = value


def _set_offset(value):
    global _OFFSET
    _OFFSET = value


def test_a_scalar_read_however_deep_the_holder_is_part_of_the_structure(monkeypatch):
    """The holders the walk meets anywhere key their read scalars, not only those in a
    function's own slots: a class inside a tuple, a class a Python module holds
    (`settings.Chained.scale`, a name no global shadows), a helper function another module
    holds (its globals, a class it reads), a closure torch made (torch's own module-level
    functions are keyed by identity, a closure is not), an object a class holds, and an
    nn.Module mod's forward globals, helper method, class attributes and config object.
    Before 2026-12-08 each of these kept the old trace's constant when the value changed (a
    silent wrong answer), and a tensor a class holds was traced again on every call."""
    import types

    held = (_Held,)
    space = types.ModuleType("settings")
    space.Chained = type("Chained", (), {"scale": 2.0})
    space.K, space.Scales = 2.0, type("Scales", (), {"first": 2.0})
    exec("def softcap(s):\n    return s * K * Scales.first", vars(space))  # another module's
    assert "Chained" not in globals() and "softcap" not in globals()

    def in_tuple(s, b, h, q, kv):
        return s * held[0].scale

    def in_module(s, b, h, q, kv):
        return s * space.Chained.scale

    def module_helper(s, b, h, q, kv):
        return space.softcap(s)

    torch_made, _, set_alpha = _closure(torch.randn(2, 20), 0.5)
    torch_made.__module__ = "torch.nn.attention.flex_attention"  # as and_masks' closures

    def in_class_object(s, b, h, q, kv):  # no tensor: a mod reading one is traced anew
        return s * _HoldsObject.inner.scale

    def in_class_tensor(s, b, h, q, kv):
        return s + _HoldsObject.table[h, q - kv + 9]

    module_mod = _ModuleMod()
    cases = (  # (mod, change, constant the new graph holds, whether the guards serve it)
        (in_tuple, lambda: setattr(_Held, "scale", 0.375), "0.375", False),  # walked
        (in_module, lambda: setattr(space.Chained, "scale", 0.625), "0.625", True),
        (in_module, lambda: setattr(space, "Chained", type("C", (), {"scale": 1.125})),
         "1.125", True),
        (module_helper, lambda: setattr(space, "K", 0.5625), "0.5625", False),
        (module_helper, lambda: setattr(space.Scales, "first", 0.6875), "0.6875", False),
        (torch_made, lambda: set_alpha(0.9375), "0.9375", True),
        (in_class_object, lambda: setattr(_HoldsObject.inner, "scale", 0.75), "0.75", False),
        (_CallableMod(), lambda: setattr(_CallableMod, "scale", 0.8125), "0.8125", False),
        (module_mod, lambda: _set_softcap(0.875), "0.875", False),
        (module_mod, lambda: _set_offset(0.4375), "0.4375", False),
        (module_mod, lambda: setattr(_ModuleMod, "bias_scale", 1.375), "1.375", False),
        (module_mod, lambda: setattr(module_mod.cfg, "scale", 1.625), "1.625", False),
        (module_mod.forward, lambda: setattr(module_mod.cfg, "scale", 1.875), "1.875", False),
    )  # fmt: skip
    try:
        for mod, change, constant, guarded in cases:
            before = _primed(mod) if guarded else score_mod_package.prepare(mod, CPU)
            assert constant not in before.name
            change()
            got = score_mod_package.prepare(mod, CPU)
            assert constant in got.name, (constant, got.name)
            assert got.compiled is not before.compiled
            _same(got, _walked(mod))
        assert [n.split(".")[-1] for n in got.names] == ["table"]
        assert got.tensors[0] is module_mod.table
        first = score_mod_package.prepare(in_class_tensor, CPU)  # a capture the walk finds:
        assert first.names == ["_HoldsObject.table"]
        traces = []  # not traced again on every call
        trace = score_mod_package.trace
        monkeypatch.setattr(score_mod_package, "trace", lambda *a: traces.append(1) or trace(*a))
        _HoldsObject.table = new = torch.randn(2, 20)
        got = score_mod_package.prepare(in_class_tensor, CPU)
        assert got.tensors[0] is new and got.compiled is first.compiled and not traces
    finally:
        _Held.scale = _ModuleMod.bias_scale = _HoldsObject.inner.scale = _CallableMod.scale = 2.0
        _set_softcap(4.0)
        _set_offset(1.0)


_SCALE = 2.0  # a global a staticmethod reads
_GAIN = 1.0  # a global a property reads


class _Containers:
    """What a class can hold that is neither a scalar nor a tensor: each read by a mod."""

    weights: ClassVar[list] = [0.5, 2.0]
    params: ClassVar[dict] = {"scale": 2.0}
    k = 2.0

    @staticmethod
    def scaled(s):
        return s * _SCALE

    @classmethod
    def by_class(cls, s):  # reads cls.k: a name only this function reads
        return s * cls.k

    def helper(self):  # reads self.k on the class: found after the class was checked
        return self.k


class _Slotted:
    __slots__ = ("__hidden", "scale")

    def __init__(self):
        self.scale = 2.0
        self.__hidden = 1.0

    def value(self):
        return self.scale + self.__hidden


class _PrivateModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self._alpha = 2.0  # a private float: walked as the public ones
        self._weights = {"w": 2.0}

    @property
    def alpha(self):  # computed from a private attribute and a global
        return self._alpha * _GAIN

    def forward(self, s, b, h, q, kv):
        return s * self.alpha + self._weights["w"]


def _set_scale(value):
    global _SCALE
    _SCALE = value


def _set_gain(value):
    global _GAIN
    _GAIN = value


def test_what_a_holder_keeps_in_a_container_descriptor_or_slot_is_part_of_the_structure():
    """Reads that go through a list or dict a class holds, a staticmethod, a classmethod or
    helper method reading its class, a property over a private nn.Module attribute, a
    slotted object (private slot included), an OrderedDict, a defaultdict, a bound C method
    (`table.__getitem__`), a namedtuple over a list: a new value is a new structure. Before 2026-12-08 each kept the
    old trace's constant (a silent wrong answer: the walk skipped what a class held unless
    it was a scalar, tensor, plain object or function, read a module's public attributes
    only, saw no slots, keyed a dict subclass or bound method by identity)."""
    import collections

    holds = _Containers()
    slotted = _Slotted()
    module_mod = _PrivateModule()
    ordered = collections.OrderedDict(a=2.0)
    default = collections.defaultdict(float, a=2.0)
    table = [2.0]
    get = table.__getitem__
    named = collections.namedtuple("Named", "weights")([2.0])  # a tuple subclass over a list
    mods = {
        "list": lambda s, b, h, q, kv: s * _Containers.weights[1],
        "dict": lambda s, b, h, q, kv: s * _Containers.params["scale"],
        "static": lambda s, b, h, q, kv: _Containers.scaled(s),
        "classmethod": lambda s, b, h, q, kv: _Containers.by_class(s),
        "helper": lambda s, b, h, q, kv: s * holds.helper(),
        "slots": lambda s, b, h, q, kv: s * slotted.value(),
        "ordered": lambda s, b, h, q, kv: s * ordered["a"],
        "default": lambda s, b, h, q, kv: s * default["a"],
        "bound": lambda s, b, h, q, kv: s * get(0),
        "named": lambda s, b, h, q, kv: s * named.weights[0],
    }
    cases = (
        (mods["list"], lambda: _Containers.weights.__setitem__(1, 0.375), "0.375"),
        (mods["dict"], lambda: _Containers.params.__setitem__("scale", 0.625), "0.625"),
        (mods["static"], lambda: _set_scale(0.875), "0.875"),
        (mods["classmethod"], lambda: setattr(_Containers, "k", 0.8125), "0.8125"),
        (mods["helper"], lambda: setattr(_Containers, "k", 0.5625), "0.5625"),
        (mods["slots"], lambda: setattr(slotted, "scale", 0.6875), "1.6875"),  # + 1.0
        (mods["slots"], lambda: setattr(slotted, "_Slotted__hidden", 0.25), "0.9375"),
        (module_mod, lambda: setattr(module_mod, "_alpha", 0.4375), "0.4375"),
        (module_mod, lambda: module_mod._weights.__setitem__("w", 0.3125), "0.3125"),
        (module_mod, lambda: _set_gain(0.5), "0.21875"),  # 0.4375 * 0.5
        (mods["ordered"], lambda: ordered.__setitem__("a", 0.1875), "0.1875"),
        (mods["default"], lambda: default.__setitem__("a", 0.4375), "0.4375"),
        (mods["bound"], lambda: table.__setitem__(0, 0.8125), "0.8125"),
        (mods["named"], lambda: named.weights.__setitem__(0, 0.6875), "0.6875"),
    )  # fmt: skip
    try:
        for mod, change, constant in cases:
            score_mod_package.prepare(mod, CPU)
            before = score_mod_package.prepare(mod, CPU)
            assert constant not in before.name, constant
            change()
            got = score_mod_package.prepare(mod, CPU)
            assert constant in got.name, (constant, got.name)
            assert got.compiled is not before.compiled
            _same(got, _walked(mod))
            assert Walk(mod).opaque is None  # read into, not traced again on every call
    finally:
        _Containers.weights[1], _Containers.params["scale"], _Containers.k = 2.0, 2.0, 2.0
        _set_scale(2.0)
        _set_gain(1.0)


def test_a_value_the_walk_cannot_read_into_is_traced_on_every_call(monkeypatch):
    """A numpy array (no __dict__ or __slots__, not hashable): its contents are not in the
    key, so the mod is traced again on each call (a changed value is seen) and refused by
    name under torch.compile, whose graph would keep the first call's constants."""
    import numpy as np

    values = np.array([2.0, 3.0])

    def mod(s, b, h, q, kv):
        return s * float(values[0])

    traces = []
    trace = score_mod_package.trace
    monkeypatch.setattr(score_mod_package, "trace", lambda *a: traces.append(1) or trace(*a))
    assert "2.0" in score_mod_package.prepare(mod, CPU).name
    values[0] = 0.375
    assert "0.375" in score_mod_package.prepare(mod, CPU).name
    assert len(traces) == 2
    guarded = score_mod_package._GUARDED.get(id(mod))  # (an id a freed mod had is reused)
    assert guarded is None or guarded.fn() is not mod
    with pytest.raises(ScoreModError, match=r"`values` \(ndarray\).*cannot see"):
        score_mod_package._trace_while_compiling(mod, "cpu")


def _past_the_limits(kind):
    """(mod, change) with mod reading one scalar the walk stops short of (MAX_SEQUENCE,
    MAX_DEPTH, MAX_ITEMS in captures.py) and change(x) setting it."""
    from types import SimpleNamespace

    if kind in ("list", "dict"):
        values = [2.0] * 300 if kind == "list" else dict.fromkeys(range(300), 2.0)

        def mod(s, b, h, q, kv):
            return s * values[5]

        def change(x):
            values[5] = x

    elif kind == "tuple":  # rebound to an equal-length tuple: immutable, still unread
        values = (2.0,) * 300

        def mod(s, b, h, q, kv):
            return s * values[5]

        def change(x):
            nonlocal values
            values = (*values[:5], x, *values[6:])

    elif kind == "deep":
        root = node = SimpleNamespace()
        for _ in range(10):
            node.next = node = SimpleNamespace()
        node.v = 2.0

        def mod(s, b, h, q, kv):
            found = root
            for _ in range(10):
                found = found.next
            return s * found.v

        def change(x):
            node.v = x

    else:  # "many": 20 x 250 objects, past the values a walk visits
        groups = [[SimpleNamespace(v=2.0) for _ in range(250)] for _ in range(20)]

        def mod(s, b, h, q, kv):
            return s * groups[19][249].v

        def change(x):
            groups[19][249].v = x

    return mod, change


@pytest.mark.parametrize("kind", ["list", "tuple", "dict", "deep", "many"])
def test_a_value_past_the_walks_limits_is_traced_on_every_call(kind, monkeypatch):
    """A list, tuple or dict longer than the walk reads, a value deeper or further than it
    goes: its contents are not in the key, so the mod is traced on every call (the length
    alone as key kept a changed `values[5]`: 2.4 max error in the interpreter, 31df27e)
    and refused by name under torch.compile."""
    mod, change = _past_the_limits(kind)
    traces = []
    trace = score_mod_package.trace
    monkeypatch.setattr(score_mod_package, "trace", lambda *a: traces.append(1) or trace(*a))
    assert "2.0" in score_mod_package.prepare(mod, CPU).name
    change(0.375)
    assert "0.375" in score_mod_package.prepare(mod, CPU).name
    assert len(traces) == 2
    guarded = score_mod_package._GUARDED.get(id(mod))  # (an id a freed mod had is reused)
    assert guarded is None or guarded.fn() is not mod
    why = "longer than the 256 items" if kind in ("list", "tuple", "dict") else "past the walk"
    with pytest.raises(ScoreModError, match=why):
        score_mod_package._trace_while_compiling(mod, "cpu")


def test_a_dicts_tuple_keys_are_part_of_the_structure():
    """Keys of scalars (a tuple (h, kv) included) enter the key by value: by type alone, the
    same values under swapped keys were the same structure and kept the old constant."""
    table = {(0, 1): 2.0, (0, 2): 0.375}

    def mod(s, b, h, q, kv):
        return s * table[(0, 1)]

    assert "2.0" in score_mod_package.prepare(mod, CPU).name
    table.clear()
    table.update({(0, 2): 2.0, (0, 1): 0.375})
    assert "0.375" in score_mod_package.prepare(mod, CPU).name
    assert Walk(mod).opaque is None  # read into: cached, not traced on every call


class _Scale:
    def __init__(self, scale):
        self.scale = scale


class _ScaleA:
    scale = 2.0


class _ScaleB:
    scale = 0.375


class _PicksAnOption(torch.nn.Module):
    """An nn.Module mod holding its options and the one it uses (met after the options)."""

    def __init__(self):
        super().__init__()
        self.options = [_Scale(2.0), _Scale(0.375)]
        self.current = self.options[0]

    def forward(self, s, b, h, q, kv):
        return s * self.current.scale


def _a_pick_among_met_values(kind):
    """(mod, pick) with mod reading a scalar through one of several values the walk has
    already met (its container is read first) and pick(i) choosing which."""
    if kind == "module":
        mod = _PicksAnOption()

        def pick(i):
            mod.current = mod.options[i]

        return mod, pick
    all_options = {
        "object": [_Scale(2.0), _Scale(0.375)],
        "class": (_ScaleA(), _ScaleB()),  # instances: their classes met (held) first
        "list": [[2.0], [0.375]],
    }[kind]
    the_pick = {"object": all_options[0], "class": _ScaleA, "list": all_options[0]}[kind]

    def mod(s, b, h, q, kv):
        count = len(all_options)  # (cells are walked by name: all_options before the_pick)
        value = the_pick[0] if kind == "list" else the_pick.scale
        return s * value + 0 * count

    def pick(i):
        nonlocal the_pick
        the_pick = {
            "object": all_options[i],
            "class": (_ScaleA, _ScaleB)[i],
            "list": all_options[i],
        }[kind]

    return mod, pick


@pytest.mark.parametrize("kind", ["object", "class", "list", "module"])
def test_which_of_the_values_met_before_a_mod_reads_is_part_of_the_structure(kind):
    """An object, class or list the walk reaches a second time entered the key as its type
    alone: `cfg = cfgs[1]` after `cfgs` was walked was the key of `cfg = cfgs[0]` and kept
    its constant (2.12 max error against torch's Flex in the interpreter, 825f6ac). A
    repeat is keyed by when the walk first met the value."""
    mod, pick = _a_pick_among_met_values(kind)
    assert "2.0" in score_mod_package.prepare(mod, CPU).name
    pick(1)
    assert "0.375" in score_mod_package.prepare(mod, CPU).name
    pick(0)
    assert "2.0" in score_mod_package.prepare(mod, CPU).name


_LAYOUT_READS = {  # a number the mod reads from a capture's layout, (4, 8) contiguous: 8
    "shape": lambda t: t.shape[1],
    "size": lambda t: t.size(-1),
    "len": lambda t: 2 * len(t),
    "numel": lambda t: t.numel() // 4,
    "stride": lambda t: t.stride(0),
    "is_contiguous": lambda t: 8 if t.is_contiguous() else 5,
}


@pytest.mark.parametrize("read", sorted(_LAYOUT_READS))
def test_a_captures_layout_the_mod_reads_is_part_of_its_trace(read, monkeypatch):
    """`table.shape[1]` (a clamp to a table's last entry, say) is a constant of the generated
    code, and the walk's key holds a capture's dtype and rank only: a table rebound or resized
    in place to another layout kept the first trace's constant (0.58 and 1.16 max error
    against torch's Flex in the interpreter, b15203e). The layouts a mod read are checked
    on every lookup; an unchanged one stays cached."""
    number = _LAYOUT_READS[read]
    table = torch.zeros(4, 8)

    def mod(s, b, h, q, kv):
        return s + number(table)

    def constant_now() -> bool:  # the trace's constant is what the mod reads from table now
        wanted = f"({float(number(table))},)"
        return wanted in score_mod_package.prepare(mod, CPU).name

    traces = []
    trace = score_mod_package.trace
    monkeypatch.setattr(score_mod_package, "trace", lambda *a: traces.append(1) or trace(*a))
    assert constant_now()
    table = torch.ones(4, 8)  # the same layout: the same trace
    assert constant_now() and len(traces) == 1
    table = torch.zeros(4, 10)[:, :5] if read in ("stride", "is_contiguous") else torch.zeros(5, 5)
    assert number(table) != 8 and constant_now() and len(traces) == 2
    if read not in ("stride", "is_contiguous"):  # resized in place: the same slot and object
        for shape in ((4, 8), (4, 8), (5, 5)):
            table.resize_(shape)
            assert constant_now()
    guarded = score_mod_package._GUARDED.get(id(mod))
    assert guarded is None or guarded.fn() is not mod  # walked on every call


def test_a_captures_pointer_and_offset_are_refused_in_a_mod():
    """data_ptr() and storage_offset() as constants would be stale with the next tensor (and
    torch.compile cannot guard on them): refused by name."""
    table = torch.zeros(4, 8)
    for accessor in ("data_ptr", "storage_offset"):

        def mod(s, b, h, q, kv, accessor=accessor):
            return s + getattr(table, accessor)() % 7

        with pytest.raises(ScoreModError, match=f"`{accessor}` on captured tensors"):
            score_mod_package.prepare(mod, CPU)


def test_a_captures_dtype_or_rank_read_keeps_the_mod_guarded():
    """What the walk's key holds already (dtype, rank) is no layout read: such a mod keeps
    its guards (one slot check a call, not a walk)."""
    table = torch.zeros(4, 8, dtype=torch.float16)

    def mod(s, b, h, q, kv):
        return (s + table[h, q % 8] * table.dim()).to(table.dtype).float()

    _primed(mod)
    entry = score_mod_package._GUARDED[id(mod)]
    assert entry.fn() is mod and entry.mod(mod, CPU) is not None
