"""Launch a Triton kernel without paying Triton's per-call specialisation twice.

`kernel[grid](*args, **constexprs)` binds ~50 arguments, specialises each one in C++, builds a
string cache key and looks the compiled kernel up: 22-24 µs of host time per attention launch
on the 2-core CPU machine (Triton 3.6, sm_90 compiled, only the driver call stubbed), 13 µs of
it the binder. An attention forward+backward launches three kernels, so that was ~70 µs of
the ~235 µs the public API spent per call (`benchmarks/bench_host.py`).

`launch` remembers the compiled kernel under a key that determines Triton's specialisation
exactly, or more finely: every argument's Python type, the exact values of the scalar
arguments (ints, floats, bools: Triton looks at an int's value for ==1, %16 and its integer
width, and at nothing else of a float), the dtype and 16-byte alignment of each tensor (all
Triton reads of a tensor when it specialises), the constexprs and launch options, the current
device and Triton's debug and instrumentation settings. Two calls with equal keys would have
picked the same compiled kernel through Triton's own path, so the second one calls it directly
(`CompiledKernel[grid](*all parameters)`: the same launcher call Triton's own path ends in):
~8 µs. Anything this cannot key (a kernel under the interpreter, pre-run hooks, module globals
the kernel reads other than tl.constexpr constants, a stage-inspection hook, a grid given as a function, arguments that are not
tensors-then-scalars) takes Triton's path every time. FUSEDATTN_TRITON_LAUNCH_CACHE=0 (read
at import) turns the shortcut off.

The arguments must be the tensor-like ones first (tensors, None, tensor descriptors), then
scalars: every launcher in fusedattn builds them that way.
"""

from __future__ import annotations

import os

import torch

ENABLED = os.environ.get("FUSEDATTN_TRITON_LAUNCH_CACHE", "1") != "0"
MAX_KEYS_PER_KERNEL = 256  # distinct shapes/strides per kernel before the cache starts over

_SCALAR_TYPES = (int, float, bool)


class _KernelLaunches:
    """Per JIT kernel: how many leading arguments are tensor-like (fixed at its first launch;
    a later launch laid out otherwise is never cached), its parameters in signature order, and
    the compiled kernel with the values of the parameters after the positional ones, per key."""

    __slots__ = ("compiled", "kernel", "params", "slots", "tensors")

    def __init__(self, kernel, args, cacheable: bool):
        self.kernel = kernel  # held: the id keying _launches stays this kernel's
        self.tensors = tensor_prefix(args) if cacheable else -1
        self.params = (
            [(p.name, p.default, p.has_default) for p in kernel.params] if cacheable else []
        )
        self.compiled: dict = {}
        self.slots: dict = {}  # per-call keywords' places in the tail (_slots)


# id(kernel) -> _KernelLaunches (an id: a JITFunction hashes its source's sha256 string through
# a property, 0.35 µs a lookup)
_launches: dict = {}
_triton = None  # (JITFunction, CompiledKernel, knobs, driver), imported on the first launch
_NEVER = object()  # the key of an argument that cannot be keyed: it never matches


def _triton_parts():
    global _triton
    if _triton is None:
        from triton import knobs
        from triton.compiler.compiler import CompiledKernel
        from triton.runtime import driver
        from triton.runtime.jit import JITFunction

        _triton = (JITFunction, CompiledKernel, knobs, driver)
    return _triton


def _new_entry(kernel, args):
    """A kernel's entry; one that is never cached (tensors -1) when the cache is off or the
    kernel is not a compiled JITFunction (the interpreter's, for one)."""
    JITFunction = _triton_parts()[0]
    return _KernelLaunches(kernel, args, ENABLED and isinstance(kernel, JITFunction))


def tensor_prefix(args) -> int:
    """How many leading arguments are tensor-like (tensor, None, tensor descriptor) when all
    the rest are Python ints/floats/bools; -1 when the arguments are not laid out that way."""
    n = 0
    while n < len(args) and (args[n] is None or _is_tensor_like(args[n])):
        n += 1
    if not all(type(a) in _SCALAR_TYPES for a in args[n:]):
        return -1
    return n


def _is_tensor_like(a) -> bool:
    return isinstance(a, torch.Tensor) or (hasattr(a, "block_shape") and hasattr(a, "base"))


def _descriptor_key(a):
    """What Triton specialises a tensor descriptor on (or more): the launcher expands it into
    the base pointer, shape and strides. Anything else in a tensor slot never matches."""
    if not _is_tensor_like(a):
        return _NEVER
    base = a.base
    return (
        base.dtype, base.data_ptr() % 16 == 0, tuple(a.shape), tuple(a.strides),
        tuple(a.block_shape), getattr(a, "padding", None),
    )  # fmt: skip


def _keyword_key(value):
    """What Triton specialises a keyword argument given per call on: a tensor by dtype and
    16-byte alignment, a tuple item by item (a score_mod's captures: tensors, sizes and
    strides), a scalar by type and value; anything else never matches."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if type(value) in _SCALAR_TYPES:
        return type(value), value
    if type(value) is tuple:
        return tuple(map(_keyword_key, value))
    return object()  # a key of its own: equal to no other call's


def launch_key(entry, args, constexprs, device, knobs, per_call=None):
    """The cache key of one launch: equal keys, equal Triton specialisation. per_call: the
    keyword arguments whose values are this call's (tensors, tuples of them), keyed as
    Triton specialises them rather than by identity."""
    n = entry.tensors
    scalars = args[n:]
    items = tuple(constexprs.items())
    if per_call:
        items += tuple((k, _keyword_key(v)) for k, v in per_call.items())
    return (
        device, knobs.runtime.debug, knobs.compilation.instrumentation_mode,
        items, tuple(map(type, scalars)), scalars,
        tuple([
            None if a is None
            else (a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
            else _descriptor_key(a)
            for a in args[:n]
        ]),
    )  # fmt: skip


def launch(kernel, grid, args: tuple, constexprs: dict, per_call: dict | None = None) -> None:
    """kernel[grid](*args, **constexprs, **per_call), through the compiled kernel when an
    earlier launch with the same key found it. per_call: keyword arguments that carry this
    call's tensors (a block mask's lists, a score_mod's captures): keyed by what Triton
    specialises on, and put in their places of the compiled kernel's parameters on a hit."""
    static = constexprs  # the key's; the kernel gets both
    if per_call:
        constexprs = {**constexprs, **per_call}
    entry = _launches.get(id(kernel))
    if entry is None or entry.kernel is not kernel:
        entry = _launches[id(kernel)] = _new_entry(kernel, args)
    if entry.tensors < 0 or callable(grid):
        kernel[grid](*args, **constexprs)
        return
    _, CompiledKernel, knobs, driver = _triton
    key = None
    if not (
        kernel.pre_run_hooks
        or (kernel.used_global_vals and _reads_mutable_globals(kernel))
        or getattr(knobs.runtime, "add_stages_inspection_hook", None) is not None
    ):
        key = launch_key(entry, args, static, driver.active.get_current_device(), knobs,
                         per_call)  # fmt: skip
        try:
            hit = entry.compiled.get(key)
        except TypeError:  # an unhashable constexpr (a list, say): Triton's path, uncached
            key = hit = None
        if hit is not None:
            compiled, tail = hit
            if per_call:  # this call's tensors in their places
                tail = list(tail)
                for i, name in _slots(entry, len(args), per_call):
                    tail[i] = per_call[name]
            size = len(grid)
            full_grid = (grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1)
            compiled[full_grid](*args, *tail)
            return
    compiled = kernel[grid](*args, **constexprs)
    if key is None or type(compiled) is not CompiledKernel:  # e.g. a future when compiling async
        return
    tail = _tail(entry, len(args), constexprs)
    if tail is not None and per_call:  # not kept: a hit puts its own call's there
        tail = list(tail)
        for i, _name in _slots(entry, len(args), per_call):
            tail[i] = None
        tail = tuple(tail)
    if tail is not None and tensor_prefix(args) == entry.tensors:
        if len(entry.compiled) >= MAX_KEYS_PER_KERNEL:
            entry.compiled.clear()
        entry.compiled[key] = (compiled, tail)


def _reads_mutable_globals(kernel) -> bool:
    """Whether a compiled kernel read a module global that is not a tl.constexpr. Triton
    records every global a kernel reads (used_global_vals) and re-checks them on its own path
    at each launch; a tl.constexpr module constant (the fp8 helpers' E4M3_BIAS and the like)
    is part of the source, fixed at import, so it does not stop the cache. Before this test
    the fp8 helpers' constants sent every decode launch after the first compiled variant
    down Triton's path: bench_host's decode+append row 55 µs against 19 (issue #73 item 6)."""
    from triton.language import constexpr

    return any(not isinstance(value, constexpr) for value, _ in kernel.used_global_vals.values())


def _slots(entry, positional: int, per_call: dict) -> list[tuple[int, str]]:
    """(index in the tail, name) of each per-call keyword: the tail is the parameters after
    the positional ones (kept per kernel and argument count)."""
    key = (positional, tuple(per_call))
    found = entry.slots.get(key)
    if found is None:
        names = [name for name, _, _ in entry.params[positional:]]
        found = entry.slots[key] = [(names.index(n), n) for n in per_call]
    return found


def _tail(entry, positional: int, constexprs: dict):
    """The values of the parameters after the positional ones, in signature order, as Triton's
    binder fills them (keyword, else default); None if one has neither."""
    tail = []
    for name, default, has_default in entry.params[positional:]:
        if name in constexprs:
            tail.append(constexprs[name])
        elif has_default:
            tail.append(default)
        else:
            return None
    return tuple(tail)


class Prepared:
    """One kernel launch with everything but its tensor arguments fixed, for a caller that
    keys its own calls finely enough to know the rest is the same (a plan, ops/decode/plans.py:
    shapes, strides, dtypes, devices, 16-byte alignment and every scalar): a call hands its
    tensors straight to the compiled kernel's launcher, with no binding and no key of its own
    (2.6 µs on the CPU machine against 8.9 through `launch`). Where `launch` could not cache
    the kernel (the interpreter, hooks, a grid function) it goes through `launch` each time.

    A launch with per-call keywords (`prepare(per_call=)`: a block mask's lists, a score_mod's
    captures) is repeated by `with_values`, which puts each call's values in their places
    among the compiled kernel's parameters (`names` says which, in order); the caller's key
    must fix what Triton specialises them on (dtype, alignment, a capture's sizes and
    strides), as it fixes the tensors'."""

    __slots__ = ("constexprs", "grid", "kernel", "launcher", "names", "places", "rest",
                 "runner", "runs", "scalars", "segments")  # fmt: skip

    def __init__(self, kernel, grid, scalars: tuple, constexprs: dict, runner, rest,
                 launcher=None, names: tuple = (), places: tuple = ()):  # fmt: skip
        self.kernel, self.grid, self.scalars, self.constexprs = kernel, grid, scalars, constexprs
        self.runner, self.rest, self.launcher = runner, rest, launcher
        self.names, self.places = names, places
        # rest cut around the runs of adjacent per-call places (a block mask's three lists are
        # one run, a mod's captures another): a call joins the pieces and its values (tuple
        # concatenation: 0.3-0.6 µs less than copying rest to a list per launch); segments
        # (the pieces), runs ((first, last + 1) in values per run)
        self.segments = self.runs = None
        if runner is not None and places and list(places) == sorted(set(places)):
            runs, first = [], 0
            for i in range(1, len(places) + 1):
                if i == len(places) or places[i] != places[i - 1] + 1:
                    runs.append((first, i))
                    first = i
            bounds = [(-1, -1)] + [(places[a], places[b - 1]) for a, b in runs]
            bounds.append((len(rest), len(rest)))
            self.segments = tuple(rest[bounds[j][1] + 1:bounds[j + 1][0]]
                                  for j in range(len(bounds) - 1))  # fmt: skip
            self.runs = tuple(runs)

    def __call__(self, *tensors) -> None:
        launcher = self.launcher
        if launcher is not None:
            hooks = _triton[2].runtime
            if not _active(hooks.launch_enter_hook) and not _active(hooks.launch_exit_hook):
                launcher(*tensors, *self.rest)
                return
        if self.runner is not None:
            self.runner(*tensors, *self.rest)
        else:
            launch(self.kernel, self.grid, (*tensors, *self.scalars), self.constexprs)

    def with_values(self, tensors: tuple, values: tuple) -> None:
        """The launch for these tensors with this call's per-call keywords (values in the
        order of `names`)."""
        if self.runner is None:
            per_call = dict(zip(self.names, values, strict=True))
            launch(self.kernel, self.grid, (*tensors, *self.scalars), self.constexprs, per_call)
            return
        segments = self.segments
        if segments is not None:
            if len(values) != len(self.places):
                raise ValueError(f"{len(values)} per-call values for {self.names}")
            if len(segments) == 2:  # one run (a mask's lists, or a mod's captures)
                rest = segments[0] + values + segments[1]
            else:
                rest, i = segments[0], 1
                for a, b in self.runs:
                    rest = rest + values[a:b] + segments[i]
                    i += 1
        else:
            rest = list(self.rest)
            for place, value in zip(self.places, values, strict=True):
                rest[place] = value
        launcher = self.launcher
        if launcher is not None:
            hooks = _triton[2].runtime
            if not _active(hooks.launch_enter_hook) and not _active(hooks.launch_exit_hook):
                launcher(*tensors, *rest)
                return
        self.runner(*tensors, *rest)


def _active(hook) -> bool:
    """Whether a Triton launch hook is set: None (Triton 3.6) or an empty HookChain (3.8) is
    not; a profiler's function or chain of them is."""
    return bool(getattr(hook, "calls", hook))


def _direct_launcher(compiled, grid, device):
    """compiled's C launcher called as its own runner calls it when no launch hook is set
    (none then gets launch metadata): the current stream, the grid, the kernel's function and
    packed metadata, then the arguments; ~1 µs of host time against ~3.5 for the runner on the
    CPU machine (bench_host.py). None where the compiled kernel lacks those attributes."""
    driver = _triton[3]
    try:
        run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    except AttributeError:
        return None
    get_stream = driver.active.get_current_stream
    gx, gy, gz = grid

    def launcher(*args):
        run(gx, gy, gz, get_stream(device), function, packed, None, None, None, *args)

    return launcher


def prepare(kernel, grid, args: tuple, constexprs: dict, per_call: dict | None = None) -> Prepared:
    """Launch kernel[grid](*args, **constexprs, **per_call) now (through `launch`) and return a
    Prepared that repeats it for new tensors in the same leading positions (args: tensors,
    then scalars, as for `launch`) and, with per_call, new values of those keywords
    (`Prepared.with_values`; constexprs must not hold them: the Prepared keeps no call's
    tensors)."""
    n = tensor_prefix(args)
    if n < 0:
        raise ValueError("prepare() needs the tensor arguments first, then Python scalars")
    launch(kernel, grid, args, constexprs, per_call)
    names = tuple(per_call or ())
    entry = _launches.get(id(kernel))
    runner = rest = launcher = None
    places: tuple = ()
    if entry is not None and entry.tensors == n and not callable(grid) and _triton is not None:
        _, _, knobs, driver = _triton
        device = driver.active.get_current_device()
        key = launch_key(entry, args, constexprs, device, knobs, per_call)
        try:
            hit = entry.compiled.get(key)
        except TypeError:
            hit = None
        if hit is not None:
            compiled, tail = hit
            size = len(grid)
            full_grid = (grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1)
            runner = compiled[full_grid]
            rest = (*args[n:], *tail)  # the per-call places hold None (launch keeps no call's)
            if per_call:
                places = tuple(len(args) - n + i for i, _ in _slots(entry, len(args), per_call))
            launcher = _direct_launcher(compiled, full_grid, device)
    return Prepared(kernel, grid, args[n:], constexprs, runner, rest, launcher, names, places)
