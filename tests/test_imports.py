"""The package's import graph: no cycle in src/; the SDK (client/) stands on protocol/ alone, and the
gateway (gateway/) is a client of the router that loads none of the daemon's insides."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "llamapool"
DAEMON = ("llamapool.config", "llamapool.router", "llamapool.worker", "llamapool.supervisor")


def _module(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    """Each module of llamapool and the llamapool modules it imports, anywhere in it (at the top, under
    TYPE_CHECKING, inside a function)."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        package = (name if path.name == "__init__.py" else name.rpartition(".")[0]).split(".")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
                base = ".".join(p for p in (base, node.module or "") if p)
                subs = {f"{base}.{a.name}" for a in node.names} & set(modules)
                found.update(subs or {base})  # "from pkg import module": the module, not its package
        # a module's own packages run before it anyway: an edge to one of them is no cycle
        graph[name] = {m for m in found if m in modules and m != name and not name.startswith(f"{m}.")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle, as the modules along it, or [] when there is none."""
    done: set[str] = set()
    stack: list[str] = []

    def visit(m: str) -> list[str]:
        if m in stack:
            return [*stack[stack.index(m):], m]
        if m in done:
            return []
        stack.append(m)
        for n in sorted(graph[m]):
            found = visit(n)
            if found:
                return found
        stack.pop()
        done.add(m)
        return []

    for m in sorted(graph):
        found = visit(m)
        if found:
            return found
    return []


def test_no_import_cycle_in_src() -> None:
    cycle = _cycle(_graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def _loaded(graph: dict[str, set[str]], package: str) -> set[str]:
    """What importing ``package`` and its modules loads: every module they import, transitively, and
    the packages above each (importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first)."""
    seen: set[str] = set()
    todo = [m for m in graph if m == package or m.startswith(f"{package}.")]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            parts = m.split(".")
            todo.extend(graph[m])
            todo.extend(p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in graph)
    return seen


def test_the_client_imports_nothing_of_the_daemon() -> None:
    """client/ and everything it imports (transitively) stay clear of config.py, router/, worker/ and
    supervisor/: the SDK does not pull the daemon in."""
    pulled = sorted(m for m in _loaded(_graph(), "llamapool.client") if m.startswith(DAEMON))
    assert not pulled, f"client/ imports (directly or not) {pulled}"


def test_the_gateway_imports_nothing_of_the_daemon() -> None:
    """gateway/ (and what it imports, transitively) stays clear of config.py, router/, worker/ and
    supervisor/: a gateway process is an ordinary client of the router and never loads its broker; the
    pod's gauges (gateway/podgauges.py) are the gateway's, which the supervisor's metrics endpoint uses."""
    pulled = sorted(m for m in _loaded(_graph(), "llamapool.gateway") if m.startswith(DAEMON))
    assert not pulled, f"gateway/ imports (directly or not) {pulled}"


def test_loading_a_module_loads_its_packages() -> None:
    graph = {"a": set(), "a.b": set(), "a.b.c": {"d.e"}, "d": {"f"}, "d.e": set(), "f": set(), "g": set()}
    assert _loaded(graph, "a.b.c") == {"a", "a.b", "a.b.c", "d", "d.e", "f"}
