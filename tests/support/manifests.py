"""A model-manifest.json beside a test model, as model-build writes one for a real build."""

from __future__ import annotations

from pathlib import Path

from model_build.calibration import Calibration
from model_build.embedded import sha256_of
from model_build.gguf_info import inspect_gguf
from model_build.manifest import BuildInfo, Manifest, SourceInfo


def write_manifest(model_dir: Path, calibration: Calibration | None = None) -> None:
    """Describe the directory's one GGUF (its real size, sha256 and metadata)."""
    gguf = next(model_dir.glob("*.gguf"))
    info = inspect_gguf(gguf, file=gguf.name, size=gguf.stat().st_size, sha256=sha256_of(gguf))
    manifest = Manifest(
        source=SourceInfo(uri="s3://bucket/tiny.gguf", revision=None, file=gguf.name),
        gguf=info,
        build=BuildInfo(built_at="2026-11-29T00:00:00Z", builder_version="test"),
        calibration=calibration,
    )
    (model_dir / "model-manifest.json").write_text(manifest.to_json())
