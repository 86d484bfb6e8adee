"""The layers stay one-way: kernels <- layout <- values <- strategies <- server/sim <- cli.

Each check imports a module in a fresh interpreter and lists what else got loaded, so a stray
import anywhere in the chain (not just in the module itself) fails it.
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

# Module prefixes each entry point must not load.
HIGHER = {
    # Between the kernels and the strategies: robust rules take rows, never a strategy.
    "aggsrv.aggregators": (
        "aggsrv.strategies",
        "aggsrv.server",
        "aggsrv.sim",
        "aggsrv.cli",
        "grpc",
        "flwr",
    ),
    "aggsrv.client": ("aggsrv.strategies", "aggsrv.server", "aggsrv.sim", "aggsrv.cli", "flwr"),
    "aggsrv.values": ("aggsrv.strategies", "aggsrv.server", "aggsrv.sim", "grpc", "google"),
    "aggsrv.layout": ("aggsrv.strategies", "aggsrv.server", "aggsrv.values", "grpc"),
    "aggsrv.protocol": ("aggsrv.strategies", "aggsrv.server", "aggsrv.sim"),
    # The trace format is read by the simulator and written by the server: the stdlib only.
    "aggsrv.trace_format": ("aggsrv.strategies", "aggsrv.server", "aggsrv.sim", "torch", "grpc"),
    "aggsrv.strategies": ("aggsrv.server", "aggsrv.sim", "aggsrv.cli", "grpc", "flwr"),
    "aggsrv.server.app": ("aggsrv.sim", "aggsrv.cli", "flwr"),
    # Persistence stores and loads; the federation above it replays the log.
    "aggsrv.server.persistence": ("aggsrv.server.federation", "aggsrv.server.service"),
}


@functools.cache
def _loaded_after_import(module: str) -> list[str]:
    """The modules a fresh interpreter holds after importing ``module`` (a fact of the source
    tree, so each module's interpreter runs once however many tests read its list)."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", sorted(HIGHER))
def test_a_layer_loads_nothing_above_it(module: str) -> None:
    loaded = _loaded_after_import(module)
    above = [m for m in loaded if any(m == p or m.startswith(p + ".") for p in HIGHER[module])]
    assert not above, f"importing {module} loads {above}"


def test_the_client_loads_no_strategy_module_at_all() -> None:
    # The one the issue names: a client program pays for the client, not for 17 strategies.
    loaded = _loaded_after_import("aggsrv.client")
    assert "aggsrv.values" in loaded
    assert not [m for m in loaded if m.startswith("aggsrv.strategies")]


def _imported_anywhere(path: Path) -> set[str]:
    """Every module a source file imports: at the top, inside functions, under TYPE_CHECKING."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_persistence_never_imports_the_federation() -> None:
    # Loading the module is not enough: an import inside a function (how the two modules
    # dispatched each other's calls) loads nothing until it runs.
    source = Path(__file__).resolve().parents[2] / "aggsrv" / "server" / "persistence.py"
    above = sorted(
        n for n in _imported_anywhere(source)
        if n.startswith(("aggsrv.server.federation", "aggsrv.server.service"))
    )  # fmt: skip
    assert not above, f"aggsrv/server/persistence.py imports {above}"


def _package_modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (``kernels/`` is ``aggsrv.kernels``)."""
    repo = Path(__file__).resolve().parents[2]
    modules: dict[str, Path] = {}
    for folder, package in ((repo / "aggsrv", "aggsrv"), (repo / "kernels", "aggsrv.kernels")):
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _imported(module: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``module`` imports anywhere: at the top, inside functions, under
    TYPE_CHECKING (a cycle hidden in a function is still a cycle of the design)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module.split(".") if is_package else module.split(".")[:-1]
                here = here[: len(here) - node.level + 1]
                base = ".".join(here + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            # A package's own parent is where it lives, not an import of the design.
            if name and name != module and not module.startswith(name + "."):
                found.add(name)
    return found


def test_no_import_cycles_between_the_packages_modules() -> None:
    """No two modules of aggsrv import each other, directly or through others, wherever the
    import stands (Tarjan's strongly connected components of the import graph)."""
    modules = _package_modules()
    graph = {m: _imported(m, p, set(modules)) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"
    # The walk sees imports inside functions and under TYPE_CHECKING.
    assert "aggsrv.sim.attacks" in graph["aggsrv.sim.config"]  # in a method
    assert "aggsrv.server.federation" in graph["aggsrv.server.dashboard.status"]
