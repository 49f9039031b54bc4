"""No import circle in vdpcp: the graph of every import between its modules, lazy (function-level) ones included,
has no cycle, and the house's floors stand where they should (the spec, the protocol and the harness import nothing
above them)."""

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


# The package's own __init__ and vdpcp.third_party (quieting third-party import notices) import nothing of vdpcp's.
BOTTOM = {"vdpcp", "vdpcp.third_party"}


@pytest.mark.parametrize("floor, allowed", [("vdpcp.spec", set()), ("vdpcp.protocol", {"vdpcp.model"}),
                                            ("vdpcp.harness", {"vdpcp.harness"})])
def test_the_floors_import_nothing_above_them(floor, allowed):
    edges = graph()
    assert not edges["vdpcp.third_party"] and edges["vdpcp"] <= {"vdpcp.third_party"}
    above = {target for name, targets in edges.items() if name == floor or name.startswith(floor + ".")
             for target in targets if target not in BOTTOM and not any(target == a or target.startswith(a + ".")
                                                                       for a in allowed)}
    assert not above, f"{floor} imports {sorted(above)}"
