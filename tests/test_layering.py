"""The package's imports go down its floors and never in a circle (docs/design.md, the layout table).

Each unit (a top-level module or subpackage of ``mok_megatron``) stands on one floor; a module may import
from its own unit and from units on lower floors only. Two units on the same floor do not import each
other. The package never imports the repository's ``benchmarks/`` or ``tests/``. Imports inside functions
count like those at the top of a module: a lazy import still ties the two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mok_megatron"

FLOORS = (  # lowest first
    ("__init__", "compat", "options", "errors", "experts_contract"),
    ("kernels",),
    ("ops",),
    ("config",),
    ("transport", "experts"),
    ("engine",),
    ("adapter",),
    ("spec",),
    ("training",),
    ("bench", "arguments", "pretrain_gpt"),
    ("tools",),
    ("cli",),
)
FLOOR = {unit: i for i, units in enumerate(FLOORS) for unit in units}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path, module: str) -> set[str]:
    """Every module of the package (or outside name) ``path`` imports, resolved to the deepest module."""
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.add(target)
            for a in node.names:  # ``from pkg import submodule`` names a module
                out.add(f"{target}.{a.name}")
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        deps = set()
        for imp in _imports(path, name):
            if imp.startswith(("benchmarks", "tests")):
                deps.add(imp)
            elif imp in files and imp != name:
                deps.add(imp)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_every_unit_has_a_floor():
    units = {_unit(m) for m in _graph()}
    missing = sorted(units - FLOOR.keys())
    assert not missing, f"units {missing} stand on no floor: add them to FLOORS in {__file__}"


def test_no_import_circle():
    cycles = _cycles(_graph())
    assert not cycles, f"modules that import each other in a circle: {cycles}"


def test_imports_go_down_the_floors():
    wrong = []
    for name, deps in _graph().items():
        unit = _unit(name)
        for dep in deps:
            if dep.startswith(("benchmarks", "tests")):
                wrong.append(
                    f"{name} -> {dep} (the package never imports the repository's {dep.split('.')[0]}/)"
                )
                continue
            other = _unit(dep)
            if other == unit:
                continue
            if FLOOR[other] > FLOOR[unit]:
                wrong.append(f"{name} -> {dep} (floor {FLOOR[unit]} imports floor {FLOOR[other]})")
            elif FLOOR[other] == FLOOR[unit]:
                wrong.append(f"{name} -> {dep} ({unit} and {other} share floor {FLOOR[unit]})")
    assert not wrong, "imports that run up a floor or across one:\n" + "\n".join(sorted(wrong))


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ],
)
def test_cycle_finder(graph, expected):
    assert _cycles(graph) == expected
