"""Which package may import which (docs/architecture.md), checked over every module.

The rules keep each audience installable and reviewable on its own: the client runs in
application code without llama.cpp, the image smoke test on a bare build host, the
constructs without any environment's data, and the engine without knowing decisions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OURS = {
    "adapter",
    "client",
    "bench",
    "images",
    "model_build",
    "scripts",
    "stacks",
    "cdk_constructs",
    "app",
}
# package -> the project packages it may import (itself always allowed)
ALLOWED: dict[str, set[str]] = {
    "model_build": set(),
    "adapter": {"model_build"},
    "client": set(),
    "images": set(),
    "bench": {"adapter", "client", "model_build"},
    "scripts": {"adapter", "bench", "model_build"},  # the GPU check drives the real server
    "cdk_constructs": set(),
    "stacks": {"cdk_constructs", "adapter", "model_build"},  # adapter: settings checked at synth
    "app": {"stacks", "cdk_constructs"},  # cdk_constructs: app-wide checks (Aspects)
}
# adapter modules that must stay free of the rest of the adapter
PURE_ADAPTER_MODULES = {
    "engine",
    "errors",
    "kv_layout",
    "readout",
    "backends",
    "settings",
    "weight_buffers",
}
# the edges between pure modules beyond adapter.errors: the engine executes kv_layout's
# plans; the weight-buffer policy's types are shared by the engine that applies it, the
# backend query that feeds it and the setting that names it
PURE_EDGES = {
    "engine": {"adapter.kv_layout", "adapter.weight_buffers"},
    "backends": {"adapter.weight_buffers"},
    "settings": {"adapter.weight_buffers"},
}


def _modules(package: str) -> list[Path]:
    root = REPO / package
    return [REPO / "app.py"] if package == "app" else sorted(root.rglob("*.py"))


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


CASES = [(package, path) for package in ALLOWED for path in _modules(package)]


@pytest.mark.parametrize(
    ("package", "path"), CASES, ids=[p.relative_to(REPO).as_posix() for _, p in CASES]
)
def test_package_imports_only_what_its_layer_allows(package: str, path: Path) -> None:
    imported = _imports(path)
    ours = {name.split(".")[0] for name in imported} & OURS
    assert ours - {package} <= ALLOWED[package], f"{path.name} imports {sorted(ours)}"
    if package == "cdk_constructs" and path.parent.name != "build_waiter":
        # Constructs take typed props; only the Lambda handler (which runs in AWS) reads env.
        assert "os" not in imported
        assert "try_get_context" not in path.read_text()
    if package == "adapter" and path.stem in PURE_ADAPTER_MODULES:
        adapter_imports = {name for name in imported if name.startswith("adapter.")}
        allowed = {"adapter.errors"} if path.stem != "errors" else set()
        allowed |= PURE_EDGES.get(path.stem, set())
        assert adapter_imports <= allowed, f"{path.name} imports {sorted(adapter_imports)}"


def test_every_package_is_covered() -> None:
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests"}
    assert packages <= set(ALLOWED)
