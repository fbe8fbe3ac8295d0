"""One snapshot per stack: the whole template, with hash-derived values normalised.

A failing snapshot shows what a change does to a template. When the change is intended,
regenerate the snapshots and review the diff like code:

    SEMIF_UPDATE_SNAPSHOTS=1 .venv/bin/python -m pytest tests/cdk/test_snapshots.py

Asset hashes (every source file of adapter/, images/, model_build/ and the build waiter
feeds one) and the image tags and build triggers derived from them are replaced by
placeholders, so editing a source file does not break a snapshot; changing a template does.
"""

from __future__ import annotations

import os

import pytest

from tests.support.templates import (
    SNAPSHOTS,
    UPDATE_SNAPSHOTS_VARIABLE,
    Synth,
    normalized_template,
    render_snapshot,
    snapshot_path,
)

# Every stack of one representative environment, plus the GPU decision stack.
SNAPSHOT_STACKS = (
    "semif-dev-artifact",
    "semif-dev-images",
    "semif-dev-decision",
    "semif-dev-standard",
    "semif-gpu-decision",
)


@pytest.mark.parametrize("stack", SNAPSHOT_STACKS)
def test_template_matches_its_snapshot(synth: Synth, stack: str) -> None:
    rendered = render_snapshot(normalized_template(synth.outdir, stack))
    path = snapshot_path(stack)
    if os.environ.get(UPDATE_SNAPSHOTS_VARIABLE) == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(rendered)
    assert path.exists(), f"no snapshot {path.name}; run with {UPDATE_SNAPSHOTS_VARIABLE}=1"
    assert rendered == path.read_text(), (
        f"{stack} differs from {path.name}; if intended, rerun with {UPDATE_SNAPSHOTS_VARIABLE}=1"
    )


def test_no_stale_snapshots() -> None:
    stored = {path.name for path in SNAPSHOTS.glob("*.json")}
    assert stored == {snapshot_path(stack).name for stack in SNAPSHOT_STACKS}
