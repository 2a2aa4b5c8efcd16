"""The traced form of a score_mod: a graph of scalar operations over (score, b, h, q_idx,
kv_idx), Python constants and loads from captured tensors, with torch's dtypes and type
promotion (tracer.py builds it, codegen.py writes it out as Triton).

Every value is one scalar of the (query, key) pair the kernel tile holds, as under Flex's
vmap. Nodes are hash-consed (one node per (op, operands, attributes)), so an expression used
twice, or a table entry loaded twice at the same index, is computed once. Floats are computed
in float32 whatever a captured tensor holds (compiled Flex does the same in its kernels); a
cast to float16 or bfloat16 rounds the value there and stays float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FLOAT, INT32, INT64, BOOL = torch.float32, torch.int32, torch.int64, torch.bool

# what a captured tensor's values compute as
_COMPUTE = {
    torch.bool: BOOL,
    torch.uint8: INT32,
    torch.int8: INT32,
    torch.int16: INT32,
    torch.int32: INT32,
    torch.int64: INT64,
    torch.float16: FLOAT,
    torch.bfloat16: FLOAT,
    torch.float32: FLOAT,
    torch.float64: FLOAT,
}

UNARY_FLOAT = (  # float in, float out (an integer input is converted first, as torch does)
    "exp", "exp2", "expm1", "log", "log2", "log1p", "sqrt", "rsqrt", "sin", "cos", "tan",
    "tanh", "sigmoid", "erf", "gelu", "gelu_tanh", "silu", "softplus",
)  # fmt: skip
UNARY_SAME = ("neg", "abs", "sign", "relu", "floor", "ceil", "trunc", "detach")  # dtype kept
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
LOGICAL = ("and", "or", "xor")
ARITHMETIC = ("add", "sub", "mul", "div", "floordiv", "mod", "fmod", "truncdiv", "min", "max")


def compute_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a captured tensor's values compute as (None: not a type the kernels load)."""
    return _COMPUTE.get(dtype)


@dataclass(frozen=True, eq=False)
class Node:
    """One scalar operation. op: 'score', 'b', 'h', 'q_idx', 'kv_idx' (the inputs), 'const'
    (attrs: the value), 'load' (attrs: capture number; args: one index per dimension),
    'cast' (attrs: target name), 'pow' (attrs: the integer exponent), 'softplus' (attrs:
    beta, threshold), 'where', or a name of the tuples above."""

    op: str
    args: tuple
    dtype: torch.dtype
    attrs: tuple = ()


INPUTS = ("score", "b", "h", "q_idx", "kv_idx")


class Graph:
    """The nodes of one trace, hash-consed, and the captures its loads read."""

    def __init__(self):
        self._nodes: dict[tuple, Node] = {}
        # per capture: (dtype, ndim) of the tensor, the structure its loads assume
        self.captures: list[tuple[torch.dtype, int, bool]] = []  # dtype, rank, wide offsets
        self.inputs = {name: self.node(name, (), FLOAT if name == "score" else INT32)
                       for name in INPUTS}  # fmt: skip

    def node(self, op: str, args: tuple, dtype: torch.dtype, attrs: tuple = ()) -> Node:
        key = (op, tuple(id(a) for a in args), dtype, attrs)
        found = self._nodes.get(key)
        if found is None:
            found = self._nodes[key] = Node(op, args, dtype, attrs)
        return found

    def const(self, value) -> Node:
        if isinstance(value, bool):
            return self.node("const", (), BOOL, (value,))
        if isinstance(value, int):
            return self.node("const", (), INT32 if -(2**31) <= value < 2**31 else INT64,
                             (value,))  # fmt: skip
        return self.node("const", (), FLOAT, (float(value),))


def category(dtype: torch.dtype) -> int:
    return 0 if dtype == BOOL else (1 if dtype in (INT32, INT64) else 2)


def scalar_category(value) -> int:
    return 0 if isinstance(value, bool) else (1 if isinstance(value, int) else 2)


def promote(a, b) -> torch.dtype:
    """torch's result dtype of a binary op on two 0-dim values, Python scalars weakly typed:
    a scalar of a higher category (bool < int < float) gives that category's default
    (int64, float32), otherwise the tensor's dtype wins."""
    nodes = [x for x in (a, b) if isinstance(x, Node)]
    scalars = [x for x in (a, b) if not isinstance(x, Node)]
    if len(nodes) == 2:
        ca, cb = category(a.dtype), category(b.dtype)
        if ca != cb:
            return a.dtype if ca > cb else b.dtype
        if ca == 1:
            return INT64 if INT64 in (a.dtype, b.dtype) else INT32
        return a.dtype
    node, scalar = nodes[0], scalars[0]
    cs = scalar_category(scalar)
    if cs > category(node.dtype):
        return INT64 if cs == 1 else FLOAT
    return node.dtype


def fold(op: str, a, b=None):
    """op on Python constants, as Python (and torch on 0-dim values) computes it."""
    if op == "add":
        return a + b
    if op == "sub":
        return a - b
    if op == "mul":
        return a * b
    if op == "div":
        return a / b
    if op == "floordiv":
        return a // b
    if op == "mod":
        return a % b
    if op == "fmod":
        return math.fmod(a, b)
    if op == "truncdiv":
        return int(a / b) if isinstance(a, int) and isinstance(b, int) else float(math.trunc(a / b))
    if op == "min":
        return min(a, b)
    if op == "max":
        return max(a, b)
    comparisons = {"eq": a == b, "ne": a != b, "lt": a < b, "le": a <= b, "gt": a > b,
                   "ge": a >= b} if b is not None else {}  # fmt: skip
    if op in comparisons:
        return comparisons[op]
    if op in LOGICAL:
        if isinstance(a, bool) and isinstance(b, bool):
            return {"and": a and b, "or": a or b, "xor": a != b}[op]
        return {"and": a & b, "or": a | b, "xor": a ^ b}[op]
    raise AssertionError(f"fold: no rule for {op!r} (every binary op the tracer records has one)")


def topological(output: Node) -> list[Node]:
    """The nodes output depends on, each after its operands."""
    order, seen = [], set()
    stack = [(output, False)]
    while stack:
        node, expanded = stack.pop()
        if id(node) in seen:
            continue
        if expanded:
            seen.add(id(node))
            order.append(node)
            continue
        stack.append((node, True))
        for arg in reversed(node.args):
            if isinstance(arg, Node) and id(arg) not in seen:
                stack.append((arg, False))
    return order


def describe(output: Node, captures) -> str:
    """A canonical text of the graph: the cache key of its generated code (it holds no
    tensor values: captures by dtype and rank only)."""
    order = topological(output)
    number = {id(n): i for i, n in enumerate(order)}
    lines = [f"capture {i}: {str(d).removeprefix('torch.')}[{r}d{', int64 offsets' if w else ''}]"
             for i, (d, r, w) in enumerate(captures)]  # fmt: skip
    for n in order:
        args = ", ".join(f"%{number[id(a)]}" for a in n.args)
        attrs = "" if not n.attrs else " " + repr(n.attrs)
        lines.append(f"%{number[id(n)]} = {n.op}({args}){attrs} : {str(n.dtype)[6:]}")
    return "\n".join(lines)
