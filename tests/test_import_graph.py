"""The package's modules import one another one way: no circle, lazy and type-only imports
included. The graph is read from the source with ``ast``; the control is a two-module
package whose circle must be named."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]    # the repository root is the package hpcai
SKIP = {"tests", "bench", "scripts", "charliecloud", "docs"}


def modules(root: Path, name: str) -> dict[str, Path]:
    """Every module of the package at ``root``: dotted name -> file."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[0] in SKIP or any(p.startswith(".") for p in parts):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join((name, *parts))] = path
    return found


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that ``module`` imports (a name taken from a package counts as
    its submodule where one exists)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            out.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names)
    return {m for m in out if m in known and m != module}


def cycles(root: Path, name: str) -> list[list[str]]:
    """Each circle once, as the modules along it (depth-first search, back edges)."""
    known = modules(root, name)
    graph = {m: sorted(imports(m, p, known)) for m, p in known.items()}
    state, stack, found = {}, [], []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in graph[m]:
            if state.get(n) == 1:
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)
    return found


def test_import_graph_has_no_circle():
    found = cycles(PACKAGE, "hpcai")
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_import_graph_names_a_circle(tmp_path):
    """Control: a package whose two modules import each other (one lazily) is refused."""
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from .a import g\n")
    (tmp_path / "c.py").write_text("from .b import f\n")
    assert cycles(tmp_path, "pkg") == [["pkg.a", "pkg.b", "pkg.a"]]
