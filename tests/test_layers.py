"""The package's imports only point down the layer order of docs/architecture.md, no module
imports itself back through others (no import circle), and the pure packages (KV manager,
scheduler, conductor) import no torch, clock or I/O. Read from the source with `ast`, so a lazy
import inside a function, or one only for type checking, counts too."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvpool"

# Lower rank = lower layer. A module may import its own layer or any layer below it.
LAYERS: dict[str, int] = {
    "errors": 0, "sizes": 0, "version": 0,
    "core": 1,
    "sched": 2,
    "costs": 3,
    "conductor": 4,
    "store": 5, "engine": 5,
    "sim": 6,  # drives core, sched and the conductor with a cost model: below the servers
    "serve": 7,
    "cluster": 8,  # the gateway: the conductor's real driver, an HTTP server like serve
    "bench": 9, "commands": 9, "cli": 9, "__init__": 9,
}

# Packages of pure Python: decisions only, time and costs come in as arguments.
PURE = {"core", "sched", "conductor"}

# Modules (first dotted component) that read a clock, touch files, processes or the network,
# or run threads; and torch. Pure modules import none of them.
IMPURE_MODULES = {
    "torch", "time", "datetime", "os", "sys", "io", "pathlib", "shutil", "tempfile", "socket", "ssl",
    "select", "selectors", "signal", "subprocess", "threading", "multiprocessing", "concurrent",
    "asyncio", "urllib", "http", "requests", "httpx", "aiohttp", "uvicorn", "fastapi", "sqlite3",
    "pickle", "shelve", "glob", "fcntl", "mmap", "uuid", "secrets",
}
IMPURE_CALLS = {"open", "print", "input", "breakpoint", "exec", "eval", "__import__"}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _layer_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _is_pure(path: Path) -> bool:
    return _layer_of(path) in PURE


def _imports(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            if node.module == "kvpool":
                found += [(node.lineno, f"kvpool.{a.name}") for a in node.names]
    return found


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports: `from kvpool.a import b` names the submodule
    a.b where there is one, else the package a; relative imports resolve against the module."""
    paths = {_module_name(p): p for p in _modules()}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.add(sub if sub in paths else base)
        graph[name] = {t for t in targets if t in paths and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One import circle (as a path that returns to its start) per strongly connected set of
    modules, by Tarjan's algorithm; empty when the graph has none."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.add(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(_circle_through(v, members, graph))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _circle_through(start: str, members: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from `start` back to itself inside one strongly connected set."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in no circle of {sorted(members)}")


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    me = _layer_of(path)
    rank = LAYERS[me]
    pure = _is_pure(path)
    rel = path.relative_to(PACKAGE.parent)
    bad = []
    for line, name in _imports(tree):
        parts = name.split(".")
        if parts[0] == "kvpool" and len(parts) > 1:
            other = parts[1]
            if other not in LAYERS:
                bad.append(f"{rel}:{line}: imports {name}, whose layer is not in LAYERS")
            elif LAYERS[other] > rank:
                bad.append(f"{rel}:{line}: {me} (layer {rank}) imports {name} (layer {LAYERS[other]})")
        if pure and parts[0] in IMPURE_MODULES:
            bad.append(f"{rel}:{line}: pure module imports {name}")
    if pure:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in IMPURE_CALLS:
                bad.append(f"{rel}:{node.lineno}: pure module calls {node.func.id}()")
    return bad


def test_every_package_directory_has_a_layer():
    tops = {_layer_of(p) for p in _modules()}
    assert tops <= set(LAYERS), f"no layer for {sorted(tops - set(LAYERS))}: add it to LAYERS and the docs"


def test_imports_point_down_and_pure_modules_stay_pure():
    bad = [v for p in _modules() for v in _violations(p)]
    assert not bad, "\n".join(bad)


def test_no_module_imports_itself_back_through_others():
    circles = _cycles(_import_graph())
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_check_catches_an_import_circle(tmp_path, monkeypatch):
    fake = tmp_path / "kvpool"
    (fake / "sched").mkdir(parents=True)
    (fake / "sched" / "__init__.py").write_text("")
    (fake / "sched" / "scheduler.py").write_text("from kvpool.sched.admission import Admission\n")
    (fake / "sched" / "admission.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvpool.sched import scheduler\n")
    (fake / "sched" / "output.py").write_text("from . import admission\nfrom .admission import Admission\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert _cycles(_import_graph()) == [["kvpool.sched.admission", "kvpool.sched.scheduler", "kvpool.sched.admission"]]
    (fake / "sched" / "admission.py").write_text("from kvpool.sched.output import X\n")  # a longer circle
    (fake / "sched" / "output.py").write_text("from . import scheduler\n")
    assert _cycles(_import_graph()) == [
        ["kvpool.sched.admission", "kvpool.sched.output", "kvpool.sched.scheduler", "kvpool.sched.admission"]]
    (fake / "sched" / "admission.py").write_text("")
    assert _cycles(_import_graph()) == []  # a diamond of imports is no circle


@pytest.mark.parametrize(("where", "source", "expected"), [
    ("core/x.py", "from kvpool.sched.request import Sequence\n", "imports kvpool.sched.request"),
    ("sched/x.py", "def f():\n    import time\n    return time.time()\n", "pure module imports time"),
    ("conductor/routing.py", "import httpx\n", "pure module imports httpx"),
    ("conductor/x.py", "from kvpool.cluster.members import Member\n", "imports kvpool.cluster.members"),
    ("sim/x.py", "from kvpool.serve.state import ServerState\n", "imports kvpool.serve.state"),
    ("sim/x.py", "from kvpool.cluster.gateway import Gateway\n", "imports kvpool.cluster.gateway"),
    ("core/x.py", "def f(p):\n    return open(p).read()\n", "calls open()"),
    ("conductor/x.py", "from kvpool import sim\n", "imports kvpool.sim"),
    ("store/x.py", "from kvpool import serve\n", "imports kvpool.serve"),
])
def test_the_check_catches_an_upward_or_impure_import(tmp_path, monkeypatch, where, source, expected):
    fake = tmp_path / "kvpool"
    path = fake / where
    path.parent.mkdir(parents=True)
    path.write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert any(expected in v for v in _violations(path))


def test_the_gateway_may_do_io(tmp_path, monkeypatch):
    fake = tmp_path / "kvpool"
    path = fake / "cluster" / "members.py"
    path.parent.mkdir(parents=True)
    path.write_text("import asyncio\nimport httpx\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    assert _violations(path) == []
