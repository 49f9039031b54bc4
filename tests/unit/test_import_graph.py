"""No import circle in vdpcp: the graph of every import between its modules, lazy (function-level) ones included,
has no cycle, and the house's floors stand where they should (each package by job imports nothing above it)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "vdpcp"


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_of(name: str, path: Path, known: dict) -> set[str]:
    """The vdpcp modules ``name`` imports anywhere in its file: ``from pkg import sub`` is an edge to the submodule."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known and "." in target:
                target = target.rpartition(".")[0]
            if target in known and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_the_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_vdpcp_has_no_import_circle_lazy_imports_included():
    assert cycles(graph()) == []


# The package's own __init__, vdpcp._deprecated (the old import paths) and vdpcp.third_party (quieting third-party
# import notices) import nothing of vdpcp's.
BOTTOM = {"vdpcp", "vdpcp._deprecated", "vdpcp.third_party"}

# Each package by job, and what it may import beside itself and the bottom: the tree's floors, lowest first.
FLOORS = [
    ("vdpcp.feature.spec", set()),
    ("vdpcp.contract", {"vdpcp.feature.model"}),  # the default build_model, imported where it is called
    ("vdpcp.feature", {"vdpcp.contract"}),
    ("vdpcp.harness", set()),
    ("vdpcp.impls", {"vdpcp.contract", "vdpcp.feature", "vdpcp.oracle.compare.sketch"}),
    ("vdpcp.oracle.compare.sketch", set()),
    # The oracle reads a case's record and its sizing, never the matrix that runs or judges it.
    ("vdpcp.oracle", {"vdpcp.contract", "vdpcp.feature", "vdpcp.harness", "vdpcp.matrix.case", "vdpcp.matrix.budget"}),
    ("vdpcp.matrix.choices", set()),  # a case's choices by name, which the command line offers without torch
    ("vdpcp.matrix.case", {"vdpcp.contract", "vdpcp.feature", "vdpcp.impls", "vdpcp.matrix.choices"}),
    ("vdpcp.matrix.budget", {"vdpcp.contract", "vdpcp.feature", "vdpcp.impls", "vdpcp.harness.config"}),
]


def test_the_bottom_imports_nothing_of_vdpcp():
    edges = graph()
    assert all(edges[name] <= BOTTOM for name in BOTTOM), {name: edges[name] for name in BOTTOM}


@pytest.mark.parametrize("floor, allowed", FLOORS)
def test_the_floors_import_nothing_above_them(floor, allowed):
    edges = graph()
    assert any(name == floor or name.startswith(floor + ".") for name in edges), f"{floor} is not a vdpcp module"
    allowed = allowed | {floor}
    above = {target for name, targets in edges.items() if name == floor or name.startswith(floor + ".")
             for target in targets if target not in BOTTOM and not any(target == a or target.startswith(a + ".")
                                                                       for a in allowed)}
    assert not above, f"{floor} imports {sorted(above)}"


def private_names_imported(root: Path) -> list[str]:
    """``from X import _name`` anywhere under ``root`` where ``_name`` is not a module: a reach into another
    module's internals."""
    known, found = modules(), []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vdpcp"):
                found += [f"{path.relative_to(root.parent)}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")
                          and f"{node.module}.{a.name}" not in known]
    return found


def test_the_private_name_finder_finds_one(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "user.py").write_text("from vdpcp.feature.plan import _hidden\nfrom vdpcp import _deprecated\n")
    assert private_names_imported(tmp_path / "pkg") == ["pkg/user.py: vdpcp.feature.plan._hidden"]


@pytest.mark.parametrize("tree", ["vdpcp", "tests"])
def test_no_module_imports_another_modules_private_names(tree):
    assert private_names_imported(PACKAGE.parent / tree) == []
