"""Which package may import which (docs/architecture.md), checked over every module.

The rules keep each audience installable and reviewable on its own: the client runs in
application code without llama.cpp, the image smoke test on a bare build host, the
constructs without any environment's data, and the engine without knowing decisions.
"""

from __future__ import annotations

import ast
import subprocess
import sys
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
    "metrics",
    "errors",
    "readout",
    "backends",
    "settings",
    "weight_buffers",
    "kv_memory",
    "likelihood",
    "template_text",
}
# the edges between pure modules beyond adapter.errors: the weight-buffer and KV-memory
# policies' and the readouts' types are shared with the settings that name them (and the
# backend query that feeds the first; the likelihood readout shares the letters' arithmetic)
PURE_EDGES = {
    "backends": {"adapter.weight_buffers"},
    "settings": {
        "adapter.weight_buffers",
        "adapter.kv_memory",
        "adapter.likelihood",
        "adapter.template_text",
    },
    "likelihood": {"adapter.readout"},
}
# The serving core (adapter/core, see its __init__) is reached from the service, which
# requests go through, and from start-up: the runtime builds the engine and the label
# probes score on it before any worker exists. The benchmarks and the GPU check measure the
# core directly on purpose.
CORE_DOORS = {"adapter.service", "adapter.runtime", "adapter.labels"}
# What the core may use of the rest of the adapter: a request's cancellation (its own
# answers), the queue limits it enforces, the weight-buffer and KV-memory policies it
# applies. Not the error answers: the core raises its own failures (adapter.core.failures),
# and the service says what each means to a caller.
CORE_USES = {
    "adapter.cancel",
    "adapter.settings",
    "adapter.weight_buffers",
    "adapter.kv_memory",
}
# The one door by attribute as well as by import: only the service, which owns the
# scheduler, reaches `.scheduler` (the benchmarks and the GPU check measure it directly).
SCHEDULER_OWNER = "adapter.service"
# Within the core, who may import whom (beyond failures, which anyone may): one owner per
# piece of state, and nothing below the scheduler knows the queue.
CORE_EDGES: dict[str, set[str]] = {
    "failures": set(),
    "layout": set(),
    "vocab": set(),
    "retry_line": set(),
    "admission": {"adapter.core.layout", "adapter.core.retry_line"},
    "native": {"adapter.weight_buffers", "adapter.kv_memory"},
    "generation": {"adapter.core.layout"},
    "engine": {
        "adapter.core.generation",
        "adapter.core.layout",
        "adapter.core.native",
        "adapter.core.vocab",
        "adapter.weight_buffers",
        "adapter.kv_memory",
    },
    "scheduler": {
        "adapter.core.admission",
        "adapter.core.engine",
        "adapter.core.generation",
        "adapter.core.layout",
        "adapter.cancel",
        "adapter.settings",
    },
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
    if package == "adapter":
        _check_core_boundary(path, imported)


def _check_core_boundary(path: Path, imported: set[str]) -> None:
    module = ".".join(path.relative_to(REPO).with_suffix("").parts)
    core = {name for name in imported if name.startswith("adapter.core")}
    if not module.startswith("adapter.core"):
        assert not core or module in CORE_DOORS, f"{module} reaches into the core: {core}"
        reaches = _attribute_lines(path, "scheduler")
        assert module == SCHEDULER_OWNER or not reaches, (
            f"{module} reaches the scheduler by attribute (lines {reaches}); ask the service"
        )
        return
    if path.stem == "__init__":
        assert not imported - {"__future__"}, "the core package imports nothing on import"
        return
    ours = {name for name in imported if name.startswith("adapter.")}
    allowed = CORE_EDGES[path.stem] | {"adapter.core.failures"}
    assert ours <= allowed, f"{module} imports {sorted(ours - allowed)}"


def _attribute_lines(path: Path, name: str) -> list[int]:
    """Lines where `path` reads an attribute called `name` (`x.scheduler`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == name
    ]


def test_the_attribute_check_sees_a_reach_into_the_scheduler(tmp_path: Path) -> None:
    """The check above can fail: a module that calls `service.scheduler.wants_work()`."""
    reaching = tmp_path / "reaching.py"
    reaching.write_text("def f(service):\n    return service.scheduler.wants_work()\n")
    assert _attribute_lines(reaching, "scheduler") == [2]


def test_every_core_module_has_its_edges_stated() -> None:
    modules = {p.stem for p in (REPO / "adapter" / "core").glob("*.py")} - {"__init__"}
    assert modules == set(CORE_EDGES)
    outside = {edge for edges in CORE_EDGES.values() for edge in edges}
    assert {edge for edge in outside if not edge.startswith("adapter.core")} <= CORE_USES


def test_every_package_is_covered() -> None:
    packages = {p.parent.name for p in REPO.glob("*/__init__.py")} - {"tests"}
    assert packages <= set(ALLOWED)


# Modules that must not load llama.cpp: the HTTP plumbing (cancellation once travelled in a
# context variable of the scheduler's module, and the HTTP layer imported libllama with it)
# and the JSON Lines planner, documented as pure (it once imported the handlers for the API
# rule, and with them the model).
NATIVE_FREE = ("adapter.http", "adapter.line_plan", "adapter.apis")


@pytest.mark.parametrize("module", NATIVE_FREE)
def test_a_module_loads_no_native_library(module: str) -> None:
    check = f"import sys, {module}; print(sorted(m for m in sys.modules if 'llama' in m))"
    result = subprocess.run(
        [sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_every_api_has_a_handler() -> None:
    from adapter import apis, handlers

    assert set(handlers.BY_API) == set(apis.APIS)
    assert set(apis.API_BY_FIELD.values()) < set(apis.APIS)
