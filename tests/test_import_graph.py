"""The package's import graph, deferred imports included: no circle anywhere, and no arrow
running up the layers (issue #59).

Edges are every `import` / `from ... import` of fusedattn's own modules in every file under
python/fusedattn, at module level or inside a function (a package's __init__ is its own node).
Imports of optional third-party packages (triton, transformers, vllm) may be deferred; an
import of fusedattn's own module inside a function is an edge like any other, and is allowed
only where DEFERRED lists it with the reason its comment in the code gives.

The layers, lowest first (docs/development.md draws them): the level-0 modules, the naive ops
(fusedattn.reference), ops.core, ops.shared, the op families, the ops package, the drop-in
modules, and what stands on them. An edge may stay within a layer or go down, never up, and no
op family imports another.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "fusedattn"

LEVEL0 = ("_version", "_build", "masks", "block_mask", "checks", "mla_checks", "cache_layout",
          "autocast", "fp8", "invariance", "nn_interfaces", "testing", "score_mod")  # fmt: skip
FAMILIES = ("attention", "decode", "rowwise", "linear", "mla")

# (importer, imported): fusedattn's own imports made inside a function, each with its reason.
DEFERRED: dict[tuple[str, str], str] = {}


def module_name(path: Path) -> str:
    parts = ("fusedattn", *path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]):
    """(target, deferred) for each import of a fusedattn module in the file."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    yield from imports_in(path.read_text(encoding="utf-8"), name, package, modules)


def imports_in(source: str, name: str, package: str, modules: set[str]):
    tree = ast.parse(source)
    top = set(map(id, tree.body))
    for node in ast.walk(tree):
        targets = set()
        if isinstance(node, ast.Import):
            targets = {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:  # `from . import x` may name a submodule
                sub = f"{base}.{alias.name}"
                targets.add(sub if sub in modules else base)
        for target in targets:
            if target in modules and target != name:
                yield target, id(node) not in top


def edges(*, deferred: bool) -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        name: {t for t, late in imports(path, set(paths)) if deferred or not late}
        for name, path in paths.items()
    }


def deferred_edges() -> set[tuple[str, str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {
        (name, t) for name, path in paths.items() for t, late in imports(path, set(paths)) if late
    }


def layer(module: str) -> tuple[int, str]:
    """(rank, family) of a module: rank orders the layers; family names an op family."""
    parts = module.split(".")[1:]
    head = parts[0] if parts else ""
    if head in LEVEL0:
        return 0, ""
    if head == "reference":
        return 1, ""
    if head == "ops":
        if len(parts) == 1:
            return 5, ""
        if parts[1] == "core":
            return 2, ""
        if parts[1] == "shared":
            return 3, ""
        assert parts[1] in FAMILIES, f"{module}: not in a known ops layer"
        return 4, parts[1]
    if head == "modules":
        return 6, ""
    return 7, ""  # distributed, compat, integrations, support, info, the package itself


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


def test_the_import_graph_has_no_circle_deferred_imports_included():
    cycle = find_cycle(edges(deferred=True))
    assert cycle is None, " -> ".join(cycle)


def test_no_import_runs_up_the_layers_and_no_op_family_imports_another():
    bad = []
    for name, targets in edges(deferred=True).items():
        (rank, family) = layer(name)
        for target in targets:
            (target_rank, target_family) = layer(target)
            if target_rank > rank or (rank == target_rank == 4 and family != target_family):
                bad.append(f"{name} -> {target}")
    assert not bad, "\n".join(sorted(bad))


def test_deferred_imports_of_fusedattn_modules_are_the_listed_ones():
    found = deferred_edges()
    assert found == set(DEFERRED), (
        f"unlisted: {sorted(found - set(DEFERRED))}; listed but gone: "
        f"{sorted(set(DEFERRED) - found)}"
    )


def test_the_reference_layer_imports_only_level_zero_modules():
    for name, targets in edges(deferred=True).items():
        if layer(name)[0] == 1:
            assert all(layer(t)[0] <= 1 for t in targets), f"{name} imports {sorted(targets)}"


def test_the_graph_walker_sees_deferred_imports():
    """The walker itself: an import inside a function is an edge (the bug that hid two
    circles), a module-level one too."""
    source = "import fusedattn.masks\n\ndef f():\n    from . import checks\n"
    modules = {"fusedattn.masks", "fusedattn.checks", "fusedattn.probe"}
    found = set(imports_in(source, "fusedattn.probe", "fusedattn", modules))
    assert found == {("fusedattn.masks", False), ("fusedattn.checks", True)}


KERNELS = PACKAGE.parents[1] / "triton_kernels"  # installed as fusedattn.triton_kernels


def test_the_kernel_files_import_one_way():
    """triton_kernels/ has no circle either (attention.py and attention_blocks.py imported
    each other; the tile loops both call now live in attention_loops.py, issue #82)."""
    paths = {f"fusedattn.triton_kernels.{p.stem}": p for p in KERNELS.glob("*.py")}
    graph = {
        name: {t for t, _ in imports_in(path.read_text(encoding="utf-8"), name,
                                        "fusedattn.triton_kernels", set(paths))}
        for name, path in paths.items()
    }  # fmt: skip
    assert "fusedattn.triton_kernels.attention_loops" in graph["fusedattn.triton_kernels.attention"]
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)
