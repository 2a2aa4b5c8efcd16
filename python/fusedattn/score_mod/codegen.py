"""A traced score_mod (ir.py) written out as Triton source, one module per structure, saved
to a file (tracebacks and `inspect` show it) and imported; the attention kernels take its
functions as `tl.constexpr` arguments and call them on each tile (Triton's JIT compiles them
into the kernel: no Dynamo, no Inductor).

The module has three functions of (score, b, h, q_idx, kv_idx, A): score, q_idx and kv_idx are
the tile's scores (float32, scale·q·k) and indices broadcast to it (either orientation: dK/dV
tiles are transposed), b and h int32 scalars, A the captured tensors' arguments:

- `score_mod(...)`: the modified scores;
- `score_mod_dscore(..., dy, inside)`: the gradient of the scores from the gradient dy of the
  modified ones (the dK/dV kernel's);
- `score_mod_grad(..., dy, inside)`: the same, and each captured tensor that requires grad
  gets dy times its partial derivative added to its gradient buffer (float32 atomics; the
  dQ kernel's, whose tiles hold queries along axis 0 and keys along axis 1: an entry shared
  by a row, a column or the whole tile is summed there first, one atomic per entry). inside
  (None in interior tiles) masks the tile's positions past the sequence.

A is flat: per capture its pointer, sizes and strides, then per captured tensor that requires
grad its gradient buffer's pointer and strides (`arguments` builds it in that order). A
negative index counts from the end; an index out of range fails a device_assert (in the
interpreter, and on a GPU with TRITON_DEBUG=1) and reads 0 otherwise, never out of bounds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import sys
import threading

from . import ir
from .ir import BOOL, FLOAT, INT32, INT64, Node

# ops whose result carries no gradient to its operands (piecewise constant, or a leaf)
_NO_GRADIENT = frozenset(("load", "const", "floor", "ceil", "trunc", "sign", "floordiv",
                          "truncdiv", "detach"))  # fmt: skip
_TL = {FLOAT: "tl.float32", INT32: "tl.int32", INT64: "tl.int64", BOOL: "tl.int1"}
_INPUT_VARS = {"score": "score", "b": "b", "h": "h", "q_idx": "q_idx", "kv_idx": "kv_idx"}
LN2 = math.log(2.0)


def layout(captures, grads) -> tuple[list[int], list[int]]:
    """Offsets in A of each capture's pointer and of each gradient buffer's pointer (-1 for a
    capture without one)."""
    bases, offset = [], 0
    for _dtype, ndim, _wide in captures:
        bases.append(offset)
        offset += 1 + 2 * ndim
    grad_bases = []
    for (_dtype, ndim, _wide), wanted in zip(captures, grads, strict=True):
        grad_bases.append(offset if wanted else -1)
        if wanted:
            offset += 1 + ndim
    return bases, grad_bases


def arguments(tensors, grad_buffers=None) -> tuple:
    """The A tuple of one call: tensors in capture order, grad_buffers (None where a capture
    has none; None: no capture has one) likewise."""
    args = []
    for t in tensors:
        args.append(t)
        args.extend(t.shape)
        args.extend(t.stride())
    for g in grad_buffers or ():
        if g is not None:
            args.append(g)
            args.extend(g.stride())
    return tuple(args)


def _literal(node: Node) -> str:
    value = node.attrs[0]
    if node.dtype == BOOL:
        return f"tl.full([], {int(value)}, tl.int1)"
    if node.dtype == FLOAT:
        if math.isinf(value):
            return 'float("inf")' if value > 0 else 'float("-inf")'
        if math.isnan(value):
            return 'float("nan")'
        return repr(float(value))
    return repr(int(value))


def _reciprocal(n: Node) -> str | None:
    """1 / c as a literal where n divides a float by a finite, nonzero constant c: Triton's
    float32 `/` is div.full.f32 (an RCP and a multiply, within 2 ulp), the product with the
    rounded reciprocal within 1.5 ulp (exact for a power of two): a softcap mod's
    tanh(s / 30) * 30, block-sparse dK/dV at sm_90, 450 -> 440 instructions per iteration."""
    if n.op != "div" or n.dtype != FLOAT or n.args[1].op != "const":
        return None
    c = float(n.args[1].attrs[0])
    if c == 0.0 or not math.isfinite(c) or not math.isfinite(1.0 / c):
        return None
    return repr(1.0 / c)


class _Writer:
    def __init__(self, output: Node, captures, grads, mod: str, names, proven=None):
        self.output = output
        self.order = ir.topological(output)
        loads = [n for n in self.order if n.op == "load"]
        self.proven = {id(n) for n, ok in zip(loads, proven or (), strict=False) if ok}
        self.number = {id(n): i for i, n in enumerate(self.order)}
        self.captures = captures
        self.grads = grads
        self.bases, self.grad_bases = layout(captures, grads)
        self.mod = mod
        self.names = names
        self.deps = {}
        for n in self.order:
            if n.op in _INPUT_VARS:
                self.deps[id(n)] = frozenset((n.op,))
            else:
                self.deps[id(n)] = frozenset().union(
                    *(self.deps[id(a)] for a in n.args if isinstance(a, Node))
                )

    def var(self, node: Node) -> str:
        if node.op in _INPUT_VARS:
            return _INPUT_VARS[node.op]
        if node.op == "const":
            return _literal(node)
        return f"v{self.number[id(node)]}"

    # ---- forward ---------------------------------------------------------------------------

    def forward(self) -> list[str]:
        lines = []
        for n in self.order:
            if n.op in _INPUT_VARS or n.op == "const":
                continue
            lines.extend(self._forward(n))
        return lines

    def _forward(self, n: Node) -> list[str]:
        v = self.var(n)
        a = [self.var(x) for x in n.args]
        op = n.op
        integer = n.args and n.args[0].dtype in (INT32, INT64)
        if op == "load":
            return self._load(n, v, a)
        if op == "cast":
            target = n.attrs[0]
            src = n.args[0]
            if target in ("float16", "bfloat16"):  # rounded to nearest even (the interpreter's
                # bfloat16 cast too: ops/core/interpreter.py)
                return [f"{v} = {a[0]}.to(tl.{target}).to(tl.float32)"]
            if n.dtype == BOOL:
                return [f"{v} = {a[0]} != 0"]
            if src.dtype == BOOL:
                return [f"{v} = {a[0]}.to({_TL[n.dtype]})"]
            return [f"{v} = {a[0]}.to({_TL[n.dtype]})"]
        reciprocal = _reciprocal(n)
        if reciprocal is not None:  # one FMUL for div.full.f32's RCP and FMUL
            return [f"{v} = {a[0]} * {reciprocal}"]
        simple = {
            "add": "{0} + {1}", "sub": "{0} - {1}", "mul": "{0} * {1}", "div": "{0} / {1}",
            "min": "tl.minimum({0}, {1})", "max": "tl.maximum({0}, {1})",
            "eq": "{0} == {1}", "ne": "{0} != {1}", "lt": "{0} < {1}", "le": "{0} <= {1}",
            "gt": "{0} > {1}", "ge": "{0} >= {1}", "and": "{0} & {1}", "or": "{0} | {1}",
            "xor": "{0} ^ {1}", "where": "tl.where({0}, {1}, {2})", "neg": "-{0}",
            "abs": "tl.abs({0})", "sign": "sm.sign({0})", "floor": "tl.floor({0})",
            "ceil": "tl.ceil({0})", "trunc": "sm.trunc({0})", "exp": "tl.exp({0})",
            "exp2": "tl.exp2({0})", "expm1": "sm.expm1({0}, INTERPRETED)", "log": "tl.log({0})",
            "log2": "tl.log2({0})", "log1p": "sm.log1p({0}, INTERPRETED)",
            "sqrt": "tl.sqrt_rn({0})", "rsqrt": "tl.rsqrt({0})", "sin": "tl.sin({0})",
            "cos": "tl.cos({0})", "tan": "sm.tan({0}, INTERPRETED)",
            "tanh": "sm.tanh({0}, INTERPRETED, FAST)", "sigmoid": "tl.sigmoid({0})",
            "erf": "tl.erf({0})", "gelu": "sm.gelu({0})",
            "gelu_tanh": "sm.gelu_tanh({0}, INTERPRETED)", "silu": "{0} * tl.sigmoid({0})",
            "not": "{0} == 0", "invert": "~{0}", "detach": "{0}",
        }  # fmt: skip
        if op == "relu":
            return [f"{v} = tl.maximum({a[0]}, {'0' if integer else '0.0'})"]
        if op == "softplus":
            beta, threshold = n.attrs
            return [f"{v} = sm.softplus({a[0]}, {beta!r}, {threshold!r}, INTERPRETED)"]
        if op in ("floordiv", "mod", "fmod", "truncdiv"):
            if integer:
                form = {"floordiv": "sm.floordiv({0}, {1})", "mod": "sm.floormod({0}, {1})",
                        "truncdiv": "sm.truncdiv({0}, {1})",
                        "fmod": "{0} - sm.truncdiv({0}, {1}) * {1}"}[op]  # fmt: skip
            else:
                form = {"floordiv": "tl.floor({0} / {1})",
                        "mod": "{0} - tl.floor({0} / {1}) * {1}",
                        "truncdiv": "sm.trunc({0} / {1})",
                        "fmod": "{0} - sm.trunc({0} / {1}) * {1}"}[op]  # fmt: skip
            return [f"{v} = {form.format(*a)}"]
        if op == "pow":
            return self._pow(v, a[0], n.attrs[0], n.dtype)
        return [f"{v} = {simple[op].format(*a)}"]

    def _pow(self, v, x, exponent, dtype) -> list[str]:
        if exponent == 0:
            one = "1.0" if dtype == FLOAT else "1"
            return [f"{v} = tl.zeros_like({x}) + {one}"]
        lines, power, base, result, k = [], abs(exponent), x, None, 0
        while power:  # square and multiply
            if power & 1:
                result = base if result is None else f"({result} * {base})"
            power >>= 1
            if power:
                lines.append(f"{v}_sq{k} = {base} * {base}")
                base, k = f"{v}_sq{k}", k + 1
        lines.append(f"{v} = {result}" if exponent > 0 else f"{v} = 1.0 / {result}")
        return lines

    def _load(self, n: Node, v: str, a: list[str]) -> list[str]:
        c = n.attrs[0]
        base = self.bases[c]
        ndim = self.captures[c][1]
        convert = f".to({_TL[n.dtype]})" if n.dtype != BOOL else " != 0"
        if ndim == 0:
            return [f"{v} = tl.load(A[{base}]){convert}"]
        lines, terms, oks = [], [], []
        a = [
            f"tl.full([], {x.attrs[0]}, tl.int64)" if x.op == "const" else name
            for x, name in zip(n.args, a, strict=True)
        ]  # a constant index: a scalar tensor
        wide = self.captures[c][2]
        if id(n) in self.proven:  # every index inside the tensor for this call's extents
            for d in range(ndim):
                index = f"{a[d]}.to(tl.int64)" if wide else a[d]
                lines.append(f"{v}_i{d} = {index}")
                terms.append(f"{v}_i{d} * A[{base + 1 + ndim + d}]")
            lines.append(f"{v} = tl.load(A[{base}] + {' + '.join(terms)}){convert}")
            return lines
        for d in range(ndim):
            size, stride = f"A[{base + 1 + d}]", f"A[{base + 1 + ndim + d}]"
            lines.append(f"{v}_i{d} = sm.wrap_index({a[d]}, {size}, {wide})")
            oks.append(f"sm.in_range({v}_i{d}, {size})")
            terms.append(f"{v}_i{d} * {stride}")
        lines.append(f"{v}_ok = {' & '.join(oks)}")
        name = self.names[c] if c < len(self.names) else f"capture {c}"
        message = f"score_mod {self.mod}: an index of `{name}` is out of range"
        lines.append(f"tl.device_assert({v}_ok, {message!r})")
        lines.append(f"{v} = tl.load(A[{base}] + {' + '.join(terms)}, mask={v}_ok, other=0)"
                     f"{convert}")  # fmt: skip
        return lines

    # ---- backward --------------------------------------------------------------------------

    def _active(self, with_captures: bool) -> set[int]:
        active = set()
        for n in self.order:
            if n.dtype != FLOAT:
                continue
            if (
                n.op == "score"
                or (with_captures and n.op == "load" and self.grads[n.attrs[0]])
                or (n.op not in _NO_GRADIENT and any(id(x) in active for x in n.args))
            ):
                active.add(id(n))
        return active

    def backward(self, with_captures: bool) -> list[str]:
        """Reverse-mode lines after the forward ones: g<i> the gradient of node i."""
        active = self._active(with_captures)
        lines = []
        grads: dict[int, str] = {}

        def add(node: Node, expr: str):
            if id(node) not in active:
                return
            name = f"g{self.number[id(node)]}"
            if id(node) in grads:
                lines.append(f"{name} = {name} + {expr}")
            else:
                lines.append(f"{name} = {expr}")
                grads[id(node)] = name

        out = self.output
        if id(out) in active:
            grads[id(out)] = "dy"
        for n in reversed(self.order):
            g = grads.get(id(n))
            if g is None or n.op in _INPUT_VARS:
                continue
            if n.op == "load":
                lines.extend(self._accumulate(n, g))
                continue
            args = n.args
            a = [self.var(x) for x in args]
            v = self.var(n)
            op = n.op
            if op == "add":
                add(args[0], g)
                add(args[1], g)
            elif op == "sub":
                add(args[0], g)
                add(args[1], f"-{g}")
            elif op == "mul":
                add(args[0], f"{g} * {a[1]}")
                add(args[1], f"{g} * {a[0]}")
            elif op == "div" and _reciprocal(n) is not None:
                add(args[0], f"{g} * {_reciprocal(n)}")
            elif op == "div":
                add(args[0], f"{g} / {a[1]}")
                add(args[1], f"-{g} * {v} / {a[1]}")
            elif op == "neg":
                add(args[0], f"-{g}")
            elif op == "abs":
                add(args[0], f"tl.where({a[0]} > 0, {g}, tl.where({a[0]} < 0, -{g}, 0.0))")
            elif op == "relu":
                add(args[0], f"tl.where({v} > 0, {g}, 0.0)")
            elif op == "exp":
                add(args[0], f"{g} * {v}")
            elif op == "exp2":
                add(args[0], f"{g} * {v} * {LN2!r}")
            elif op == "expm1":
                add(args[0], f"{g} * ({v} + 1.0)")
            elif op == "log":
                add(args[0], f"{g} / {a[0]}")
            elif op == "log2":
                add(args[0], f"{g} / ({a[0]} * {LN2!r})")
            elif op == "log1p":
                add(args[0], f"{g} / (1.0 + {a[0]})")
            elif op == "sqrt":
                add(args[0], f"{g} / (2.0 * {v})")
            elif op == "rsqrt":
                add(args[0], f"-0.5 * {g} * {v} * {v} * {v}")
            elif op == "sin":
                add(args[0], f"{g} * tl.cos({a[0]})")
            elif op == "cos":
                add(args[0], f"-{g} * tl.sin({a[0]})")
            elif op == "tan":
                add(args[0], f"{g} * (1.0 + {v} * {v})")
            elif op == "tanh":
                add(args[0], f"{g} * (1.0 - {v} * {v})")
            elif op == "sigmoid":
                add(args[0], f"{g} * {v} * (1.0 - {v})")
            elif op == "erf":
                add(args[0], f"{g} * 1.1283791670955126 * tl.exp(-{a[0]} * {a[0]})")
            elif op == "gelu":
                add(args[0], f"{g} * sm.d_gelu({a[0]})")
            elif op == "gelu_tanh":
                add(args[0], f"{g} * sm.d_gelu_tanh({a[0]}, INTERPRETED)")
            elif op == "silu":
                s = f"tl.sigmoid({a[0]})"
                add(args[0], f"{g} * {s} * (1.0 + {a[0]} * (1.0 - {s}))")
            elif op == "softplus":
                beta, threshold = n.attrs
                z = f"tl.exp({a[0]} * {beta!r})"
                add(args[0], f"tl.where({a[0]} * {beta!r} > {threshold!r}, {g}, {g} * {z} / "
                             f"({z} + 1.0))")  # fmt: skip
            elif op == "pow":
                k = n.attrs[0]
                if k == 1:
                    add(args[0], g)
                elif k == 2:
                    add(args[0], f"{g} * 2.0 * {a[0]}")
                elif k != 0:
                    add(args[0], f"{g} * {float(k)!r} * {v} / {a[0]}")
            elif op in ("min", "max"):
                wins = "<" if op == "min" else ">"
                add(args[0], f"tl.where({a[0]} {wins} {a[1]}, {g}, tl.where({a[0]} == {a[1]}, "
                             f"0.5 * {g}, 0.0))")  # fmt: skip
                add(args[1], f"tl.where({a[1]} {wins} {a[0]}, {g}, tl.where({a[0]} == {a[1]}, "
                             f"0.5 * {g}, 0.0))")  # fmt: skip
            elif op == "where":
                add(args[1], f"tl.where({a[0]}, {g}, 0.0)")
                add(args[2], f"tl.where({a[0]}, 0.0, {g})")
            elif op == "cast":  # a half-precision cast's gradient is rounded there too (torch)
                target = n.attrs[0]
                if target in ("float16", "bfloat16"):
                    add(args[0], f"{g}.to(tl.{target}).to(tl.float32)")
                else:
                    add(args[0], g)
            elif op == "mod":
                add(args[0], g)
                add(args[1], f"-{g} * tl.floor({a[0]} / {a[1]})")
            elif op == "fmod":
                add(args[0], g)
                add(args[1], f"-{g} * sm.trunc({a[0]} / {a[1]})")
        score = next((n for n in self.order if n.op == "score"), None)
        result = grads.get(id(score)) if score is not None else None
        # 0 where dy is: a hidden score's slope may be inf or NaN (log of a masked score)
        lines.append("return tl.where(dy == 0.0, 0.0, "
                     f"{result if result else 'tl.zeros_like(dy)'})")  # fmt: skip
        return lines

    def _accumulate(self, n: Node, g: str) -> list[str]:
        """dy·∂out/∂entry into the capture's gradient buffer (float32 atomics), summed first
        over the tile axes its index does not depend on."""
        c = n.attrs[0]
        gbase = self.grad_bases[c]
        ndim = self.captures[c][1]
        v = self.var(n)
        deps = frozenset().union(*(self.deps[id(x)] for x in n.args)) if n.args else frozenset()
        on_rows, on_cols = "q_idx" in deps, "kv_idx" in deps
        lines = [f"{v}_g = tl.where(dy != 0.0, {g}, 0.0)",  # 0 where hidden (a NaN slope too)
                 "if inside is not None:", f"    {v}_g = tl.where(inside, {v}_g, 0.0)"]  # fmt: skip
        if on_rows and on_cols:
            pass
        elif on_rows:
            lines.append(f"{v}_g = tl.sum({v}_g, axis=1, keep_dims=True)")
        elif on_cols:
            lines.append(f"{v}_g = tl.sum({v}_g, axis=0, keep_dims=True)")
        else:
            lines.append(f"{v}_g = tl.sum(tl.sum({v}_g, axis=1), axis=0)")
        if ndim == 0:
            lines.append(f"tl.atomic_add(A[{gbase}], {v}_g, sem='relaxed')")
            return lines
        offset = " + ".join(f"{v}_i{d} * A[{gbase + 1 + d}]" for d in range(ndim))
        ok = "" if id(n) in self.proven else f"{v}_ok & "
        lines.append(f"tl.atomic_add(A[{gbase}] + {offset}, {v}_g, mask={ok}({v}_g != 0.0), "
                     "sem='relaxed')")  # fmt: skip
        return lines


HEADER = '''"""Generated by fusedattn.score_mod from {mod}; do not edit (a new structure writes a new
file). The traced graph:

{graph}
"""

import triton
import triton.language as tl

from fusedattn.triton_kernels import score_mod_math as sm

INTERPRETED = tl.constexpr({interpreted})
FAST = tl.constexpr({fast})  # the kernel's dots at reduced precision: tanh's fast form
'''


def source(output: Node, graph: ir.Graph, grads, interpreted: bool, mod: str, names,
           proven=None, fast: bool = False) -> str:  # fmt: skip
    """The module's text; proven: per load node (topological order) whether its indices
    are known to lie inside the tensor (bounds.py: no wrap, no bounds mask)."""
    w = _Writer(output, graph.captures, grads, mod, names, proven)
    forward = w.forward()
    result = w.var(output)
    if "score" not in w.deps[id(output)]:  # a result of fewer dims: the tile's shape
        forward = [*forward, f"out = {result} + tl.zeros_like(score)"]
        result = "out"
    body = [f"    {line}" for line in forward]
    text = HEADER.format(mod=mod.replace('"', "'"), graph=ir.describe(output, graph.captures),
                         interpreted=interpreted, fast=fast)  # fmt: skip
    signature = "score, b, h, q_idx, kv_idx, A"
    text += f"\n\n@triton.jit\ndef score_mod({signature}):\n"
    text += "\n".join([*body, f"    return {result}"]) + "\n"
    text += f"\n\n@triton.jit\ndef score_mod_dscore({signature}, dy, inside):\n"
    text += "\n".join(body + [f"    {line}" for line in w.backward(False)]) + "\n"
    if any(grads):
        text += f"\n\n@triton.jit\ndef score_mod_grad({signature}, dy, inside):\n"
        text += "\n".join(body + [f"    {line}" for line in w.backward(True)]) + "\n"
    return text


def _folder() -> str:
    root = os.environ.get("FUSEDATTN_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fusedattn"
    )
    return os.path.join(root, "score_mod")


_LOCK = threading.Lock()
_MODULES: dict[str, object] = {}


def load(text: str):
    """The module of this source, written to the cache folder (one file per text, by
    digest) and imported once per process."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:20]
    module = _MODULES.get(digest)
    if module is not None:
        return module
    with _LOCK:
        module = _MODULES.get(digest)
        if module is not None:
            return module
        folder = _folder()
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"mod_{digest}.py")
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)  # atomic: a concurrent writer writes the same text
        name = f"fusedattn_score_mod_{digest}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        _MODULES[digest] = module
        return module
