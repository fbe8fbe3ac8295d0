"""A model-manifest.json beside a test model, as model-build writes one for a real build."""

from __future__ import annotations

from pathlib import Path

from model_build.calibration import Calibration
from model_build.embedded import sha256_of
from model_build.gguf_info import inspect_gguf
from model_build.manifest import (
    CHAT_TEMPLATE_NAME,
    BuildInfo,
    ChatTemplateFile,
    Manifest,
    SourceInfo,
)


def write_manifest(
    model_dir: Path, calibration: Calibration | None = None, chat_template: str | None = None
) -> None:
    """Describe the directory's one GGUF (its real size, sha256 and metadata); with
    `chat_template`, pack it beside the GGUF and list it, as model-build --chat-template."""
    gguf = next(model_dir.glob("*.gguf"))
    info = inspect_gguf(
        gguf,
        file=gguf.name,
        size=gguf.stat().st_size,
        sha256=sha256_of(gguf),
        operator_template=chat_template is not None,
    )
    packed = None
    if chat_template is not None:
        template = model_dir / CHAT_TEMPLATE_NAME
        template.write_text(chat_template, encoding="utf-8", newline="")
        size = template.stat().st_size
        packed = ChatTemplateFile(CHAT_TEMPLATE_NAME, size, sha256_of(template))
    manifest = Manifest(
        source=SourceInfo(uri="s3://bucket/tiny.gguf", revision=None, file=gguf.name),
        gguf=info,
        build=BuildInfo(built_at="2026-11-29T00:00:00Z", builder_version="test"),
        calibration=calibration,
        chat_template=packed,
    )
    (model_dir / "model-manifest.json").write_text(manifest.to_json())
