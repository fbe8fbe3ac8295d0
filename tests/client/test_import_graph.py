"""The client's modules import one way: cli -> batch paths -> decision_client -> the modules
it is made of, with no cycle between any of them.

A cycle between modules that needed each other used to be dodged with imports inside
functions and under TYPE_CHECKING (decision_client <-> batch_local <-> batch_aws). Such an
import still closes a cycle: it only hides it from Python until the function runs. So the
graph here counts every import wherever it stands in a module (`ast.walk`), relative ones
included, and tests/test_layers.py keeps the rules between packages.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CLIENT = REPO / "client"
# How high a module stands (a module not named here stands at 0, below the client): an
# import may reach its own layer or a lower one, never a higher one.
LAYERS = {
    "client.cli": 3,
    "client.demo": 3,
    "client.batch_local": 2,
    "client.batch_aws": 2,
    "client.decision_client": 1,
}


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _longest_known(dotted: str, modules: set[str]) -> str | None:
    parts = dotted.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def _imported(path: Path, root: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports anywhere: at the top, in a function, under
    TYPE_CHECKING; `from package import module` names the module, not the package."""
    name = _module_name(path, root)
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {_longest_known(alias.name, modules) or "" for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else _longest_known(base, modules) or "")
    # The package itself runs before any of its modules; it is not an edge between them.
    return found - {"", name, root.name}


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the modules of the package at `root` that it imports."""
    paths = sorted(root.rglob("*.py"))
    modules = {_module_name(path, root) for path in paths}
    return {_module_name(path, root): _imported(path, root, modules) for path in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as the modules along it (the first repeated at the end), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        path.append(module)
        for imported in sorted(graph.get(module, set())):
            cycle = visit(imported)
            if cycle is not None:
                return cycle
        path.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        cycle = visit(module)
        if cycle is not None:
            return cycle
    return None


GRAPH = import_graph(CLIENT)


def test_the_client_modules_import_no_cycle() -> None:
    cycle = find_cycle(GRAPH)
    assert cycle is None, "client modules import in a cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_a_client_module_imports_only_its_layer_and_below(module: str) -> None:
    higher = {
        imported for imported in GRAPH[module] if LAYERS.get(imported, 0) > LAYERS.get(module, 0)
    }
    assert not higher, f"{module} imports {sorted(higher)}, above it"


def test_every_layered_module_exists() -> None:
    assert set(LAYERS) <= set(GRAPH)


def test_the_check_sees_a_cycle_closed_inside_a_function(tmp_path: Path) -> None:
    """The checks above can fail: a cycle closed by a function-level import, one by a
    relative import under TYPE_CHECKING, and `from package import module`."""
    package = tmp_path / "client"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def f():\n    from client.high import g\n")
    (package / "high.py").write_text("from client.low import f\n")
    (package / "typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .other import X\n"
    )
    (package / "other.py").write_text("from client import typed\n")
    graph = import_graph(package)
    assert graph["client.low"] == {"client.high"}
    assert graph["client.typed"] == {"client.other"}
    assert graph["client.other"] == {"client.typed"}
    assert find_cycle(graph) == ["client.high", "client.low", "client.high"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_client_module_imports_on_its_own() -> None:
    """Each module imported first, in a fresh state of the package: a cycle that Python
    cannot resolve fails here whichever module an application imports first."""
    script = (
        "import importlib, sys\n"
        "for name in sys.argv[1:]:\n"
        "    for loaded in [m for m in sys.modules if m.split('.')[0] == 'client']:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, *sorted(GRAPH)], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
