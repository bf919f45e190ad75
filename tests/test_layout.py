"""The package's shape: no function too long to read (the server's routes once lived
in one closure of 971 lines) and no import circle, TYPE_CHECKING and function-local
imports included."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "stepmtp"
MAX_FUNCTION_LINES = 250
#: create_app only composes: state, middleware, error handlers, routers
MAX_CREATE_APP_LINES = 120


def _modules() -> dict[str, tuple[ast.Module, bool]]:
    """Dotted name -> (syntax tree, is a package)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts.pop()
        out[".".join(parts)] = (ast.parse(path.read_text(), str(path)), is_pkg)
    return out


def _bound_names(tree: ast.Module) -> set[str]:
    """The names a module binds at its top level (what ``from pkg import name`` can mean)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def _imports(mods: dict[str, tuple[ast.Module, bool]]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its text."""
    bound = {name: _bound_names(tree) for name, (tree, _) in mods.items()}
    graph: dict[str, set[str]] = {}
    for name, (tree, is_pkg) in mods.items():
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")[: len(name.split(".")) + is_pkg - node.level]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for a in node.names:
                    if f"{source}.{a.name}" in mods:
                        edges.add(f"{source}.{a.name}")
                    elif source in mods and (not mods[source][1] or a.name in bound[source]):
                        edges.add(source)
                    # else a package's submodule that is no .py file (the cffi binding)
        graph[name] = {e for e in edges if e in mods and e != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_function_over_250_lines():
    long = [(f"{name}.{node.name}", node.end_lineno - node.lineno + 1)
            for name, (tree, _) in _modules().items() for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []


def test_create_app_only_composes():
    tree, _ = _modules()["stepmtp.server.app"]
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "create_app"]
    assert fn.end_lineno - fn.lineno + 1 <= MAX_CREATE_APP_LINES


def test_no_import_circle():
    assert _cycles(_imports(_modules())) == []


def test_a_circle_through_type_checking_or_a_function_counts():
    mods = {"p": (ast.parse(""), True),
            "p.a": (ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"), False),
            "p.b": (ast.parse("def f():\n    from . import a\n"), False),
            "p.c": (ast.parse("from . import a, _ext\n"), False)}
    graph = _imports(mods)
    assert graph["p.c"] == {"p.a"}  # _ext: an extension module, not the package
    assert _cycles(graph) == [["p.a", "p.b"]]
