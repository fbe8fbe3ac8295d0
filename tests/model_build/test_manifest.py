"""The manifest schema: what the builder writes is what the adapter's reader accepts."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from model_build.calibration import Calibration, LikelihoodCalibration, parse_calibration
from model_build.manifest import (
    CHAT_TEMPLATE_NAME,
    BuildInfo,
    ChatTemplateFile,
    GgufInfo,
    Manifest,
    ManifestError,
    SourceInfo,
    calibration_sha256,
    load_manifest,
    parse_manifest,
)
from tests.support.model_build import CALIBRATION

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
    calibrated = Manifest(MANIFEST.source, MANIFEST.gguf, MANIFEST.build, CALIBRATION)
    assert parse_manifest(_document(calibrated)) == calibrated
    assert "calibration" not in _document()
    # The section is the calibration file itself, schema version and all.
    assert _document(calibrated)["calibration"] == CALIBRATION.to_document()
    assert parse_calibration(_document(calibrated)["calibration"]) == CALIBRATION


def test_the_likelihood_section_round_trips_and_stays_absent_when_unfitted() -> None:
    assert "likelihood" not in CALIBRATION.to_document()  # files from before it parse the same
    fitted = LikelihoodCalibration(
        "semif-option-likelihood/1", {"mean": {"choice": 0.8, "noul": 1.3}, "pmi": {}}
    )
    with_likelihood = _with_likelihood(fitted)
    document = json.loads(with_likelihood.to_json())
    assert document["likelihood"] == {
        "prompt_version": "semif-option-likelihood/1",
        "temperatures": {"mean": {"choice": 0.8, "noul": 1.3}, "pmi": {}},
    }
    parsed = parse_calibration(document)
    assert parsed == with_likelihood
    assert parsed.likelihood is not None
    assert parsed.likelihood.temperature("mean", "noul") == 1.3
    assert parsed.likelihood.temperature("sum", "choice") is None
    assert calibration_sha256(parsed) != calibration_sha256(CALIBRATION)


def test_an_operator_chat_template_round_trips_and_excuses_a_gguf_without_one() -> None:
    packed = ChatTemplateFile(CHAT_TEMPLATE_NAME, 42, "d" * 64)
    bare = dataclasses.replace(MANIFEST.gguf, chat_template_sha256=None)
    manifest = dataclasses.replace(MANIFEST, gguf=bare, chat_template=packed)
    document = _document(manifest)
    assert document["chat_template"] == {
        "file": "chat_template.jinja",
        "bytes": 42,
        "sha256": "d" * 64,
    }
    assert document["gguf"]["chat_template_sha256"] is None
    assert parse_manifest(document) == manifest
    assert "chat_template" not in _document()
    del document["chat_template"]
    with pytest.raises(ManifestError, match=r"^gguf.chat_template_sha256: null \(the GGUF has"):
        parse_manifest(document)


def _with_likelihood(likelihood: LikelihoodCalibration) -> Calibration:
    return dataclasses.replace(CALIBRATION, likelihood=likelihood)


def test_calibration_digest_follows_the_content_not_the_formatting() -> None:
    reformatted = parse_calibration(json.loads(json.dumps(CALIBRATION.to_document())))
    assert calibration_sha256(reformatted) == calibration_sha256(CALIBRATION)
    refit = parse_calibration({**CALIBRATION.to_document(), "temperatures": {"choice": 1.6}})
    assert calibration_sha256(refit) != calibration_sha256(CALIBRATION)


def test_text_is_canonical() -> None:
    text = MANIFEST.to_json()
    assert text.endswith("}\n")
    assert text == json.dumps(json.loads(text), indent=2, sort_keys=True) + "\n"
    assert json.loads(text)["schema_version"] == 1


def test_unknown_keys_are_ignored() -> None:
    document = _document()
    document["future_field"] = {"anything": True}
    document["gguf"]["extra"] = 1
    parsed = parse_manifest(document)
    assert parsed.gguf == MANIFEST.gguf
    assert parsed.calibration is None


def test_the_old_single_temperature_form_is_refused_by_name() -> None:
    document = _document()
    document["calibration"] = {"temperature": 1.2}
    with pytest.raises(
        ManifestError,
        match=r"^calibration: the single 'temperature' form is not read any more; rebuild with "
        "model-build --calibration FILE",
    ):
        parse_manifest(document)


LIKELIHOOD = {"prompt_version": "semif-option-likelihood/1", "temperatures": {}}


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
        ("gguf.chat_template_sha256", "x", "gguf.chat_template_sha256: expected 64 lowercase"),
        ("chat_template", [], "chat_template: expected an object"),
        (
            "chat_template",
            {"file": "../t.jinja", "bytes": 1, "sha256": "d" * 64},
            "chat_template.file: '../t.jinja' is not a plain .jinja name at the archive root",
        ),
        (
            "chat_template",
            {"file": "t.jinja", "bytes": 0, "sha256": "d" * 64},
            "chat_template.bytes: must be positive",
        ),
        ("chat_template", {"file": "t.jinja", "bytes": 1}, "chat_template.sha256: required"),
        ("source.revision", "main", "source.revision: expected a 40-hex commit or null"),
        ("source.uri", "", "source.uri: must not be empty"),
        ("build", "x", "build: expected an object"),
        ("calibration", "x", "calibration: expected an object"),
        (
            "calibration",
            {**CALIBRATION.to_document(), "schema_version": 2},
            "calibration.schema_version: 2 is not supported",
        ),
        (
            "calibration",
            {**CALIBRATION.to_document(), "option_order": "sorted"},
            "calibration.option_order: 'sorted' is not one of",
        ),
        (
            "calibration",
            {**CALIBRATION.to_document(), "temperatures": {"choice": 0}},
            "calibration.temperatures.choice: must be a number in 0.01..100",
        ),
        (
            "calibration",
            {**CALIBRATION.to_document(), "tasks_sha256": "x"},
            "calibration.tasks_sha256: expected 64 lowercase hex",
        ),
        (
            "calibration",
            {**CALIBRATION.to_document(), "likelihood": {"temperatures": {}}},
            "calibration.likelihood.prompt_version: required",
        ),
        (
            "calibration",
            {**CALIBRATION.to_document(), "likelihood": LIKELIHOOD | {"temperatures": {"max": {}}}},
            "calibration.likelihood.temperatures: 'max' is not a normalization",
        ),
        (
            "calibration",
            {
                **CALIBRATION.to_document(),
                "likelihood": LIKELIHOOD | {"temperatures": {"mean": {"choice": 500}}},
            },
            "calibration.likelihood.temperatures.mean.choice: must be a number in 0.01..100",
        ),
        (
            "calibration",
            {
                **CALIBRATION.to_document(),
                "likelihood": LIKELIHOOD | {"temperatures": {"sum": {"yes": 1.0}}},
            },
            "calibration.likelihood.temperatures.sum: 'yes' is not a question kind",
        ),
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
