"""Deliver model.tar.gz to its destination: an S3 object, or a local file for the demo.

S3: multipart upload through boto3's transfer manager, which aborts the multipart upload on
any failure, so a failed build never leaves a partial object (a single-part PUT is atomic
anyway). The archive's sha256 and a build key travel as object metadata; a later build with
the same build key finds the object and skips all the work. Local: written to a temporary
name in the destination directory and renamed into place only when complete.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from boto3.s3.transfer import TransferConfig
from botocore.exceptions import BotoCoreError, ClientError

from model_build.errors import BuildError
from model_build.sources import S3_BUCKET

log = logging.getLogger(__name__)

ARCHIVE_NAME = "model.tar.gz"
# S3 user metadata (x-amz-meta-*): what a reader needs without downloading the archive.
META_SHA256 = "sha256"
META_BUILD_KEY = "build-key"
META_GGUF_FILE = "gguf-file"
META_GGUF_BYTES = "gguf-bytes"
META_GGUF_SHA256 = "gguf-sha256"

_DENIED = {
    "AccessDenied",
    "AllAccessDisabled",
    "403",
    "KMS.AccessDeniedException",
    "KMS.DisabledException",
    "KMS.NotFoundException",
    "KMS.KMSInvalidStateException",
}


@dataclass(frozen=True)
class S3Destination:
    bucket: str
    key: str

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


@dataclass(frozen=True)
class LocalDestination:
    path: Path

    @property
    def uri(self) -> str:
        return str(self.path)


Destination = S3Destination | LocalDestination


@dataclass(frozen=True)
class PublishedArchive:
    """An archive at its destination, as read back from S3 metadata or just written."""

    uri: str
    size: int
    sha256: str
    gguf_file: str
    gguf_bytes: int
    gguf_sha256: str
    version_id: str | None


def parse_destination(text: str) -> Destination:
    """`s3://bucket/prefix/model.tar.gz` or a local path ending in `model.tar.gz`."""
    if text.startswith("s3://"):
        bucket, _, key = text.removeprefix("s3://").partition("/")
        if not S3_BUCKET.fullmatch(bucket) or not key.endswith(ARCHIVE_NAME):
            raise BuildError(f"bad destination {text!r}: expected s3://<bucket>/<key>model.tar.gz")
        return S3Destination(bucket=bucket, key=key)
    if "://" in text or not text.endswith(ARCHIVE_NAME):
        raise BuildError(
            f"bad destination {text!r}: expected s3://... or a path ending in {ARCHIVE_NAME}"
        )
    return LocalDestination(path=Path(text).expanduser().absolute())


def find_existing(client: Any, dest: S3Destination, build_key: str) -> PublishedArchive | None:
    """The object at `dest` if it was built from the same inputs (same build key), else None.

    A missing object, one without our metadata or one we may not read all mean "build it";
    the upload then reports any real permission problem.
    """
    try:
        head = client.head_object(Bucket=dest.bucket, Key=dest.key)
    except ClientError:
        return None
    except BotoCoreError as exc:  # no credentials, no endpoint: nothing later would work
        raise BuildError(f"cannot reach {dest.uri}: {exc}") from None
    metadata = head.get("Metadata", {})
    if metadata.get(META_BUILD_KEY) != build_key:
        return None
    return PublishedArchive(
        uri=dest.uri,
        size=int(head["ContentLength"]),
        sha256=metadata[META_SHA256],
        gguf_file=metadata[META_GGUF_FILE],
        gguf_bytes=int(metadata[META_GGUF_BYTES]),
        gguf_sha256=metadata[META_GGUF_SHA256],
        version_id=head.get("VersionId"),
    )


def upload(
    client: Any,
    archive: Path,
    dest: S3Destination,
    *,
    metadata: dict[str, str],
    kms_key_id: str | None,
    part_bytes: int,
) -> str | None:
    """Upload `archive` to `dest` (multipart above `part_bytes`); return the version id."""
    extra: dict[str, Any] = {"Metadata": metadata, "ContentType": "application/gzip"}
    if kms_key_id:
        extra["ServerSideEncryption"] = "aws:kms"
        extra["SSEKMSKeyId"] = kms_key_id
    config = TransferConfig(
        multipart_threshold=part_bytes, multipart_chunksize=part_bytes, max_concurrency=4
    )
    try:
        with archive.open("rb") as handle:
            client.upload_fileobj(handle, dest.bucket, dest.key, ExtraArgs=extra, Config=config)
    except ClientError as exc:
        raise _upload_error(dest, exc) from None
    except BotoCoreError as exc:
        raise BuildError(f"upload to {dest.uri} failed: {exc}") from None
    try:  # only for the version id (upload_fileobj does not return it)
        head = client.head_object(Bucket=dest.bucket, Key=dest.key)
    except (ClientError, BotoCoreError) as exc:
        log.warning("uploaded %s but cannot read it back for its version id: %s", dest.uri, exc)
        return None
    if head.get("Metadata", {}).get(META_SHA256) != metadata[META_SHA256]:
        raise BuildError(f"{dest.uri} was overwritten by another build during this upload")
    version: str | None = head.get("VersionId")
    return version


def _upload_error(dest: S3Destination, exc: ClientError) -> BuildError:
    error = exc.response.get("Error", {})
    code = str(error.get("Code", ""))
    message = str(error.get("Message", "")).strip()
    detail = f"{code}: {message}" if message else code
    if code in _DENIED:
        return BuildError(f"no permission to write {dest.uri} ({detail})")
    if code == "NoSuchBucket":
        return BuildError(f"bucket {dest.bucket} does not exist ({detail})")
    return BuildError(f"upload to {dest.uri} failed ({detail})")


@contextmanager
def atomic_output(path: Path) -> Iterator[BinaryIO]:
    """A file that appears at `path` only complete: temp name beside it, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    temp = Path(temp_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, 0o644)
        temp.replace(path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
