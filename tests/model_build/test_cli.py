"""`model-build` end to end with local destinations: archive contents, env defaults, errors."""

from __future__ import annotations

import errno
import hashlib
import json
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from adapter.model_files import resolve_model_files
from adapter.runtime import load_service
from adapter.settings import Settings
from model_build.archive import _HashingWriter
from model_build.embedded import SMOLLM2
from model_build.manifest import CHAT_TEMPLATE_NAME, MANIFEST_NAME, ChatTemplateFile, load_manifest
from model_build.sources import PRODUCTION_MODEL
from model_build.tiny_gguf import CHAT_TEMPLATE
from tests.support.model_build import (
    CALIBRATION,
    REVISION,
    CliRun,
    FileServer,
    TinyModel,
    closed_port_url,
    run_cli,
    serve_files,
    sha256_hex,
    tiny_model,
    write_calibration,
)

EPOCH = "1790000000"  # 2026-09-21T14:13:20Z
_ENV = (
    "MODEL_SOURCE_URI",
    "MODEL_SHA256",
    "MODEL_DEST_URI",
    "MODEL_KMS_KEY_ID",
    "MODEL_BUILD_HF_BASE_URL",
    "MODEL_BUILD_WORK_DIR",
    "MODEL_CALIBRATION_FILE",
    "MODEL_CHAT_TEMPLATE_FILE",
    "MODEL_BUILD_RETRIES",
    "MODEL_BUILD_RETRY_WAIT",
    "MODEL_BUILD_PART_SIZE_MB",
    "HF_TOKEN",
    "SOURCE_DATE_EPOCH",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MODEL_BUILD_WORK_DIR", str(tmp_path / "work"))
    monkeypatch.setenv("MODEL_BUILD_RETRY_WAIT", "0")


@pytest.fixture
def model(tmp_path: Path) -> TinyModel:
    source = tmp_path / "src"
    source.mkdir()
    return tiny_model(source)


@pytest.fixture
def file_server() -> Iterator[FileServer]:
    with serve_files() as server:
        yield server


def _build(capsys: pytest.CaptureFixture[str], model: TinyModel, dest: Path) -> CliRun:
    return run_cli(
        capsys, "--source", str(model.path), "--sha256", model.sha256, "--dest", str(dest)
    )


def _unpack(archive: Path, into: Path) -> Path:
    """Unpack like SageMaker does into a /opt/ml/model-like directory."""
    into.mkdir()
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def test_local_build_packs_the_validated_gguf_and_its_manifest(
    model: TinyModel,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    dest = tmp_path / "out" / "model.tar.gz"
    run = _build(capsys, model, dest)
    assert run.code == 0, run.err
    archive = dest.read_bytes()
    assert run.result == {
        "uri": str(dest),
        "skipped": False,
        "archive_bytes": len(archive),
        "archive_sha256": sha256_hex(archive),
        "gguf_file": "tiny.gguf",
        "gguf_bytes": len(model.data),
        "gguf_sha256": model.sha256,
        "source_uri": model.path.as_uri(),
        "build_key": run.result["build_key"],
        "version_id": None,
    }
    assert sorted(p.name for p in dest.parent.iterdir()) == ["model.tar.gz"]
    model_dir = _unpack(dest, tmp_path / "opt-ml-model")
    assert sorted(p.name for p in model_dir.iterdir()) == [MANIFEST_NAME, "tiny.gguf"]
    assert (model_dir / "tiny.gguf").read_bytes() == model.data
    manifest = load_manifest(model_dir / MANIFEST_NAME)
    assert manifest.source.uri == model.path.as_uri()
    assert (manifest.source.revision, manifest.source.file) == (None, "tiny.gguf")
    assert (manifest.gguf.file, manifest.gguf.bytes) == ("tiny.gguf", len(model.data))
    assert manifest.gguf.sha256 == model.sha256
    assert (manifest.gguf.architecture, manifest.gguf.vocab_size) == ("llama", 263)
    assert manifest.build.built_at == "2026-09-21T14:13:20Z"
    assert manifest.build.builder_version == "0.1.0"
    assert manifest.calibration is None
    assert "packed" in run.err
    # The adapter accepts exactly this directory (its manifest check is the other half).
    identity = resolve_model_files(model_dir, None).identity
    assert (identity["sha256"], identity["source"]) == (model.sha256, model.path.as_uri())


def test_same_inputs_give_the_same_archive(
    model: TinyModel,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    args = ["--source", str(model.path), "--sha256", model.sha256]
    first = run_cli(capsys, *args, "--dest", str(tmp_path / "a" / "model.tar.gz"))
    second = run_cli(capsys, *args, "--dest", str(tmp_path / "b" / "model.tar.gz"))
    assert first.result["archive_sha256"] == second.result["archive_sha256"]
    assert first.result["build_key"] == second.result["build_key"]
    monkeypatch.setenv("SOURCE_DATE_EPOCH", str(int(EPOCH) + 1))
    third = run_cli(capsys, *args, "--dest", str(tmp_path / "c" / "model.tar.gz"))
    assert third.result["archive_sha256"] != first.result["archive_sha256"]  # built_at differs
    assert third.result["build_key"] == first.result["build_key"]  # the inputs do not


def test_flags_default_from_environment_variables(
    model: TinyModel,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dest = tmp_path / "model.tar.gz"
    monkeypatch.setenv("MODEL_SOURCE_URI", str(model.path))
    monkeypatch.setenv("MODEL_SHA256", model.sha256.upper())
    monkeypatch.setenv("MODEL_DEST_URI", str(dest))
    calibration = write_calibration(tmp_path / "calibration.json")
    monkeypatch.setenv("MODEL_CALIBRATION_FILE", str(calibration))
    run = run_cli(capsys)
    assert run.code == 0, run.err
    manifest = load_manifest(_unpack(dest, tmp_path / "m") / MANIFEST_NAME)
    assert manifest.calibration == CALIBRATION
    assert f"calibration {calibration}: prompt version semif-direct-options/1" in run.err


def test_calibration_is_recorded_and_keys_the_build(
    model: TinyModel,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)
    args = ["--source", str(model.path), "--sha256", model.sha256]
    plain = run_cli(capsys, *args, "--dest", str(tmp_path / "a" / "model.tar.gz"))
    path = write_calibration(tmp_path / "calibration.json")
    calibrated_dest = tmp_path / "b" / "model.tar.gz"
    calibrated = run_cli(capsys, *args, "--calibration", str(path), "--dest", str(calibrated_dest))
    assert calibrated.code == 0, calibrated.err
    assert calibrated.result["build_key"] != plain.result["build_key"]
    model_dir = _unpack(calibrated_dest, tmp_path / "opt-ml-model")
    assert load_manifest(model_dir / MANIFEST_NAME).calibration == CALIBRATION
    # The adapter reads the same section and reports which fit it applies.
    files = resolve_model_files(model_dir, None)
    assert files.calibration == CALIBRATION
    assert files.identity["calibration"]["tasks_sha256"] == CALIBRATION.tasks_sha256
    # Reformatting the file is not a new build; a refit is.
    path.write_text(json.dumps(CALIBRATION.to_document()))
    same = run_cli(
        capsys, *args, "--calibration", str(path), "--dest", str(tmp_path / "c" / "model.tar.gz")
    )
    assert same.result["build_key"] == calibrated.result["build_key"]
    write_calibration(path, replace(CALIBRATION, temperatures={"choice": 2.0}))
    refit = run_cli(
        capsys, *args, "--calibration", str(path), "--dest", str(tmp_path / "d" / "model.tar.gz")
    )
    assert refit.result["build_key"] != calibrated.result["build_key"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read calibration"),
        ("{not json", "cannot read calibration"),
        ('{"temperature": 1.2}', "calibration.schema_version: None is not supported"),
        (
            json.dumps({**CALIBRATION.to_document(), "temperatures": {"choice": -1}}),
            "calibration.temperatures.choice: must be a number in 0.01..100",
        ),
    ],
)
def test_a_bad_calibration_file_is_one_line_before_any_download(
    content: str | None,
    message: str,
    model: TinyModel,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "calibration.json"
    if content is not None:
        path.write_text(content)
    dest = tmp_path / "out" / "model.tar.gz"
    run = run_cli(
        capsys,
        *("--source", str(model.path), "--sha256", model.sha256, "--dest", str(dest)),
        *("--calibration", str(path)),
    )
    assert run.code == 1
    assert run.out == ""
    assert run.error.startswith(f"model-build: {path}: "), run.error
    assert message in run.error
    assert "fetching" not in run.err
    assert not dest.parent.exists()


def test_a_chat_template_is_packed_recorded_and_served(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GGUF without a template builds with --chat-template; the adapter serves it."""
    bare = tiny_model(tmp_path, "bare.gguf", chat_template=None)
    template = tmp_path / "template.jinja"
    data = ("Operator preamble.\r\n" + CHAT_TEMPLATE).encode()  # bytes as given, CRLF kept
    template.write_bytes(data)
    monkeypatch.setenv("MODEL_CHAT_TEMPLATE_FILE", str(template))
    args = ["--source", str(bare.path), "--sha256", bare.sha256]
    run = run_cli(capsys, *args, "--dest", str(tmp_path / "a" / "model.tar.gz"))
    assert run.code == 0, run.err
    assert f"packed as {CHAT_TEMPLATE_NAME}" in run.err
    model_dir = _unpack(tmp_path / "a" / "model.tar.gz", tmp_path / "opt-ml-model")
    assert sorted(p.name for p in model_dir.iterdir()) == [
        "bare.gguf",
        CHAT_TEMPLATE_NAME,
        MANIFEST_NAME,
    ]
    assert (model_dir / CHAT_TEMPLATE_NAME).read_bytes() == data
    manifest = load_manifest(model_dir / MANIFEST_NAME)
    assert manifest.chat_template == ChatTemplateFile(
        CHAT_TEMPLATE_NAME, len(data), sha256_hex(data)
    )
    assert manifest.gguf.chat_template_sha256 is None  # the GGUF has none of its own
    service = load_service(Settings(model_dir=model_dir, threads=1))
    try:
        assert service.model["chat_template"] == {"source": "operator", "sha256": sha256_hex(data)}
    finally:
        service.engine.close()
    # Another template is another build.
    template.write_text("Another operator.\n" + CHAT_TEMPLATE)
    other = run_cli(capsys, *args, "--dest", str(tmp_path / "b" / "model.tar.gz"))
    assert other.result["build_key"] != run.result["build_key"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "chat template cannot be read (No such file or directory)"),
        (b"", "chat template is empty"),
        (b"\xff{{ messages }}", "chat template is not UTF-8 text (invalid start byte at byte 0)"),
    ],
)
def test_a_bad_chat_template_file_is_one_line_before_any_download(
    content: bytes | None,
    message: str,
    model: TinyModel,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "template.jinja"
    if content is not None:
        path.write_bytes(content)
    dest = tmp_path / "out" / "model.tar.gz"
    run = run_cli(
        capsys,
        *("--source", str(model.path), "--sha256", model.sha256, "--dest", str(dest)),
        *("--chat-template", str(path)),
    )
    assert run.code == 1
    assert run.error == f"model-build: {path}: {message}"
    assert "fetching" not in run.err
    assert not dest.parent.exists()


def test_hf_source_end_to_end_with_a_cut_connection(
    model: TinyModel,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    file_server: FileServer,
) -> None:
    uri = file_server.add("acme/tiny-GGUF", "sub/tiny-Q8.gguf", model.data)
    file_server.cut_first_response_at = len(model.data) // 3
    monkeypatch.setenv("MODEL_BUILD_HF_BASE_URL", file_server.url)
    dest = tmp_path / "model.tar.gz"
    run = run_cli(capsys, "--source", uri, "--sha256", model.sha256, "--dest", str(dest))
    assert run.code == 0, run.err
    assert file_server.requests[1]["Range"] == f"bytes={len(model.data) // 3}-"
    model_dir = _unpack(dest, tmp_path / "m")
    manifest = load_manifest(model_dir / MANIFEST_NAME)
    assert (manifest.source.uri, manifest.source.revision) == (uri, REVISION)
    assert (manifest.source.file, manifest.gguf.file) == ("sub/tiny-Q8.gguf", "tiny-Q8.gguf")
    assert (model_dir / "tiny-Q8.gguf").read_bytes() == model.data


def test_large_download_is_streamed_not_held_in_memory(
    model: TinyModel,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    file_server: FileServer,
) -> None:
    """A 64 MiB model (tiny GGUF + padding the reader ignores) peaks far below its size."""
    data = model.data + bytes(64 << 20)
    uri = file_server.add("acme/padded", "padded.gguf", data)
    file_server.cut_first_response_at = 40 << 20
    monkeypatch.setenv("MODEL_BUILD_HF_BASE_URL", file_server.url)
    dest = tmp_path / "model.tar.gz"
    tracemalloc.start()
    try:
        run = run_cli(capsys, "--source", uri, "--sha256", sha256_hex(data), "--dest", str(dest))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert run.code == 0, run.err
    assert peak < 16 << 20, f"peak traced memory {peak} bytes"
    assert run.result["archive_bytes"] > len(data)
    percents = [int(p) for p in re.findall(rf"of {len(data)} bytes \((\d+)%\)", run.err)]
    assert percents == sorted(percents)  # progress about every 10 %, resumed after the cut
    assert 9 <= len(percents) <= 11
    assert percents[-1] == 100
    assert f"retrying from byte {40 << 20}" in run.err


def test_sigterm_interrupts_cleanly(
    model: TinyModel, tmp_path: Path, file_server: FileServer
) -> None:
    """CodeBuild stops builds with SIGTERM: one line, exit 130, nothing left at the dest."""
    uri = file_server.add("acme/tiny", "tiny.gguf", model.data)
    file_server.cut_first_response_at = 1000
    file_server.stall_before_cut_s = 30
    dest = tmp_path / "out" / "model.tar.gz"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "model_build.cli",
            "--source",
            uri,
            "--sha256",
            model.sha256,
            "--dest",
            str(dest),
            "--hf-base-url",
            file_server.url,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 20
    while not file_server.requests and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # let it block in the stalled read
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=20)
    assert process.returncode == 130
    assert out == ""
    assert err.strip().splitlines()[-1] == "model-build: interrupted"
    assert not dest.parent.exists()


def test_embedded_flag_records_the_pypi_origin(
    model: TinyModel,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("model_build.fetch.fetch_embedded_model", lambda cache, _: model.path)
    dest = tmp_path / "model.tar.gz"
    refused = run_cli(capsys, "--embedded", "--dest", str(dest))
    assert refused.code == 1  # the tiny file is not the pinned SmolLM2
    assert refused.error == (
        f"model-build: sha256 mismatch for tiny.gguf: expected {SMOLLM2.sha256}, got {model.sha256}"
    )
    run = run_cli(capsys, "--embedded", "--sha256", model.sha256, "--dest", str(dest))
    assert run.code == 0, run.err
    manifest = load_manifest(_unpack(dest, tmp_path / "m") / MANIFEST_NAME)
    assert (manifest.source.uri, manifest.source.file) == (SMOLLM2.source_uri, SMOLLM2.member)
    assert manifest.gguf.file == SMOLLM2.file_name


@pytest.mark.slow
def test_embedded_smollm2_is_packed_through_the_same_path(
    smollm2_gguf: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("model_build.fetch.fetch_embedded_model", lambda cache, _: smollm2_gguf)
    dest = tmp_path / "model.tar.gz"
    run = run_cli(capsys, "--embedded", "--dest", str(dest))
    assert run.code == 0, run.err
    assert run.result["gguf_sha256"] == SMOLLM2.sha256
    with tarfile.open(dest) as tar:
        member = tar.extractfile(MANIFEST_NAME)
        assert member is not None
        text = member.read().decode()
    assert '"file_type": "Q4_1"' in text
    assert '"vocab_size": 49152' in text


def test_production_pin_is_the_default_source(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    file_server: FileServer,
) -> None:
    """No source given: the Qwen3.5-4B pin and its sha256 (served here by a stand-in file)."""
    repo_and_file = PRODUCTION_MODEL.source_uri.removeprefix("hf://")
    repo, _, rest = repo_and_file.partition("@")
    revision, _, file = rest.partition("/")
    file_server.files[f"/{repo}/resolve/{revision}/{file}"] = b"not the real model"
    monkeypatch.setenv("MODEL_BUILD_HF_BASE_URL", file_server.url)
    run = run_cli(capsys, "--dest", str(tmp_path / "model.tar.gz"))
    assert run.code == 1
    assert run.error == (
        f"model-build: sha256 mismatch for {file}: expected {PRODUCTION_MODEL.sha256}, "
        f"got {sha256_hex(b'not the real model')}"
    )


@pytest.mark.parametrize(
    ("source", "sha", "message"),
    [
        ("gs://bucket/m.gguf", "ok", "bad source URI 'gs://bucket/m.gguf'"),
        ("hf://org/repo/m.gguf", "ok", "missing revision in 'hf://org/repo/m.gguf'"),
        (
            "hf://org/repo@main/m.gguf",
            "ok",
            "revision 'main' in 'hf://org/repo@main/m.gguf' is not a full 40-hex commit",
        ),
        (
            f"hf://org/repo@{REVISION}/m.bin",
            "ok",
            f"bad source 'hf://org/repo@{REVISION}/m.bin': the file name must end in .gguf",
        ),
        ("s3://b/m.gguf", "ok", "bad source URI 's3://b/m.gguf'"),
        ("model", "", "no expected sha256 for"),
        ("model", "abc", "bad sha256 'abc': expected 64 hex digits"),
        ("model", "0" * 64, "sha256 mismatch for tiny.gguf: expected " + "0" * 64),
        ("missing.gguf", "ok", "source not found:"),
        ("zip", "ok", "not a GGUF file: zip.gguf starts with b'PK"),
        ("no-template", "ok", "no chat template in no-template.gguf (tokenizer.chat_template)"),
        (f"hf://org/absent@{REVISION}/m.gguf", "ok", "source not found: http://"),
        (f"hf://org/repo@{REVISION}/m.gguf", "unreachable", "cannot download http://127.0.0.1:"),
    ],
)
def test_errors_are_one_line_and_leave_nothing_behind(
    source: str,
    sha: str,
    message: str,
    model: TinyModel,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    file_server: FileServer,
) -> None:
    files = {
        "model": model,
        "zip": _write(tmp_path / "zip.gguf", b"PK\x03\x04" + bytes(100)),
        "no-template": tiny_model(tmp_path, "no-template.gguf", chat_template=None),
    }
    picked = files.get(source)
    if picked is not None:
        source_arg, expected_sha = str(picked.path), picked.sha256
    else:
        source_arg = source if "://" in source else str(tmp_path / source)
        expected_sha = "1" * 64
    sha_arg = expected_sha if sha in {"ok", "unreachable"} else sha
    base = closed_port_url() if sha == "unreachable" else file_server.url
    dest = tmp_path / "out" / "model.tar.gz"
    args = ["--source", source_arg, "--dest", str(dest), "--hf-base-url", base, "--retries", "2"]
    if sha_arg:
        args += ["--sha256", sha_arg]
    run = run_cli(capsys, *args)
    assert run.code == 1
    assert run.out == ""
    assert run.error.startswith(f"model-build: {message}"), run.error
    assert not dest.parent.exists() or list(dest.parent.iterdir()) == []
    assert not list((tmp_path / "work").rglob("*.tar.gz"))


def _write(path: Path, data: bytes) -> TinyModel:
    path.write_bytes(data)
    return TinyModel(path=path, data=data, sha256=sha256_hex(data))


def test_bad_destination_and_missing_destination(
    model: TinyModel, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--source", str(model.path), "--sha256", model.sha256]
    assert run_cli(capsys, *args).error == (
        "model-build: no destination: pass --dest or set MODEL_DEST_URI"
    )
    assert run_cli(capsys, *args, "--dest", "out/archive.zip").error.startswith(
        "model-build: bad destination 'out/archive.zip'"
    )


def test_disk_full_is_refused_before_writing(
    model: TinyModel,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(
        "model_build.fetch.shutil.disk_usage", lambda path: usage._replace(free=1000)
    )
    dest = tmp_path / "out" / "model.tar.gz"
    run = _build(capsys, model, dest)
    assert run.code == 1
    assert run.error.startswith("model-build: disk full: packing model.tar.gz needs ")
    assert run.error.endswith(", only 1000 free")
    assert not dest.parent.exists()


def test_disk_full_while_writing_leaves_no_partial_archive(
    model: TinyModel,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_write = _HashingWriter.write

    def write_until_full(self: _HashingWriter, data: bytes) -> int:
        if self.size > 100_000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, data)

    monkeypatch.setattr(_HashingWriter, "write", write_until_full)
    dest = tmp_path / "out" / "model.tar.gz"
    run = _build(capsys, model, dest)
    assert run.code == 1
    assert run.error.startswith("model-build: disk full")
    assert list(dest.parent.iterdir()) == []


def test_packed_gguf_must_match_the_verified_bytes(
    model: TinyModel,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A file that changes between verification and packing is caught, not shipped."""
    import model_build.gguf_info

    real_inspect = model_build.gguf_info.inspect_gguf

    def inspect_then_tamper(path: Path, **kwargs: object) -> object:
        info = real_inspect(path, **kwargs)  # type: ignore[arg-type]
        with path.open("r+b") as handle:
            handle.seek(len(model.data) - 1)
            handle.write(b"\xff" if model.data[-1:] != b"\xff" else b"\0")
        return info

    monkeypatch.setattr("model_build.build.inspect_gguf", inspect_then_tamper)
    dest = tmp_path / "out" / "model.tar.gz"
    run = _build(capsys, model, dest)
    assert run.code == 1
    assert run.error.startswith("model-build: sha256 mismatch for tiny.gguf: it changed while")
    assert list(dest.parent.iterdir()) == []
    assert hashlib.sha256(model.path.read_bytes()).hexdigest() != model.sha256
