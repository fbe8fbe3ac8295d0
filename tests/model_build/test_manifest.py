"""The manifest schema: what the builder writes is what the adapter's reader accepts."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from model_build.manifest import (
    BuildInfo,
    Calibration,
    GgufInfo,
    Manifest,
    ManifestError,
    SourceInfo,
    load_manifest,
    parse_manifest,
)

MANIFEST = Manifest(
    source=SourceInfo(
        uri="hf://org/repo@" + "a" * 40 + "/m.gguf", revision="a" * 40, file="m.gguf"
    ),
    gguf=GgufInfo(
        file="m.gguf",
        bytes=123,
        sha256="b" * 64,
        architecture="llama",
        name=None,
        file_type="Q4_K_M",
        context_length=8192,
        vocab_size=49152,
        chat_template_sha256="c" * 64,
    ),
    build=BuildInfo(built_at="2026-11-29T10:00:00Z", builder_version="0.1.0"),
)


def _document(manifest: Manifest = MANIFEST) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(manifest.to_json())
    return document


def test_round_trip_without_and_with_calibration() -> None:
    assert parse_manifest(_document()) == MANIFEST
    calibrated = Manifest(MANIFEST.source, MANIFEST.gguf, MANIFEST.build, Calibration(0.7))
    assert parse_manifest(_document(calibrated)) == calibrated
    assert "calibration" not in _document()
    assert _document(calibrated)["calibration"] == {"temperature": 0.7}


def test_text_is_canonical() -> None:
    text = MANIFEST.to_json()
    assert text.endswith("}\n")
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"
    assert json.loads(text)["schema_version"] == 1


def test_unknown_keys_are_ignored_and_integer_temperature_accepted() -> None:
    document = _document()
    document["future_field"] = {"anything": True}
    document["gguf"]["extra"] = 1
    document["calibration"] = {"temperature": 2}
    parsed = parse_manifest(document)
    assert parsed.calibration == Calibration(2.0)
    assert parsed.gguf == MANIFEST.gguf


def _set(path: str, value: object) -> dict[str, Any]:
    document = copy.deepcopy(_document())
    *parents, last = path.split(".")
    target = document
    for key in parents:
        target = target[key]
    target[last] = value
    return document


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("schema_version", 2, "schema_version: 2 is not supported"),
        ("gguf.sha256", "B" * 64, "gguf.sha256: expected 64 lowercase hex"),
        ("gguf.file", "../m.gguf", "gguf.file: '../m.gguf' is not a plain .gguf name"),
        ("gguf.file", "model.bin", "gguf.file: .model.bin. is not a plain"),
        ("gguf.bytes", True, "gguf.bytes: expected int, got bool"),
        ("gguf.bytes", 0, "gguf.bytes: must be positive"),
        ("gguf.vocab_size", None, "gguf.vocab_size: required"),
        ("gguf.chat_template_sha256", None, "gguf.chat_template_sha256: required"),
        ("source.revision", "main", "source.revision: expected a 40-hex commit or null"),
        ("source.uri", "", "source.uri: must not be empty"),
        ("build", "x", "build: expected an object"),
        ("calibration", {"temperature": 0}, "calibration.temperature: must be a positive"),
        ("calibration", {"temperature": "1"}, "calibration.temperature: expected float, got str"),
    ],
)
def test_invalid_fields_are_named(path: str, value: object, message: str) -> None:
    with pytest.raises(ManifestError, match=f"^{message}"):
        parse_manifest(_set(path, value))


def test_load_manifest_reports_unreadable_files(tmp_path: Path) -> None:
    path = tmp_path / "model-manifest.json"
    path.write_text(MANIFEST.to_json())
    assert load_manifest(path) == MANIFEST
    path.write_text("{not json")
    with pytest.raises(ManifestError, match="cannot read manifest"):
        load_manifest(path)
    with pytest.raises(ManifestError, match="cannot read manifest"):
        load_manifest(tmp_path / "missing.json")
