"""`model-manifest.json`, schema version 1: what is in model.tar.gz and where it came from.

The builder writes it next to the GGUF at the archive root; the adapter reads it at start and
refuses a GGUF whose name, size or sha256 differ. Both sides use this module, so the format
has one definition (documented in docs/manifest.md). `parse_manifest` is pure: it takes the
decoded JSON and returns a typed `Manifest` or raises `ManifestError` naming the field.

Readers ignore keys they do not know, so optional additions do not break older adapters; an
incompatible change must bump `schema_version`. The optional `calibration` section is exactly
a calibration file (`model_build.calibration`, the one definition of that format), so what
`semif-calibrate` fitted is what the adapter reads. The optional `chat_template` section
names an operator's chat template packed beside the GGUF (`CHAT_TEMPLATE_NAME`), which the
adapter verifies like the GGUF and renders prompts with instead of the GGUF's own.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

from model_build.calibration import Calibration, CalibrationError, parse_calibration
from model_build.sources import COMMIT_PATTERN, SHA256_PATTERN

SCHEMA_VERSION = 1
MANIFEST_NAME = "model-manifest.json"
# An operator's chat template, packed next to the GGUF under this name.
CHAT_TEMPLATE_NAME = "chat_template.jinja"

_T = TypeVar("_T")


class ManifestError(ValueError):
    """The manifest is not valid schema version 1; the message names the field."""


class ChatTemplateFileError(ValueError):
    """A chat template file's bytes are not a usable template (not UTF-8, or blank)."""


@dataclass(frozen=True)
class SourceInfo:
    """Where the GGUF came from: the pinned URI, its commit (hf:// only) and its path there."""

    uri: str
    revision: str | None
    file: str


@dataclass(frozen=True)
class GgufInfo:
    """The packed GGUF: its name at the archive root, identity and header metadata."""

    file: str
    bytes: int
    sha256: str
    architecture: str
    name: str | None
    file_type: str | None
    context_length: int | None
    vocab_size: int
    # sha256 of the GGUF's tokenizer.chat_template (UTF-8); None when it carries none, which
    # only a build given an operator template (`Manifest.chat_template`) accepts.
    chat_template_sha256: str | None


@dataclass(frozen=True)
class ChatTemplateFile:
    """The operator's chat template packed beside the GGUF: its name and identity."""

    file: str
    bytes: int
    sha256: str


@dataclass(frozen=True)
class BuildInfo:
    """When and by which builder version the archive was made."""

    built_at: str
    builder_version: str


@dataclass(frozen=True)
class Manifest:
    source: SourceInfo
    gguf: GgufInfo
    build: BuildInfo
    calibration: Calibration | None = None
    chat_template: ChatTemplateFile | None = None

    def to_json(self) -> str:
        """Canonical text (sorted keys, fixed indent), so equal manifests are equal bytes."""
        document: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "source": asdict(self.source),
            "gguf": asdict(self.gguf),
            "build": asdict(self.build),
        }
        if self.calibration is not None:
            document["calibration"] = self.calibration.to_document()
        if self.chat_template is not None:
            document["chat_template"] = asdict(self.chat_template)
        return json.dumps(document, indent=2, sort_keys=True, allow_nan=False) + "\n"


def calibration_sha256(calibration: Calibration) -> str:
    """sha256 of the calibration as the manifest records it (canonical JSON): what the build
    key and the model object key name, so a refit is a new archive but reformatting the file
    is not."""
    return hashlib.sha256(calibration.to_json().encode()).hexdigest()


def chat_template_text(data: bytes) -> str:
    """A chat template file's text: UTF-8, not blank. Callers hash and decode the same bytes
    (no newline translation), so the file's sha256 is the sha256 of the template text's
    UTF-8 encoding, the convention of `gguf.chat_template_sha256`."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ChatTemplateFileError(
            f"is not UTF-8 text ({error.reason} at byte {error.start})"
        ) from None
    if not text.strip():
        raise ChatTemplateFileError("is empty")
    return text


def read_chat_template(path: Path) -> tuple[bytes, str]:
    """A chat template file's bytes and text (`chat_template_text`'s rule); an unreadable
    file is a `ChatTemplateFileError` too, so each reader (model-build, synth, the adapter's
    setting) maps one error to its own."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ChatTemplateFileError(f"cannot be read ({error.strerror})") from None
    return data, chat_template_text(data)


def parse_manifest(document: object) -> Manifest:
    """Validate decoded manifest JSON and return it typed; raises `ManifestError`."""
    root = _mapping(document, "manifest")
    version = _field(root, "schema_version", int, "")
    if version != SCHEMA_VERSION:
        raise ManifestError(f"schema_version: {version} is not supported (expected 1)")
    source = _mapping(root.get("source"), "source")
    gguf = _mapping(root.get("gguf"), "gguf")
    build = _mapping(root.get("build"), "build")
    revision = _optional(source, "revision", str, "source.")
    if revision is not None and not COMMIT_PATTERN.fullmatch(revision):
        raise ManifestError("source.revision: expected a 40-hex commit or null")
    file = _plain_name(gguf, ".gguf", "gguf.")
    size = _positive(gguf, "bytes", "gguf.")
    context_length = _optional(gguf, "context_length", int, "gguf.")
    vocab_size = _field(gguf, "vocab_size", int, "gguf.")
    if vocab_size <= 0 or (context_length is not None and context_length <= 0):
        raise ManifestError("gguf.vocab_size and gguf.context_length must be positive")
    gguf_template = (
        None
        if gguf.get("chat_template_sha256") is None
        else _sha256(gguf, "chat_template_sha256", "gguf.")
    )
    chat_template = _chat_template(root.get("chat_template"))
    if gguf_template is None and chat_template is None:
        raise ManifestError(
            "gguf.chat_template_sha256: null (the GGUF has no chat template) needs a "
            "chat_template section naming the packed template"
        )
    return Manifest(
        source=SourceInfo(
            uri=_field(source, "uri", str, "source."),
            revision=revision,
            file=_field(source, "file", str, "source."),
        ),
        gguf=GgufInfo(
            file=file,
            bytes=size,
            sha256=_sha256(gguf, "sha256", "gguf."),
            architecture=_field(gguf, "architecture", str, "gguf."),
            name=_optional(gguf, "name", str, "gguf."),
            file_type=_optional(gguf, "file_type", str, "gguf."),
            context_length=context_length,
            vocab_size=vocab_size,
            chat_template_sha256=gguf_template,
        ),
        build=BuildInfo(
            built_at=_field(build, "built_at", str, "build."),
            builder_version=_field(build, "builder_version", str, "build."),
        ),
        calibration=_calibration(root.get("calibration")),
        chat_template=chat_template,
    )


def _chat_template(section: object) -> ChatTemplateFile | None:
    if section is None:
        return None
    entry = _mapping(section, "chat_template")
    return ChatTemplateFile(
        file=_plain_name(entry, ".jinja", "chat_template."),
        bytes=_positive(entry, "bytes", "chat_template."),
        sha256=_sha256(entry, "sha256", "chat_template."),
    )


def _calibration(section: object) -> Calibration | None:
    """The calibration file's own rules, errors named `calibration.<field>`."""
    if section is None:
        return None
    if isinstance(section, Mapping) and "temperature" in section and "temperatures" not in section:
        # The pre-calibration-file form: refused by name, not as a missing schema_version.
        raise ManifestError(
            "calibration: the single 'temperature' form is not read any more; rebuild with "
            "model-build --calibration FILE (a semif-calibrate file)"
        )
    try:
        return parse_calibration(section)
    except CalibrationError as error:
        raise ManifestError(str(error)) from None


def load_manifest(path: Path) -> Manifest:
    """Read and validate a manifest file (e.g. /opt/ml/model/model-manifest.json)."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path}: cannot read manifest: {exc}") from None
    return parse_manifest(document)


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ManifestError(f"{where}: expected an object")
    return value


def _field(section: Mapping[str, Any], key: str, kind: type[_T], where: str) -> _T:
    value = _optional(section, key, kind, where)
    if value is None:
        raise ManifestError(f"{where}{key}: required")
    return value


def _optional(section: Mapping[str, Any], key: str, kind: type[_T], where: str) -> _T | None:
    value = section.get(key)
    if value is None:
        return None
    # bool is an int in Python, but never a count.
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ManifestError(f"{where}{key}: expected {kind.__name__}, got {type(value).__name__}")
    if kind is str and not value:
        raise ManifestError(f"{where}{key}: must not be empty")
    return value


def _plain_name(section: Mapping[str, Any], suffix: str, where: str) -> str:
    """`file`: a plain name at the archive root (the adapter opens it beside the manifest)."""
    file = _field(section, "file", str, where)
    if "/" in file or "\\" in file or not file.endswith(suffix) or file.startswith("."):
        raise ManifestError(
            f"{where}file: {file!r} is not a plain {suffix} name at the archive root"
        )
    return file


def _positive(section: Mapping[str, Any], key: str, where: str) -> int:
    value = _field(section, key, int, where)
    if value <= 0:
        raise ManifestError(f"{where}{key}: must be positive")
    return value


def _sha256(section: Mapping[str, Any], key: str, where: str) -> str:
    value = _field(section, key, str, where)
    if not SHA256_PATTERN.fullmatch(value):
        raise ManifestError(f"{where}{key}: expected 64 lowercase hex digits")
    return value
