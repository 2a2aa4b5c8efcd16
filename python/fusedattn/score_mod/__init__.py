"""FlexAttention's `score_mod` without a compile: `score_mod(score, b, h, q_idx, kv_idx)`
changes each score q·k·scale (float32) before the softmax, as in Flex.

A call's mod is prepared here (`prepare`): its structure (captures.py's walk: code, scalars,
the dtypes and ranks of captured tensors, never their values; the shapes and strides the mod
read of one, `table.shape[1]`, checked apart: _Structure.read) picks a cached trace; a
structure not seen before is traced once (tracer.py) and written out as a Triton module
(codegen.py) that the attention kernels call per tile. Captured tensors are read by pointer,
so a new value in one never traces or compiles again; one that requires grad gets its
gradient (float32 atomics in the dQ kernel). A captured Python scalar is a constant of the
generated code: a new value is a new structure (one trace, one Triton compile of the
kernels that use it). A call with the same function object as before, whose closure cells,
globals and defaults still hold the same objects and whose captures have the same layout,
skips the walk (captures.Guards, _Guarded).

The reference and torch backends call the mod itself on the whole (B, H, Tq, Tk) score
tensor with broadcasting index tensors (`fusedattn.reference.apply_score_mod`): O(Tq·Tk),
torch's semantics and autograd (the float64 reference the kernels are tested against).
"""

from __future__ import annotations

import collections
import threading
import types
import weakref
from dataclasses import dataclass, field

import torch

from . import bounds, codegen, ir
from .captures import Guards, Walk
from .tracer import SUBSET_DOC, ScoreModError, describe_mod, trace

__all__ = ["SUBSET_DOC", "ScoreMod", "ScoreModError", "capture_layout", "prepare"]

MAX_STRUCTURES = 256  # traced structures kept (least recently used dropped)


@dataclass
class _Compiled:
    """One traced graph (the same for every closure of the same code and scalars): its
    generated modules per (interpreted, which captures want gradients)."""

    output: ir.Node
    graph: ir.Graph
    text: str
    mod: str
    names: list[str]
    modules: dict = field(default_factory=dict)

    proofs: dict = field(default_factory=dict)

    def module(self, interpreted: bool, grads: tuple[bool, ...], proven: tuple[bool, ...] = (),
               fast: bool = False):  # fmt: skip
        key = (interpreted, grads, proven, fast)
        found = self.modules.get(key)
        if found is None:
            found = self.modules[key] = codegen.load(codegen.source(
                self.output, self.graph, grads, interpreted, self.mod, self.names, proven, fast,
            ))  # fmt: skip
        return found

    def proven(self, shapes: tuple, extents: tuple[int, int, int, int]) -> tuple[bool, ...]:
        """bounds.proven_loads for (B, H, Tq, Tk), kept per (shapes, extents)."""
        key = (shapes, extents)
        found = self.proofs.get(key)
        if found is None:
            if len(self.proofs) >= 64:
                self.proofs.clear()
            named = dict(zip(("b", "h", "q_idx", "kv_idx"), extents, strict=True))
            found = self.proofs[key] = bounds.proven_loads(self.output, shapes, named)
        return found


@dataclass
class _Structure:
    """One walk key's trace: its graph, and where its captures sit in the walk's tensors
    (None: some capture is out of the walk's reach, so every call traces again); read:
    (position in the walk's tensors, read_layout) of each tensor whose shape or strides
    the mod read (`table.shape[1]`, a constant of the graph: the walk's key holds a
    tensor's dtype and rank only, so a call whose tensor there has another layout traces
    again)."""

    compiled: _Compiled
    positions: tuple[int, ...] | None
    names: list[str]
    read: tuple = ()

    def fits(self, tensors: list) -> bool:
        """Whether this trace holds for a walk's tensors (those it read the layout of)."""
        return all(read_layout(tensors[i]) == layout for i, layout in self.read)


_STRUCTURES: collections.OrderedDict = collections.OrderedDict()
# id(function) -> _Guarded: plain functions whose captures the slot checks vouch for
_GUARDED: dict = {}
_WALKED: dict = {}  # id(function) -> weakref: functions walked once (_walked_before)
_LOCK = threading.Lock()
# graph text -> its _Compiled, for the custom ops (torch.compile records a string)
_BY_NAME: dict[str, _Compiled] = {}


def capture_layout(t: torch.Tensor) -> tuple:
    """What a capture's launch depends on besides its values: shape, strides, dtype, device,
    requires_grad and 16-byte alignment (Triton specialises a pointer on it): the fields of
    a plan's key for a tensor (ops/core/plans.meta; tests/test_score_mod_guards.py checks
    they agree), so a plan keys a mod's captures on ScoreMod.layouts."""
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.data_ptr() % 16 == 0)


def read_layout(t: torch.Tensor) -> tuple:
    """What a mod reading a capture's metadata (`size`, `shape`, `len`, `numel`, `stride`,
    `is_contiguous`) may make a constant of its graph."""
    return (tuple(t.shape), tuple(t.stride()))


class ScoreMod:
    """One call's score_mod: the traced graph and this call's captured tensors."""

    __slots__ = ("_layouts", "compiled", "fn", "names", "tensors")

    def __init__(self, fn, compiled: _Compiled, tensors: list[torch.Tensor], names: list[str],
                 layouts: tuple | None = None):  # fmt: skip
        self.fn = fn
        self.compiled = compiled
        self.tensors = tensors
        self.names = names
        self._layouts = layouts

    @property
    def layouts(self) -> tuple:
        """capture_layout of each capture (the guarded lookup has them already)."""
        if self._layouts is None:
            self._layouts = tuple(map(capture_layout, self.tensors))
        return self._layouts

    @property
    def name(self) -> str:
        """The graph's registry key (the custom ops carry it)."""
        return self.compiled.text

    @property
    def description(self) -> str:
        """`qualified name (file:line)` of the mod."""
        return self.compiled.mod

    def functions(self, interpreted: bool, grads: tuple[bool, ...], extents=None,
                  fast: bool = False):  # fmt: skip
        """The generated module: score_mod, score_mod_dscore and (any grads) score_mod_grad;
        extents (B, H, Tq, Tk): the call's, for loads proven in range (bounds.py); fast: the
        kernel's dots run at reduced precision (tanh's fast form, as the built-in softcap)."""
        proven = ()
        if extents is not None and self.tensors:
            shapes = tuple(tuple(t.shape) for t in self.tensors)
            proven = self.compiled.proven(shapes, tuple(int(e) for e in extents))
        return self.compiled.module(interpreted, grads, proven, fast and not interpreted)

    def arguments(self, grad_buffers=None) -> tuple:
        return codegen.arguments(self.tensors, grad_buffers)

    def loads(self, capture: int) -> list[list[str | None]]:
        """Per load of a capture, per dimension: the input (b, h, q_idx, kv_idx) its index
        is, as it is, "const" for a constant, None for any other expression (q_idx - kv_idx,
        a value read from another tensor, ...)."""
        return [[a.op if a.op in ir.INPUTS or a.op == "const" else None for a in n.args]
                for n in ir.topological(self.compiled.output)
                if n.op == "load" and n.attrs[0] == capture]  # fmt: skip


class _Guarded:
    """A function object's last full walk whose slots the guards vouch for (captures.Guards):
    its structure, and its captures (weakly) with their layouts, checked again on each call
    (a tensor's dtype, shape or requires_grad can change in place, which a walk's key would
    see; tensors the mod does not read do not change its trace)."""

    __slots__ = ("captures", "fn", "guards", "layouts", "structure")

    def __init__(self, fn, guards: Guards, structure: _Structure, captures: list):
        self.fn = weakref.ref(fn)
        self.guards, self.structure = guards, structure
        self.captures = [weakref.ref(t) for t in captures]
        self.layouts = tuple(map(capture_layout, captures))

    def mod(self, fn, device: torch.device) -> ScoreMod | None:
        """This call's ScoreMod if fn's slots hold what they held and its captures' layouts
        are the same (on `device`), else None (the full walk decides, and refuses)."""
        if self.fn() is not fn or not self.guards.unchanged():
            return None
        captures = []
        for ref in self.captures:
            t = ref()
            if t is None:
                return None
            captures.append(t)
        layouts = self.layouts
        if tuple(map(capture_layout, captures)) != layouts:
            return None
        for layout in layouts:
            if layout[3] != device:
                return None
        structure = self.structure
        return ScoreMod(fn, structure.compiled, captures, structure.names, layouts)


def _trace(fn, walk: Walk, device) -> tuple[_Structure, list[torch.Tensor]]:
    output, graph, tensors, read = trace(fn, walk.names_by_id(), device)
    where = {id(t): i for i, t in enumerate(walk.tensors)}
    positions = tuple(where.get(id(t), -1) for t in tensors)
    read = tuple((where.get(id(t), -1), read_layout(t)) for t in read)
    names = [walk.names[where[id(t)]] if id(t) in where else f"capture {i}"
             for i, t in enumerate(tensors)]  # fmt: skip
    text = ir.describe(output, graph.captures)
    with _LOCK:
        compiled = _BY_NAME.get(text)
        if compiled is None:
            compiled = _BY_NAME[text] = _Compiled(output, graph, text, describe_mod(fn), names)
    # a value the walk cannot read into (walk.opaque) may change with the same key: traced
    # again on every call, as a capture out of its reach is
    cached = -1 not in positions and walk.opaque is None and all(i >= 0 for i, _ in read)
    return _Structure(compiled, positions if cached else None, names, read), tensors


def prepare(fn, device: torch.device, *, _eager: bool = False) -> ScoreMod:
    """This call's ScoreMod: the cached trace of fn's structure with the tensors it captures
    now; ScoreModError (a ValueError) where fn cannot be traced or a capture is on another
    device."""
    if not callable(fn):
        raise ScoreModError(f"score_mod must be callable, got {type(fn).__name__}")
    if not _eager and torch.compiler.is_compiling():
        # torch.compile records the call: the lookup (and a trace) runs eagerly, at its trace
        # time (Dynamo cannot run the tracer); the captures come from the walk it records
        walk = Walk(fn)
        name, positions, names, read = _trace_while_compiling(fn, str(device))
        for i, layout in read:  # (a Python condition on the layout: Dynamo guards on it, so a
            if read_layout(walk.tensors[i]) != layout:  # new one compiles and traces again)
                raise ScoreModError(f"score_mod {describe_mod(fn)}: a capture's layout changed "
                                    "between the trace and the compiled call")  # fmt: skip
        return ScoreMod(fn, registered(name), [walk.tensors[i] for i in positions], list(names))
    record = False
    if type(fn) is types.FunctionType:
        entry = _GUARDED.get(id(fn))  # the same function, its captures in the same slots
        mod = None if entry is None else entry.mod(fn, device)
        if mod is not None:
            return mod
        record = _walked_before(fn)
    walk = Walk(fn, record=record)
    key = walk.key
    structure = _STRUCTURES.get(key)
    if (
        structure is None
        or structure.positions is None
        or (structure.read and not structure.fits(walk.tensors))  # (it replaces the old one)
    ):
        structure, tensors = _trace(fn, walk, device)
        with _LOCK:
            _STRUCTURES[key] = structure
            while len(_STRUCTURES) > MAX_STRUCTURES:
                _STRUCTURES.popitem(last=False)
        _remember_guards(fn, walk, structure)
        return ScoreMod(fn, structure.compiled, tensors, structure.names)
    _remember_guards(fn, walk, structure)
    return _with_tensors(fn, structure, [walk.tensors[i] for i in structure.positions], device)


def _walked_before(fn) -> bool:
    """Whether fn was walked before (and is now again): its guards are recorded from its
    second walk on, so a mod that a forward defines anew each call (a new function object
    every time) pays one weak reference for them, not the recording (17.6k instructions a
    forward when every walk recorded, 2026-12-07)."""
    ref = _WALKED.get(id(fn))
    if ref is not None and ref() is fn:
        return True
    if len(_WALKED) >= MAX_STRUCTURES:
        _WALKED.clear()  # (a function dropped here is recorded at its next two walks)
    _WALKED[id(fn)] = weakref.ref(fn)
    return False


def _remember_guards(fn, walk: Walk, structure: _Structure) -> None:
    # (a mod that reads a layout is walked on every call: the guards check only the layouts
    # of the captures it loads, and a tensor resized in place keeps its slot)
    if walk.guards is None or structure.positions is None or structure.read:
        return
    entry = _Guarded(fn, walk.guards, structure, [walk.tensors[i] for i in structure.positions])
    with _LOCK:
        _GUARDED.pop(id(fn), None)  # re-inserted last: the oldest go first below
        _GUARDED[id(fn)] = entry
        while len(_GUARDED) > MAX_STRUCTURES:
            del _GUARDED[next(iter(_GUARDED))]


def _with_tensors(fn, structure: _Structure, tensors: list, device) -> ScoreMod:
    """The ScoreMod of a known structure with this call's captures, each on `device`."""
    for t, name in zip(tensors, structure.names, strict=True):
        if t.device != device:
            raise ScoreModError(
                f"score_mod {structure.compiled.mod}: captured tensor `{name}` is on "
                f"{t.device}, the call's tensors on {device}; move it to their device"
            )
    return ScoreMod(fn, structure.compiled, tensors, structure.names)


def _assume_constant_result(fn):
    """torch.compiler.assume_constant_result without importing Dynamo when fusedattn is
    imported (torch.compiler's imports torch._dynamo, which imports triton and Inductor:
    1.4 s, and `import fusedattn` must not load triton): the attribute it sets, which
    tests/test_score_mod.py checks against torch's own."""
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _trace_while_compiling(fn, device: str) -> tuple[str, tuple, tuple, tuple]:
    """prepare(fn) run by torch.compile at its trace time with the real function (Dynamo
    calls an assume_constant_result function eagerly): (the graph's registry name, where
    its captures sit in the walk's tensors, their names, the layouts it read: _Structure),
    constants the compiled graph keeps. A mod defined inside the compiled function cannot
    be handed over this way (Dynamo does not turn its closure cells into constants)."""
    walk = Walk(fn)
    _GUARDED.pop(id(fn), None)  # the full path: it puts the structure back in _STRUCTURES
    mod = prepare(fn, torch.device(device), _eager=True)
    structure = _STRUCTURES.get(walk.key)
    if walk.opaque is not None:
        raise ScoreModError(
            f"score_mod {mod.description} reads through {walk.opaque}: under torch.compile "
            "its values would stay the first call's; pass them as a tensor or a few Python "
            "scalars, lists or tuples"
        )
    if structure is None or structure.positions is None:
        raise ScoreModError(
            f"score_mod {mod.description}: under torch.compile its captured tensors must be "
            "reachable from the function (closure cells, globals, defaults, a bound "
            "method's object); one made by a helper on each call is not"
        )
    return mod.name, structure.positions, tuple(mod.names), structure.read


def registered(name: str) -> _Compiled:
    """The structure a custom op names (traced in this process)."""
    found = _BY_NAME.get(name)
    if found is None:
        raise ScoreModError("a recorded score_mod's structure is not traced in this process; "
                            "call the attention once eagerly first")  # fmt: skip
    return found
