"""Settings, model discovery and manifest checks, schema rules and the readout arithmetic."""

from __future__ import annotations

import hashlib
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from adapter import settings as adapter_settings
from adapter.backends import BackendLoadError, bundled_lib_dir, load_backends
from adapter.errors import RequestError
from adapter.model_files import (
    ModelFilesError,
    calibration_summary,
    discover_gguf,
    resolve_model_files,
)
from adapter.readout import NonFiniteLogitsError, read_slots, softmax
from adapter.schema import parse_decision_body
from adapter.settings import RETIRED, SettingsError, load_settings
from model_build.calibration import Calibration
from model_build.manifest import BuildInfo, GgufInfo, Manifest, SourceInfo
from tests.support.model_build import CALIBRATION
from tests.support.serving import decision

# -- settings -----------------------------------------------------------------------------


def test_settings_defaults_match_the_container_contract() -> None:
    settings = load_settings({})
    assert settings.port == 8080
    assert settings.model_dir == Path("/opt/ml/model")
    assert settings.max_tokens == 4096
    assert (settings.max_shared_decisions, settings.max_body_bytes) == (64, 1 << 20)
    assert settings.n_gpu_layers == 0
    assert (settings.max_queue, settings.max_batch_requests) == (256, 32)
    assert (settings.queue_timeout_seconds, settings.request_timeout_seconds) == (20.0, 50.0)
    assert settings.max_request_tokens == 16_384
    assert settings.exact_scoring is True
    assert settings.stream_cells == settings.max_tokens + 1  # a prompt and one continuation


def test_request_token_limit_follows_the_prompt_limit() -> None:
    assert load_settings({"SEMIF_MAX_TOKENS": "32768"}).max_request_tokens == 32_768
    assert load_settings({"SEMIF_MAX_REQUEST_TOKENS": "4096"}).max_request_tokens == 4096
    with pytest.raises(SettingsError, match=r"SEMIF_MAX_REQUEST_TOKENS=100 .*allowed 4096\.\."):
        load_settings({"SEMIF_MAX_REQUEST_TOKENS": "100"})


@pytest.mark.parametrize(
    ("retired", "named"),
    [
        ("SEMIF_MAX_IN_FLIGHT", "SEMIF_MAX_QUEUE"),
        ("SEMIF_BODY_TIMEOUT_SECONDS", "SEMIF_BODY_TIMEOUT_S"),
        ("SEMIF_SHUTDOWN_GRACE_SECONDS", "SEMIF_SHUTDOWN_GRACE_S"),
    ],
)
def test_a_retired_setting_is_a_start_error_naming_its_successor(retired: str, named: str) -> None:
    """Even with a value that was valid before; blank is unset."""
    for value in ("1", "8"):
        with pytest.raises(SettingsError, match=rf"^{retired} is no longer read: .*{named}"):
            load_settings({retired: value})
    assert load_settings({retired: " "}).max_queue == 256


def test_every_time_setting_ends_in_s() -> None:
    """One suffix for seconds: every name the settings read as seconds."""
    source = Path(adapter_settings.__file__).read_text()
    timed = set(re.findall(r'_seconds\(\s*env,\s*"([A-Z_]+)"', source))
    assert {"SEMIF_QUEUE_TIMEOUT_S", "SEMIF_BODY_TIMEOUT_S"} <= timed
    assert all(name.endswith("_S") for name in timed), sorted(timed)
    assert not timed & set(RETIRED)


def test_request_timeout_may_not_be_below_the_queue_timeout() -> None:
    env = {"SEMIF_QUEUE_TIMEOUT_S": "30", "SEMIF_REQUEST_TIMEOUT_S": "10"}
    with pytest.raises(SettingsError, match="SEMIF_REQUEST_TIMEOUT_S=10 is below"):
        load_settings(env)
    assert load_settings({**env, "SEMIF_REQUEST_TIMEOUT_S": "30"}).request_timeout_seconds == 30


def test_sagemaker_port_wins_over_semif_port() -> None:
    env = {"SAGEMAKER_BIND_TO_PORT": "9001", "SEMIF_PORT": "9002"}
    assert load_settings(env).port == 9001
    assert load_settings({"SEMIF_PORT": "9002"}).port == 9002


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("SEMIF_THREADS", "0", "SEMIF_THREADS=0 is out of range; allowed 1.."),
        ("SEMIF_N_GPU_LAYERS", "-2", "SEMIF_N_GPU_LAYERS=-2 is out of range; allowed -1..100000"),
        ("SEMIF_MAX_TOKENS", "ten", "SEMIF_MAX_TOKENS='ten' is not an integer; allowed 64..131072"),
        ("SEMIF_MAX_IN_FLIGHT", "0", "SEMIF_MAX_IN_FLIGHT is no longer read: "),
        ("SEMIF_MAX_QUEUE", "0", "SEMIF_MAX_QUEUE=0 is out of range; allowed 1..4096"),
        ("SEMIF_MAX_BATCH_REQUESTS", "257", "SEMIF_MAX_BATCH_REQUESTS=257 is out of range"),
        ("SEMIF_QUEUE_TIMEOUT_S", "60", "SEMIF_QUEUE_TIMEOUT_S=60"),
        ("SEMIF_REQUEST_TIMEOUT_S", "0.5", "SEMIF_REQUEST_TIMEOUT_S=0.5"),
        ("SEMIF_EXACT_SCORING", "maybe", "SEMIF_EXACT_SCORING='maybe' is not a boolean"),
        ("SEMIF_MAX_SHARED_DECISIONS", "2000", "allowed 1..1024"),
        ("SEMIF_MAX_BODY_BYTES", "10", "SEMIF_MAX_BODY_BYTES=10 is out of range; allowed 1024.."),
        ("SAGEMAKER_BIND_TO_PORT", "70000", "SAGEMAKER_BIND_TO_PORT=70000 is out of range"),
        ("SEMIF_GGUF_PATH", "/nonexistent.gguf", "SEMIF_GGUF_PATH=/nonexistent.gguf is not a file"),
        ("LLAMA_CPP_LIB_PATH", "/nonexistent", "LLAMA_CPP_LIB_PATH=/nonexistent is not a dir"),
        ("SEMIF_PREFIX_REUSE", "maybe", "SEMIF_PREFIX_REUSE='maybe' is not a boolean"),
    ],
)
def test_invalid_setting_names_variable_and_range(name: str, value: str, expected: str) -> None:
    with pytest.raises(SettingsError) as raised:
        load_settings({name: value})
    assert expected in str(raised.value)


# -- model discovery and manifest ---------------------------------------------------------


def test_discovery_finds_one_level_below(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "m.gguf").write_bytes(b"GGUF")
    assert discover_gguf(tmp_path) == tmp_path / "sub" / "m.gguf"


def test_discovery_lists_what_it_found_when_ambiguous(tmp_path: Path) -> None:
    (tmp_path / "a.gguf").write_bytes(b"1")
    (tmp_path / "b.gguf").write_bytes(b"2")
    with pytest.raises(ModelFilesError, match=r"found 2: a\.gguf, b\.gguf"):
        discover_gguf(tmp_path)


def test_discovery_refuses_an_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelFilesError, match="found 0: none"):
        discover_gguf(tmp_path)


def _manifest(
    directory: Path, gguf: Path, calibration: Calibration | None = None, **overrides: object
) -> None:
    data = gguf.read_bytes()
    entry = GgufInfo(
        file=gguf.name,
        bytes=len(data),
        sha256=hashlib.sha256(data).hexdigest(),
        architecture="llama",
        name=None,
        file_type=None,
        context_length=None,
        vocab_size=10,
        chat_template_sha256="1" * 64,
    )
    manifest = Manifest(
        source=SourceInfo(uri="s3://b/k.gguf", revision=None, file="k.gguf"),
        gguf=replace(entry, **overrides),  # type: ignore[arg-type]
        build=BuildInfo(built_at="2026-11-29T00:00:00Z", builder_version="test"),
        calibration=calibration,
    )
    (directory / "model-manifest.json").write_text(manifest.to_json())


def test_manifest_match_reports_identity(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF-bytes")
    _manifest(tmp_path, gguf)
    files = resolve_model_files(tmp_path, None)
    assert files.identity["sha256"] == hashlib.sha256(b"GGUF-bytes").hexdigest()
    assert files.identity["source"] == "s3://b/k.gguf"
    assert (files.calibration, files.identity["calibration"]) == (None, None)


def test_manifest_calibration_is_loaded_and_summarised(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF-bytes")
    _manifest(tmp_path, gguf, calibration=CALIBRATION)
    files = resolve_model_files(tmp_path, None)
    assert files.calibration == CALIBRATION
    assert files.identity["calibration"] == calibration_summary(CALIBRATION)
    assert files.identity["calibration"]["temperatures"] == {"choice": 1.5, "noul": 0.8}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"sha256": "0" * 64}, "does not match manifest " + "0" * 64),
        ({"bytes": 3}, "size 10 bytes does not match manifest 3"),
        ({"file": "other.gguf"}, "gguf.file is 'other.gguf'"),
    ],
)
def test_manifest_mismatch_refuses_to_start(
    tmp_path: Path, override: dict[str, Any], message: str
) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF-bytes")
    _manifest(tmp_path, gguf, **override)
    with pytest.raises(ModelFilesError, match=message):
        resolve_model_files(tmp_path, None)


# -- readout ------------------------------------------------------------------------------


def test_softmax_is_stable_for_huge_logits() -> None:
    result = softmax(np.array([1e4, 1e4 - 1.0, -1e4]))
    assert np.isfinite(result).all()
    assert abs(result.sum() - 1.0) < 1e-12
    assert result[0] > result[1] > result[2]


def test_read_slots_restricts_and_measures_mass() -> None:
    logits = np.log(np.array([0.5, 0.25, 0.125, 0.125], dtype=np.float32))
    readout = read_slots(logits, [1, 0])
    assert readout.probabilities == pytest.approx([1 / 3, 2 / 3])
    assert readout.allowed_token_mass == pytest.approx(0.75, abs=1e-6)
    assert readout.top_token_id == 0


def test_read_slots_refuses_nan() -> None:
    with pytest.raises(NonFiniteLogitsError):
        read_slots(np.array([0.0, np.nan], dtype=np.float32), [0, 1])


# -- schema -------------------------------------------------------------------------------


def _error(body: object, max_shared: int = 64) -> str:
    with pytest.raises(RequestError) as raised:
        parse_decision_body(body, max_shared)
    return str(raised.value)


def test_schema_accepts_single_and_shared() -> None:
    assert parse_decision_body({"decision": decision()}, 64).mode == "single"
    shared = parse_decision_body(
        {"decisions": [decision("a"), decision("b", question="Urgent?")]}, 64
    )
    assert (shared.mode, [d.id for d in shared.decisions]) == ("shared", ["a", "b"])


def test_schema_state_may_be_json() -> None:
    parsed = parse_decision_body({"decision": decision(state={"k": [1, "é"]})}, 64).decisions
    assert parsed[0].state_text == '{"k": [1, "é"]}'


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "body: must be a JSON object"),
        ({}, 'body: give exactly one of "decision" or "decisions"'),
        ({"decision": decision(), "decisions": []}, "body: give exactly one of"),
        ({"decision": decision(), "extra": 1}, "body.extra: unknown field"),
        ({"decision": {**decision(), "question": " "}}, "decision.question: must not be empty"),
        ({"decision": {**decision(), "state": ""}}, "decision.state: must not be empty"),
        (
            {"decision": {**decision(), "state": 3}},
            "decision.state: must be a string, a JSON object or an array",
        ),
        ({"decision": {**decision(), "state": {}}}, "decision.state: must not be empty"),
        (
            {"decision": decision(options=(("a", "A"),))},
            "decision.options: has 1 options; allowed 2..16",
        ),
        (
            {"decision": decision(options=tuple((f"o{i}", "x") for i in range(17)))},
            "decision.options: has 17 options; allowed 2..16",
        ),
        (
            {"decision": decision(options=(("a", "A"), ("b", "B"), ("a", "C")))},
            'decision.options[2].id: duplicate "a"',
        ),
        (
            {"decision": {**decision(), "options": [{"id": "a"}, {"id": "b", "description": "B"}]}},
            "decision.options[0].description: is required",
        ),
        ({"decisions": []}, "decisions: must be a non-empty array"),
        ({"decisions": [decision("a"), decision("a")]}, 'decisions[1].id: duplicate "a"'),
        (
            {"decisions": [decision("a"), decision("b", state="other")]},
            "decisions[1].state: must be exactly equal to decisions[0].state",
        ),
    ],
)
def test_schema_errors_name_the_path_and_rule(body: object, message: str) -> None:
    assert message in _error(body)


def test_shared_limit_names_the_setting() -> None:
    body = {"decisions": [decision(str(i)) for i in range(3)]}
    assert "has 3 decisions; the limit is 2 (SEMIF_MAX_SHARED_DECISIONS)" in _error(body, 2)


def test_unreadable_manifest_refuses_to_start(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF-bytes")
    (tmp_path / "model-manifest.json").write_text('{"schema_version": 2}')
    with pytest.raises(ModelFilesError, match=r"invalid manifest .*schema_version: 2"):
        resolve_model_files(tmp_path, None)


def test_backends_of_an_external_build_directory(tmp_path: Path) -> None:
    """An external llama.cpp directory (the DLC's) is loaded from and must hold libggml."""
    with pytest.raises(BackendLoadError, match=r"no libggml\.so in"):
        load_backends(tmp_path)
    assert "CPU" in load_backends(bundled_lib_dir())
