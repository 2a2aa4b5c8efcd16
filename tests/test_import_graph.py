"""The package's module-level imports form no circle (issue #33): fusedattn.reference holds the
naive ops and the reference transformer and imports neither fusedattn.ops nor
fusedattn.modules at import time; ops/ imports reference/, never the other way round.

Edges are the explicit module-level `import` / `from ... import` statements of every file under
python/fusedattn (imports inside functions are late by design and left out; a package's
__init__ is its own node)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "fusedattn"


def module_name(path: Path) -> str:
    parts = ("fusedattn", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def edges() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        for node in ast.parse(path.read_text(encoding="utf-8")).body:  # module level only
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                for alias in node.names:  # `from . import x` may name a submodule
                    sub = f"{base}.{alias.name}"
                    targets.add(sub if sub in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_module_level_import_graph_has_no_circle():
    cycle = find_cycle(edges())
    assert cycle is None, " -> ".join(cycle)


def test_the_reference_ops_import_neither_ops_nor_modules():
    graph = edges()
    reference = [
        m
        for m in graph
        if m.startswith("fusedattn.reference") and m != "fusedattn.reference.transformer"
    ]
    for name in reference:
        bad = {t for t in graph[name] if t.startswith(("fusedattn.ops", "fusedattn.modules"))}
        assert not bad, f"{name} imports {sorted(bad)}"
