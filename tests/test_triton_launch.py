"""The Triton launch cache (ops/triton_launch.py): a launch takes the compiled kernel directly
only when Triton's own path would have picked the same one, and hands it the same arguments.

Triton's JIT objects are replaced by fakes that record which path ran (no GPU, no compiler);
the real path was compared argument by argument on the CPU machine with the kernels compiled
for sm_90 (`benchmarks/bench_host.py --sm90-tool ... --check-launches`). The last test runs
fusedattn's own launchers under the interpreter and checks their argument layout is one the
cache can key.
"""

import inspect

import pytest
import torch

from fusedattn.ops.core import triton_launch


class FakeParam:
    def __init__(self, param: inspect.Parameter):
        self.name = param.name
        self.default = param.default
        self.has_default = param.default is not inspect.Parameter.empty


class FakeCompiled:
    """Stands for triton's CompiledKernel: `[grid](*every parameter)` is its runner."""

    def __init__(self, log, number):
        self.log, self.number = log, number

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("fast", self.number, grid, args))


class FakeJIT:
    """Stands for a JITFunction of `def kernel(x, y, n, scale, BLOCK, FLAG=True)` (with
    keywords: `def kernel(x, n, BLOCK, LISTS=None, MOD_ARGS=None)`)."""

    def __init__(self, keywords=False):
        def kernel(x, y, n, scale, BLOCK, FLAG=True):
            pass

        def keyword_kernel(x, n, BLOCK, LISTS=None, MOD_ARGS=None):
            pass

        kernel = keyword_kernel if keywords else kernel
        self.params = [FakeParam(p) for p in inspect.signature(kernel).parameters.values()]
        self.pre_run_hooks, self.used_global_vals, self.log = [], {}, []
        self.compiles = 0

    def __getitem__(self, grid):
        def run(*args, **constexprs):
            self.compiles += 1
            self.log.append(("triton", grid, args, constexprs))
            return FakeCompiled(self.log, self.compiles)

        return run


class FakeKnobs:
    class runtime:
        debug = False

    class compilation:
        instrumentation_mode = ""


class FakeDriver:
    class active:
        @staticmethod
        def get_current_device():
            return 0


@pytest.fixture
def fake_triton(monkeypatch):
    monkeypatch.setattr(triton_launch, "ENABLED", True)
    monkeypatch.setattr(triton_launch, "_launches", {})
    monkeypatch.setattr(triton_launch, "_triton", (FakeJIT, FakeCompiled, FakeKnobs, FakeDriver))
    return FakeJIT()


def _aligned(n=64, dtype=torch.float16, offset=0):
    return torch.zeros(n + 8, dtype=dtype)[offset : offset + n]


def _paths(kernel):
    return [entry[0] for entry in kernel.log]


def test_a_repeated_launch_calls_the_compiled_kernel_with_every_parameter(fake_triton):
    x, y = _aligned(), _aligned()
    for _ in range(3):
        triton_launch.launch(fake_triton, (4,), (x, y, 64, 0.5), dict(BLOCK=32, num_warps=4))
    assert _paths(fake_triton) == ["triton", "fast", "fast"]
    _, number, grid, args = fake_triton.log[-1]
    assert number == 1 and grid == (4, 1, 1)
    # the positional arguments, then BLOCK from the keywords and FLAG's default, in order
    assert args[:4] == (x, y, 64, 0.5) and args[4:] == (32, True)


@pytest.mark.parametrize(
    "change",
    [
        "misaligned tensor", "other dtype", "None for a tensor", "other int", "int for float",
        "bool for int", "other constexpr", "other launch option", "debug knob",
    ],
)  # fmt: skip
def test_anything_triton_specialises_on_misses_the_cache(fake_triton, monkeypatch, change):
    x, y = _aligned(), _aligned()
    args, constexprs = (x, y, 64, 0.5), dict(BLOCK=32, num_warps=4)
    triton_launch.launch(fake_triton, (1,), args, constexprs)
    if change == "misaligned tensor":
        args = (_aligned(offset=1), y, 64, 0.5)  # 2 bytes past a 16-byte boundary
    elif change == "other dtype":
        args = (_aligned(dtype=torch.bfloat16), y, 64, 0.5)
    elif change == "None for a tensor":
        args = (x, None, 64, 0.5)
    elif change == "other int":
        args = (x, y, 65, 0.5)
    elif change == "int for float":
        args = (x, y, 64, 1)
        triton_launch.launch(fake_triton, (1,), (x, y, 64, 1.0), constexprs)  # 1 == 1.0
    elif change == "bool for int":
        args = (x, y, True, 0.5)
        triton_launch.launch(fake_triton, (1,), (x, y, 1, 0.5), constexprs)  # True == 1
    elif change == "other constexpr":
        constexprs = dict(BLOCK=64, num_warps=4)
    elif change == "other launch option":
        constexprs = dict(BLOCK=32, num_warps=8)
    elif change == "debug knob":
        monkeypatch.setattr(FakeKnobs.runtime, "debug", True)
    triton_launch.launch(fake_triton, (1,), args, constexprs)
    assert _paths(fake_triton)[-1] == "triton"
    triton_launch.launch(fake_triton, (1,), args, constexprs)  # and is cached in turn
    assert _paths(fake_triton)[-1] == "fast"


def test_other_values_that_specialise_alike_still_hit(fake_triton):
    """A float's value and a tensor's data do not change Triton's choice."""
    triton_launch.launch(fake_triton, (1,), (_aligned(), _aligned(), 64, 0.5), dict(BLOCK=32))
    triton_launch.launch(fake_triton, (1,), (_aligned(), _aligned(), 64, 0.5), dict(BLOCK=32))
    assert _paths(fake_triton) == ["triton", "fast"]


@pytest.mark.parametrize("state", ["pre-run hook", "global values", "disabled"])
def test_what_the_cache_cannot_see_takes_tritons_path_every_time(fake_triton, monkeypatch, state):
    if state == "pre-run hook":
        fake_triton.pre_run_hooks.append(lambda *a, **k: None)
    elif state == "global values":
        fake_triton.used_global_vals[("G", 0)] = (1, {"G": 1})
    else:
        monkeypatch.setattr(triton_launch, "ENABLED", False)
    for _ in range(3):
        triton_launch.launch(fake_triton, (1,), (_aligned(), None, 8, 1.0), dict(BLOCK=16))
    assert _paths(fake_triton) == ["triton"] * 3


def test_a_grid_function_takes_tritons_path(fake_triton):
    for _ in range(2):
        triton_launch.launch(fake_triton, lambda meta: (1,), (_aligned(), None, 8, 1.0), {})
    assert _paths(fake_triton) == ["triton"] * 2


def test_an_unhashable_constexpr_takes_tritons_path(fake_triton):
    for _ in range(2):
        triton_launch.launch(fake_triton, (1,), (_aligned(), None, 8, 1.0), dict(BLOCK=[16]))
    assert _paths(fake_triton) == ["triton"] * 2


def test_arguments_not_laid_out_tensors_then_scalars_are_never_cached(fake_triton):
    args = (_aligned(), 8, _aligned(), 1.0)  # a tensor after a scalar
    for _ in range(2):
        triton_launch.launch(fake_triton, (1,), args, dict(BLOCK=16))
    assert _paths(fake_triton) == ["triton"] * 2
    assert triton_launch.tensor_prefix(args) == -1
    assert triton_launch.tensor_prefix((None, _aligned(), 3, 2.0, False)) == 2


class AsyncJIT(FakeJIT):
    """Returns something other than a compiled kernel (Triton's async compile mode returns a
    future)."""

    def __getitem__(self, grid):
        run = super().__getitem__(grid)
        return lambda *args, **constexprs: (run(*args, **constexprs), object())[1]


def test_a_kernel_that_returns_no_compiled_kernel_is_not_cached(fake_triton):
    kernel = AsyncJIT()
    for _ in range(2):
        triton_launch.launch(kernel, (1,), (_aligned(), None, 8, 1.0), dict(BLOCK=16))
    assert _paths(kernel) == ["triton"] * 2


def test_the_cache_starts_over_past_its_bound(fake_triton, monkeypatch):
    monkeypatch.setattr(triton_launch, "MAX_KEYS_PER_KERNEL", 3)
    x = _aligned()
    for n in range(5):
        triton_launch.launch(fake_triton, (1,), (x, None, n, 1.0), dict(BLOCK=16))
    (entry,) = triton_launch._launches.values()
    assert len(entry.compiled) == 2  # cleared at the 4th new key, then two more
    triton_launch.launch(fake_triton, (1,), (x, None, 4, 1.0), dict(BLOCK=16))
    assert _paths(fake_triton)[-1] == "fast"


@pytest.mark.kernels
def test_fusedattns_launchers_pass_tensors_then_scalars(monkeypatch):
    """Every Triton launch in fusedattn has the layout the cache keys (else it would silently
    take Triton's slower path on a GPU)."""
    import fusedattn

    seen = []

    def record(kernel, grid, args, constexprs, per_call=None):
        seen.append((getattr(kernel, "__name__", repr(kernel)), triton_launch.tensor_prefix(args)))
        return real(kernel, grid, args, constexprs, per_call)

    real = triton_launch.launch
    monkeypatch.setattr(triton_launch, "launch", record)
    q, k, v = (torch.randn(1, 2, 16, 8, requires_grad=True) for _ in range(3))
    kpm = torch.zeros(1, 16, dtype=torch.bool)
    kpm[0, 12:] = True
    out = fusedattn.attention(q, k, v, key_padding_mask=kpm, is_causal=True, backend="triton")
    out.sum().backward()
    from fusedattn.ops.core.kernels import kernels

    x = torch.randn(5, 40, requires_grad=True)
    w, b = torch.randn(40, requires_grad=True), torch.randn(40, requires_grad=True)
    for one_pass_limit in (None, 16):  # one-pass kernels, then the looped ones (rows > 16)
        if one_pass_limit:
            for name in ("layernorm", "softmax"):
                monkeypatch.setattr(kernels(name), "MAX_ONE_PASS_N", one_pass_limit)
            monkeypatch.setattr(kernels("layernorm"), "MAX_ONE_PASS_BWD_N", one_pass_limit)
        fusedattn.layer_norm(x, (40,), w, b, backend="triton").sum().backward()
        fusedattn.rms_norm(x, (40,), w, backend="triton").sum().backward()
        fusedattn.softmax(x, -1, backend="triton").pow(2).sum().backward()
    names = {name for name, _ in seen}
    assert len(names) == 3 + 5 + 4, sorted(names)  # attention, LayerNorm and softmax kernels
    assert all(n > 0 for _, n in seen), seen


def test_a_kernel_reading_only_constexpr_globals_is_cached(fake_triton):
    """Module constants declared tl.constexpr (the fp8 helpers' E4M3_BIAS, ...) are source,
    not state: such a kernel keeps the fast path. Before, any recorded global sent every
    launch with a new key down Triton's path (the decode kernel after the fp8 helpers came:
    bench_host's decode+append 55 µs against 19)."""
    import triton.language as tl

    fake_triton.used_global_vals[("E4M3_BIAS", 0)] = (tl.constexpr(7), {"E4M3_BIAS": 7})
    for _ in range(3):
        triton_launch.launch(fake_triton, (1,), (_aligned(), None, 8, 1.0), dict(BLOCK=16))
    assert _paths(fake_triton) == ["triton", "fast", "fast"]


def test_keyed_keywords_hit_with_this_calls_tensors_and_miss_on_what_specialises(fake_triton):
    """A block mask's lists and a score_mod's capture tuple ride in keywords (per_call): they
    are keyed by dtype, alignment and scalar values, and a hit hands the compiled kernel the
    call's own tensors, never an earlier call's."""
    kernel = FakeJIT(keywords=True)

    def call(lists, table, size=64, x=None):
        x = _aligned() if x is None else x
        triton_launch.launch(kernel, (2,), (x, 64), dict(BLOCK=32),
                             dict(LISTS=lists, MOD_ARGS=(table, size, 1)))  # fmt: skip

    call(_aligned(dtype=torch.int32), _aligned(dtype=torch.float32))
    lists, table = _aligned(dtype=torch.int32), _aligned(dtype=torch.float32)
    call(lists, table)
    assert _paths(kernel) == ["triton", "fast"]
    args = kernel.log[-1][3]
    assert args[3] is lists and args[4][0] is table  # this call's, not the first call's
    call(_aligned(dtype=torch.int32), _aligned(dtype=torch.bfloat16))  # a capture's dtype
    call(_aligned(dtype=torch.int32), _aligned(dtype=torch.float32), size=65)  # its size
    call(_aligned(dtype=torch.int32, offset=1), _aligned(dtype=torch.float32))  # alignment
    assert _paths(kernel)[2:] == ["triton"] * 3
    call(_aligned(dtype=torch.int32), _aligned(dtype=torch.float32), size=65)
    assert _paths(kernel)[-1] == "fast"


def test_tensors_in_keywords_not_keyed_are_keyed_by_identity(fake_triton):
    """Outside per_call a keyword tensor keys by identity: a new tensor takes Triton's path
    (what a caller that does not declare them gets: correct, never stale)."""
    kernel = FakeJIT(keywords=True)
    for _ in range(2):
        triton_launch.launch(kernel, (1,), (_aligned(), 64),
                             dict(BLOCK=32, LISTS=_aligned(dtype=torch.int32)))  # fmt: skip
    assert _paths(kernel) == ["triton", "triton"]


def test_a_per_call_keyword_the_cache_cannot_key_takes_tritons_path_every_time(fake_triton):
    kernel = FakeJIT(keywords=True)
    for _ in range(2):
        triton_launch.launch(kernel, (1,), (_aligned(), 64), dict(BLOCK=32),
                             dict(MOD_ARGS=(_aligned(), "not a scalar or tensor")))  # fmt: skip
    assert _paths(kernel) == ["triton", "triton"]


def test_a_prepared_launch_puts_each_calls_keyword_values_in_their_places(fake_triton):
    """prepare(per_call=) keeps none of the first call's keyword tensors; with_values hands
    the compiled kernel this call's, in their parameters' places (without the cache, through
    launch with them as keywords)."""
    kernel = FakeJIT(keywords=True)
    lists, table = _aligned(dtype=torch.int32), _aligned(dtype=torch.float32)
    prepared = triton_launch.prepare(kernel, (2,), (_aligned(), 64), dict(BLOCK=32),
                                     dict(LISTS=lists, MOD_ARGS=(table, 64, 1)))  # fmt: skip
    assert prepared.names == ("LISTS", "MOD_ARGS")
    assert not any(a is lists or type(a) is tuple for a in prepared.rest)
    x, lists2, table2 = _aligned(), _aligned(dtype=torch.int32), _aligned(dtype=torch.float32)
    prepared.with_values((x,), (lists2, (table2, 64, 1)))
    path, _, grid, args = kernel.log[-1]
    assert path == "fast" and grid == (2, 1, 1)
    assert args[0] is x and args[1] == 64 and args[2] == 32
    assert args[3] is lists2 and args[4][0] is table2
    triton_launch.ENABLED = False  # (monkeypatched back by the fixture)
    uncached = FakeJIT(keywords=True)
    prepared = triton_launch.prepare(uncached, (2,), (_aligned(), 64), dict(BLOCK=32),
                                     dict(LISTS=lists, MOD_ARGS=(table, 64, 1)))  # fmt: skip
    prepared.with_values((x,), (lists2, (table2, 64, 1)))
    path, _, args, constexprs = uncached.log[-1]
    assert path == "triton" and args[0] is x
    assert constexprs["LISTS"] is lists2 and constexprs["MOD_ARGS"][0] is table2


@pytest.mark.parametrize("places", [(3,), (2, 3, 4), (2, 3, 4, 8), (0,), (9,), (0, 1, 9)])
def test_with_values_joins_the_pieces_around_each_run_of_places(places):
    """Prepared.with_values builds the launcher's arguments by tuple concatenation around
    runs of adjacent per-call places (a block mask's three lists are one run): the result
    must be rest with each place replaced, wherever the runs fall."""
    received = []
    rest = tuple(range(10))
    names = tuple(f"K{p}" for p in places)
    prepared = triton_launch.Prepared(None, None, (), {}, lambda *a: received.append(a), rest,
                                      None, names, places)  # fmt: skip
    values = tuple(f"value {p}" for p in places)
    prepared.with_values(("x",), values)
    want = list(rest)
    for place, value in zip(places, values, strict=True):
        want[place] = value
    assert received == [("x", *want)]
    with pytest.raises(ValueError, match="per-call values"):
        prepared.with_values(("x",), values[:-1])
