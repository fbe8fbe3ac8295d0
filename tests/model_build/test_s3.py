"""S3 sources and destinations under moto: multipart upload, idempotent skip, SSE-KMS,
refused writes and aborted uploads that leave nothing behind."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError
from moto import mock_aws
from moto.core import set_initial_no_auth_action_count

from model_build.errors import BuildError
from model_build.manifest import MANIFEST_NAME, parse_manifest
from model_build.publish import S3Destination, upload
from tests.support.model_build import CliRun, TinyModel, run_cli, tiny_model, write_calibration

BUCKET = "artifacts"
DEST = f"s3://{BUCKET}/models/prod/model.tar.gz"
KEY = "models/prod/model.tar.gz"


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_SESSION_TOKEN", "MODEL_KMS_KEY_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("MODEL_BUILD_WORK_DIR", str(tmp_path / "work"))
    with mock_aws():
        client = boto3.client("s3", region_name="us-east-1")
        client.create_bucket(Bucket=BUCKET)
        client.put_bucket_versioning(Bucket=BUCKET, VersioningConfiguration={"Status": "Enabled"})
        yield client


@pytest.fixture(scope="module")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    """About 8 MiB, so 5 MiB parts make a real two-part multipart upload."""
    return tiny_model(tmp_path_factory.mktemp("big"), "big.gguf", n_embd=256, n_layer=3)


def _build(capsys: pytest.CaptureFixture[str], model: TinyModel, *extra: str) -> CliRun:
    return run_cli(
        capsys,
        "--source",
        str(model.path),
        "--sha256",
        model.sha256,
        "--dest",
        DEST,
        "--part-size-mb",
        "5",
        *extra,
    )


def _versions(s3: Any) -> list[dict[str, Any]]:
    versions: list[dict[str, Any]] = s3.list_object_versions(Bucket=BUCKET).get("Versions", [])
    return versions


def _no_upload_left(s3: Any) -> None:
    assert s3.list_multipart_uploads(Bucket=BUCKET).get("Uploads", []) == []
    assert _versions(s3) == []


def test_multipart_upload_stores_the_archive_and_its_hashes(
    s3: Any, big_model: TinyModel, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    run = _build(capsys, big_model)
    assert run.code == 0, run.err
    result = run.result
    assert (result["uri"], result["skipped"]) == (DEST, False)
    head = s3.head_object(Bucket=BUCKET, Key=KEY)
    assert head["ETag"].strip('"').endswith("-2")  # two parts
    assert head["ContentLength"] == result["archive_bytes"]
    assert head["VersionId"] == result["version_id"]
    assert head["Metadata"] == {
        "sha256": result["archive_sha256"],
        "build-key": result["build_key"],
        "gguf-file": "big.gguf",
        "gguf-bytes": str(len(big_model.data)),
        "gguf-sha256": big_model.sha256,
    }
    body = s3.get_object(Bucket=BUCKET, Key=KEY)["Body"].read()
    assert hashlib.sha256(body).hexdigest() == result["archive_sha256"]
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        gguf = tar.extractfile("big.gguf")
        manifest = tar.extractfile(MANIFEST_NAME)
        assert gguf is not None
        assert manifest is not None
        assert gguf.read() == big_model.data
        assert parse_manifest(json.load(manifest)).gguf.sha256 == big_model.sha256
    assert "ServerSideEncryption" not in head or head["ServerSideEncryption"] != "aws:kms"
    assert not list((tmp_path / "work").rglob("*.tar.gz"))  # the scratch archive is gone


def test_rerun_with_the_same_inputs_skips_the_upload(
    s3: Any, big_model: TinyModel, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    first = _build(capsys, big_model)
    second = _build(capsys, big_model)
    assert second.code == 0, second.err
    assert second.result == {**first.result, "skipped": True}
    assert "upload skipped" in second.err
    assert "fetching" not in second.err  # nothing downloaded or packed either
    assert len(_versions(s3)) == 1
    calibration = write_calibration(tmp_path / "calibration.json")
    changed = _build(capsys, big_model, "--calibration", str(calibration))
    assert changed.result["skipped"] is False
    assert changed.result["build_key"] != first.result["build_key"]
    assert len(_versions(s3)) == 2


def test_kms_key_is_used_for_server_side_encryption(
    s3: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    key_arn = boto3.client("kms", region_name="us-east-1").create_key()["KeyMetadata"]["Arn"]
    run = _build(capsys, tiny_model(tmp_path), "--kms-key-id", key_arn)
    assert run.code == 0, run.err
    head = s3.head_object(Bucket=BUCKET, Key=KEY)
    assert head["ServerSideEncryption"] == "aws:kms"
    assert head["SSEKMSKeyId"] == key_arn
    assert head["Metadata"]["sha256"] == run.result["archive_sha256"]


def _build_as_user_allowed(
    actions: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    model: TinyModel,
) -> CliRun:
    """Build with the keys of an IAM user allowed only `actions` (moto enforces IAM here)."""

    @set_initial_no_auth_action_count(3)  # the 3 IAM calls below run unauthenticated
    def build() -> CliRun:
        iam = boto3.client("iam", region_name="us-east-1")
        iam.create_user(UserName="builder")
        statement = {"Effect": "Allow", "Action": actions, "Resource": "*"}
        iam.put_user_policy(
            UserName="builder",
            PolicyName="limited",
            PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [statement]}),
        )
        keys = iam.create_access_key(UserName="builder")["AccessKey"]
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", keys["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", keys["SecretAccessKey"])
        return _build(capsys, model)

    return build()


def test_no_permission_to_write_is_one_clear_line(
    s3: Any,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = _build_as_user_allowed(["s3:GetObject"], capsys, monkeypatch, tiny_model(tmp_path))
    assert run.code == 1
    assert run.out == ""
    assert run.error.startswith(f"model-build: no permission to write {DEST} (AccessDenied")
    _no_upload_left(s3)
    assert not list((tmp_path / "work").rglob("*.tar.gz"))


def test_write_only_permission_uploads_without_reading_back(
    s3: Any,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """HEAD is denied (403): no skip check, no version id, but the upload itself succeeds."""
    run = _build_as_user_allowed(["s3:PutObject"], capsys, monkeypatch, tiny_model(tmp_path))
    assert run.code == 0, run.err
    assert run.result["version_id"] is None
    assert "cannot read it back" in run.err
    assert [v["VersionId"] for v in _versions(s3)] != []


def test_failed_part_aborts_the_multipart_upload(
    s3: Any, big_model: TinyModel, tmp_path: Path
) -> None:
    archive = tmp_path / "model.tar.gz"
    archive.write_bytes(big_model.data)
    calls: list[int] = []

    def fail_second_part(params: dict[str, Any], **_: Any) -> None:
        calls.append(params["PartNumber"])
        if params["PartNumber"] == 2:
            raise ClientError({"Error": {"Code": "InternalError", "Message": "boom"}}, "UploadPart")

    s3.meta.events.register("provide-client-params.s3.UploadPart", fail_second_part)
    with pytest.raises(BuildError, match=rf"^upload to {DEST} failed \(InternalError: boom\)"):
        upload(
            s3,
            archive,
            S3Destination(BUCKET, KEY),
            metadata={"sha256": "0" * 64},
            kms_key_id=None,
            part_bytes=5 << 20,
        )
    assert 2 in calls
    _no_upload_left(s3)


def test_missing_bucket_is_named(
    s3: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    model = tiny_model(tmp_path)
    run = run_cli(
        capsys,
        "--source",
        str(model.path),
        "--sha256",
        model.sha256,
        "--dest",
        "s3://no-such-bucket/model.tar.gz",
    )
    assert run.code == 1
    assert run.error.startswith("model-build: bucket no-such-bucket does not exist")


def test_s3_source_is_downloaded_and_recorded(
    s3: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    model = tiny_model(tmp_path)
    s3.put_object(Bucket=BUCKET, Key="mirror/tiny.gguf", Body=model.data)
    dest = tmp_path / "out" / "model.tar.gz"
    source = f"s3://{BUCKET}/mirror/tiny.gguf"
    run = run_cli(capsys, "--source", source, "--sha256", model.sha256, "--dest", str(dest))
    assert run.code == 0, run.err
    with tarfile.open(dest) as tar:
        manifest = tar.extractfile(MANIFEST_NAME)
        assert manifest is not None
        parsed = parse_manifest(json.load(manifest))
    assert (parsed.source.uri, parsed.source.revision, parsed.source.file) == (
        source,
        None,
        "mirror/tiny.gguf",
    )
    missing = run_cli(
        capsys,
        "--source",
        f"s3://{BUCKET}/mirror/absent.gguf",
        "--sha256",
        model.sha256,
        "--dest",
        str(dest),
    )
    absent = f"s3://{BUCKET}/mirror/absent.gguf"
    assert missing.error == f"model-build: source not found: {absent} (NoSuchKey)"
