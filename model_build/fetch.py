"""Get the source GGUF onto local disk and prove it is exactly the pinned file.

Downloads stream to a `.partial` file while hashing, so a multi-gigabyte model never sits in
memory. A cut connection or a transient server error resumes from the last byte written
(HTTP `Range`), with exponential backoff; a partial file left by an interrupted run is
picked up the same way. A finished download whose sha256 is not the expected one is deleted
and refused, so a bad file is never packed, uploaded or resumed from.
"""

from __future__ import annotations

import hashlib
import http.client
import logging
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

from model_build.embedded import EmbeddedModelError, fetch_embedded_model, sha256_of
from model_build.errors import BuildError
from model_build.sources import (
    EmbeddedSource,
    HfSource,
    LocalSource,
    S3Source,
    Source,
    file_name,
)

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
_PROGRESS_STEP_BYTES = 256 << 20


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently transient download failures are retried."""

    attempts: int = 5
    first_wait_s: float = 2.0
    max_wait_s: float = 60.0

    def wait_s(self, failures: int) -> float:
        return min(self.max_wait_s, self.first_wait_s * 2.0 ** (failures - 1))


@dataclass(frozen=True)
class Fetched:
    """A local GGUF whose sha256 equals the expected one."""

    path: Path
    size: int
    sha256: str


@dataclass(frozen=True)
class HttpSettings:
    """Where Hugging Face files are fetched from, and with which credentials."""

    base_url: str
    token: str | None = None
    timeout_s: float = 60.0


def fetch(
    source: Source,
    expected_sha256: str,
    *,
    work_dir: Path,
    http: HttpSettings,
    retry: RetryPolicy,
    s3_client: Callable[[], Any],
) -> Fetched:
    """Return the verified local file for `source`, downloading it into `work_dir` if remote."""
    if isinstance(source, LocalSource):
        # Resolved: a symlinked source (e.g. a Hugging Face cache entry) packs its target.
        return _verify_local(source.path.resolve(), expected_sha256)
    if isinstance(source, EmbeddedSource):
        try:
            path = fetch_embedded_model(work_dir / "embedded", source.model)
        except EmbeddedModelError as exc:
            raise BuildError(f"cannot fetch the embedded model: {exc}") from None
        return _verify_local(path, expected_sha256)
    target = work_dir / "downloads" / expected_sha256 / file_name(source)
    if target.is_file():
        try:
            cached = _verify_local(target, expected_sha256)
        except BuildError:
            target.unlink()
        else:
            log.info("using verified download %s", target)
            return cached
    if isinstance(source, HfSource):
        url = source.url(http.base_url)
        opener = _http_opener(url, http)
        label = url
    else:
        opener = _s3_opener(s3_client(), source)
        label = source.uri
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    digest, size = _download(opener, partial, label, retry)
    if digest != expected_sha256:
        partial.unlink()
        raise BuildError(
            f"sha256 mismatch for {file_name(source)}: expected {expected_sha256}, got {digest}"
        )
    partial.replace(target)
    return Fetched(path=target, size=size, sha256=digest)


def ensure_free_space(directory: Path, needed: int, purpose: str) -> None:
    """Refuse early, with numbers, instead of failing deep into a multi-gigabyte write."""
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise BuildError(
            f"disk full: {purpose} needs {needed} bytes in {directory}, only {free} free"
        )


def _verify_local(path: Path, expected_sha256: str) -> Fetched:
    if not path.is_file():
        raise BuildError(f"source not found: {path} is not a file")
    digest = sha256_of(path)
    if digest != expected_sha256:
        raise BuildError(
            f"sha256 mismatch for {path.name}: expected {expected_sha256}, got {digest}"
        )
    return Fetched(path=path, size=path.stat().st_size, sha256=digest)


class _TransientError(Exception):
    """A failure worth retrying from the current offset (cut connection, 5xx, timeout)."""


class _RangeNotSatisfiableError(Exception):
    """The server refused the resume offset: the partial file cannot be trusted."""


@dataclass(frozen=True)
class _Body:
    """One response body: the object offset it starts at, the object size, a reader."""

    start: int
    total: int | None
    read: Callable[[int], bytes]


_Opener = Callable[[int], AbstractContextManager[_Body]]


def _download(opener: _Opener, partial: Path, label: str, retry: RetryPolicy) -> tuple[str, int]:
    """Fill `partial` from `opener`, resuming after failures; return (sha256, size)."""
    digest = hashlib.sha256()
    offset = 0
    if partial.is_file():
        offset = partial.stat().st_size
        digest = _hash_file(partial)
        log.info("resuming %s from byte %d", label, offset)
    failures = 0
    while True:
        started_at = offset
        try:
            with opener(offset) as body:
                if body.start == 0 and offset:
                    log.info("%s: server ignored the range; restarting from byte 0", label)
                    digest, offset = hashlib.sha256(), 0
                elif body.start != offset:
                    raise _TransientError(f"server resumed at byte {body.start}, not {offset}")
                if body.total is not None:
                    ensure_free_space(partial.parent, body.total - offset, f"downloading {label}")
                with partial.open("r+b" if partial.exists() else "wb") as out:
                    out.seek(offset)
                    out.truncate()
                    progress = _Progress(label, body.total, offset)
                    while chunk := body.read(CHUNK_BYTES):
                        out.write(chunk)
                        digest.update(chunk)
                        offset += len(chunk)
                        progress.update(offset)
            if body.total is not None and offset < body.total:
                raise _TransientError(f"connection closed at byte {offset} of {body.total}")
            log.info("downloaded %s (%d bytes)", label, offset)
            return digest.hexdigest(), offset
        except _RangeNotSatisfiableError:
            if not offset:  # no range was asked for: nothing to fall back on
                raise BuildError(f"cannot download {label}: range not satisfiable") from None
            log.info("%s: cannot resume at byte %d; restarting from byte 0", label, offset)
            partial.unlink()
            digest, offset = hashlib.sha256(), 0
        except _TransientError as exc:
            failures = 1 if offset > started_at else failures + 1
            if failures >= retry.attempts:
                raise BuildError(
                    f"cannot download {label}: {exc} (gave up after {failures} attempts)"
                ) from None
            wait_s = retry.wait_s(failures)
            log.warning("%s: %s; retrying from byte %d in %.1fs", label, exc, offset, wait_s)
            time.sleep(wait_s)


def _hash_file(path: Path) -> hashlib._Hash:
    """sha256 of a file, streamed; the object can go on hashing bytes appended later."""
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256")


class _Progress:
    """Log download progress every 10 % (or every 256 MiB when the size is unknown)."""

    def __init__(self, label: str, total: int | None, offset: int) -> None:
        self._label = label
        self._total = total
        self._step = max(total // 10, 1) if total else _PROGRESS_STEP_BYTES
        self._next = (offset // self._step + 1) * self._step

    def update(self, offset: int) -> None:
        if offset < self._next:
            return
        self._next = (offset // self._step + 1) * self._step
        if self._total:
            log.info(
                "%s: %d of %d bytes (%d%%)",
                self._label,
                offset,
                self._total,
                100 * offset // self._total,
            )
        else:
            log.info("%s: %d bytes", self._label, offset)


def _parse_content_range(value: str | None) -> tuple[int, int | None]:
    """`bytes 100-199/1000` -> (100, 1000); an unknown total (`/*`) gives None."""
    if not value or not value.startswith("bytes "):
        raise _TransientError(f"bad Content-Range {value!r}")
    span, _, total = value.removeprefix("bytes ").partition("/")
    start, _, _ = span.partition("-")
    try:
        return int(start), None if total == "*" else int(total)
    except ValueError:
        raise _TransientError(f"bad Content-Range {value!r}") from None


def _http_opener(url: str, settings: HttpSettings) -> _Opener:
    if not url.startswith(("https://", "http://")):
        raise BuildError(f"bad Hugging Face base URL in {url!r}: expected https:// or http://")

    @contextmanager
    def open_at(offset: int) -> Iterator[_Body]:
        request = urllib.request.Request(  # noqa: S310 (scheme checked above)
            url, headers={"User-Agent": "model-build"}
        )
        if offset:
            request.add_header("Range", f"bytes={offset}-")
        if settings.token:
            # Unredirected: the token goes to huggingface.co, never to the CDN it redirects to.
            request.add_unredirected_header("Authorization", f"Bearer {settings.token}")
        try:
            response = urllib.request.urlopen(request, timeout=settings.timeout_s)  # noqa: S310 (as above)
        except urllib.error.HTTPError as exc:
            exc.close()
            raise _http_status_error(url, exc.code) from None
        except (OSError, http.client.HTTPException) as exc:
            raise _TransientError(_reason(exc)) from None
        with response:
            if response.status == 206:
                start, total = _parse_content_range(response.headers.get("Content-Range"))
            else:
                length = response.headers.get("Content-Length")
                start, total = 0, int(length) if length else None

            def read(size: int) -> bytes:
                try:
                    # read1: what has arrived, so a stall loses nothing already received.
                    return bytes(response.read1(size))
                except (OSError, http.client.HTTPException) as exc:
                    raise _TransientError(_reason(exc)) from None

            yield _Body(start=start, total=total, read=read)

    return open_at


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    return str(reason or exc) or type(exc).__name__


def _http_status_error(url: str, status: int) -> Exception:
    if status == 416:
        return _RangeNotSatisfiableError()
    if status == 404:
        return BuildError(f"source not found: {url} (HTTP 404)")
    if status in (401, 403):
        return BuildError(
            f"access denied to {url} (HTTP {status}); gated or private repositories need HF_TOKEN"
        )
    if status in (408, 429) or status >= 500:
        return _TransientError(f"HTTP {status}")
    return BuildError(f"cannot download {url}: HTTP {status}")


def _s3_opener(client: Any, source: S3Source) -> _Opener:
    @contextmanager
    def open_at(offset: int) -> Iterator[_Body]:
        request = {"Bucket": source.bucket, "Key": source.key}
        if offset:
            request["Range"] = f"bytes={offset}-"
        try:
            response = client.get_object(**request)
        except ClientError as exc:
            raise _s3_read_error(source, exc) from None
        except NoCredentialsError as exc:
            raise BuildError(f"cannot read {source.uri}: {exc}") from None
        except BotoCoreError as exc:
            raise _TransientError(str(exc)) from None
        stream = response["Body"]
        try:
            if response.get("ContentRange"):
                start, total = _parse_content_range(response["ContentRange"])
            else:
                start, total = 0, int(response["ContentLength"])

            def read(size: int) -> bytes:
                try:
                    return bytes(stream.read(size))
                except (BotoCoreError, OSError) as exc:
                    raise _TransientError(str(exc)) from None

            yield _Body(start=start, total=total, read=read)
        finally:
            stream.close()

    return open_at


def _s3_read_error(source: S3Source, exc: ClientError) -> Exception:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
    if code == "InvalidRange" or status == 416:
        return _RangeNotSatisfiableError()
    if code in {"NoSuchKey", "NoSuchBucket", "404"}:
        return BuildError(f"source not found: {source.uri} ({code})")
    if code in {"AccessDenied", "403"} or status == 403:
        return BuildError(f"access denied to {source.uri} ({code})")
    if status >= 500:
        return _TransientError(f"{code} (HTTP {status})")
    return BuildError(f"cannot download {source.uri}: {code}: {exc}")
