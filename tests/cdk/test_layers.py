"""Constructs own their props: nothing in `cdk_constructs/` imports `stacks/` or reads context."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.cdk.support import REPO

CONSTRUCT_MODULES = sorted((REPO / "cdk_constructs").rglob("*.py"))


def _imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


@pytest.mark.parametrize("path", CONSTRUCT_MODULES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_constructs_never_import_stacks_or_read_the_environment(path: Path) -> None:
    imported = _imported_modules(path)
    assert not {name for name in imported if name.split(".")[0] in {"stacks", "app"}}
    if path.parent.name != "build_waiter":  # the Lambda handler runs in AWS, not at synth
        assert "os" not in imported
    assert "try_get_context" not in path.read_text()
