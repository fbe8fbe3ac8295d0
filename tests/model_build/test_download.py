"""hf:// downloads against a real loopback HTTP server: resume, retry, refusal."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from model_build.errors import BuildError
from model_build.fetch import Fetched, HttpSettings, RetryPolicy, fetch
from model_build.sources import HfSource, parse_source
from tests.support.model_build import (
    REVISION,
    FileServer,
    closed_port_url,
    serve_files,
    sha256_hex,
)

DATA = os.urandom(300_000)
SHA = sha256_hex(DATA)
NO_WAIT = RetryPolicy(attempts=3, first_wait_s=0.0)


@pytest.fixture
def file_server() -> Iterator[FileServer]:
    with serve_files() as server:
        yield server


def _no_s3() -> Any:
    raise AssertionError("an hf:// fetch must not touch S3")


def _fetch(
    server: FileServer,
    work: Path,
    *,
    sha256: str = SHA,
    token: str | None = None,
    timeout_s: float = 5,
) -> Fetched:
    uri = server.add("org/repo", "model.gguf", DATA)
    source = parse_source(uri)
    assert isinstance(source, HfSource)
    return fetch(
        source,
        sha256,
        work_dir=work,
        http=HttpSettings(base_url=server.url, token=token, timeout_s=timeout_s),
        retry=NO_WAIT,
        s3_client=_no_s3,
    )


def test_plain_download_is_verified_and_placed_by_sha(
    file_server: FileServer, tmp_path: Path
) -> None:
    fetched = _fetch(file_server, tmp_path)
    assert fetched.sha256 == SHA
    assert fetched.size == len(DATA)
    assert fetched.path == tmp_path / "downloads" / SHA / "model.gguf"
    assert fetched.path.read_bytes() == DATA
    assert [r["path"] for r in file_server.requests] == [f"/org/repo/resolve/{REVISION}/model.gguf"]


def test_cut_connection_resumes_with_range(file_server: FileServer, tmp_path: Path) -> None:
    file_server.cut_first_response_at = 123_457
    fetched = _fetch(file_server, tmp_path)
    assert fetched.path.read_bytes() == DATA
    assert len(file_server.requests) == 2
    assert "Range" not in file_server.requests[0]
    assert file_server.requests[1]["Range"] == "bytes=123457-"


def test_stalled_connection_times_out_and_resumes(file_server: FileServer, tmp_path: Path) -> None:
    file_server.cut_first_response_at = 70_000
    file_server.stall_before_cut_s = 1.0
    fetched = _fetch(file_server, tmp_path, timeout_s=0.2)
    assert fetched.path.read_bytes() == DATA
    assert file_server.requests[1]["Range"] == "bytes=70000-"


def test_server_ignoring_range_restarts_from_zero(file_server: FileServer, tmp_path: Path) -> None:
    file_server.cut_first_response_at = 50_000
    file_server.honour_range = False
    fetched = _fetch(file_server, tmp_path)
    assert fetched.path.read_bytes() == DATA  # not the first 50 kB twice
    assert file_server.requests[1]["Range"] == "bytes=50000-"


def test_partial_file_from_an_earlier_run_is_resumed(
    file_server: FileServer, tmp_path: Path
) -> None:
    partial = tmp_path / "downloads" / SHA / "model.gguf.partial"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(DATA[:200_000])
    fetched = _fetch(file_server, tmp_path)
    assert fetched.path.read_bytes() == DATA
    assert [r.get("Range") for r in file_server.requests] == ["bytes=200000-"]
    assert not partial.exists()


def test_complete_partial_file_answered_with_416_is_downloaded_again(
    file_server: FileServer, tmp_path: Path
) -> None:
    partial = tmp_path / "downloads" / SHA / "model.gguf.partial"
    partial.parent.mkdir(parents=True)
    partial.write_bytes(DATA + b"junk")
    fetched = _fetch(file_server, tmp_path)
    assert fetched.path.read_bytes() == DATA
    assert [r.get("Range") for r in file_server.requests] == [f"bytes={len(DATA) + 4}-", None]


def test_verified_download_is_reused_without_a_request(
    file_server: FileServer, tmp_path: Path
) -> None:
    _fetch(file_server, tmp_path)
    _fetch(file_server, tmp_path)
    assert len(file_server.requests) == 1


def test_checksum_mismatch_names_both_hashes_and_keeps_nothing(
    file_server: FileServer, tmp_path: Path
) -> None:
    wrong = "0" * 64
    with pytest.raises(BuildError) as error:
        _fetch(file_server, tmp_path, sha256=wrong)
    assert str(error.value) == (f"sha256 mismatch for model.gguf: expected {wrong}, got {SHA}")
    assert list((tmp_path / "downloads" / wrong).iterdir()) == []


def test_404_is_not_retried(file_server: FileServer, tmp_path: Path) -> None:
    source = parse_source(f"hf://org/missing@{REVISION}/model.gguf")
    with pytest.raises(
        BuildError, match=r"^source not found: http://127\.0\.0\.1:\d+/org/missing/"
    ):
        fetch(
            source,
            SHA,
            work_dir=tmp_path,
            http=HttpSettings(base_url=file_server.url),
            retry=NO_WAIT,
            s3_client=_no_s3,
        )
    assert len(file_server.requests) == 1


def test_403_suggests_a_token(file_server: FileServer, tmp_path: Path) -> None:
    file_server.statuses = [403]
    with pytest.raises(BuildError, match=r"access denied .*HTTP 403.*HF_TOKEN"):
        _fetch(file_server, tmp_path)


def test_transient_errors_are_retried(file_server: FileServer, tmp_path: Path) -> None:
    file_server.statuses = [503, 429]
    assert _fetch(file_server, tmp_path).sha256 == SHA
    assert len(file_server.requests) == 3


def test_persistent_errors_give_up_after_the_attempts(
    file_server: FileServer, tmp_path: Path
) -> None:
    file_server.statuses = [503, 503, 503, 503]
    with pytest.raises(
        BuildError, match=r"cannot download .*HTTP 503 \(gave up after 3 attempts\)"
    ):
        _fetch(file_server, tmp_path)
    assert len(file_server.requests) == 3


def test_unreachable_source(tmp_path: Path) -> None:
    source = parse_source(f"hf://org/repo@{REVISION}/model.gguf")
    with pytest.raises(BuildError, match=r"cannot download .*refused.*gave up after 3 attempts"):
        fetch(
            source,
            SHA,
            work_dir=tmp_path,
            http=HttpSettings(base_url=closed_port_url()),
            retry=NO_WAIT,
            s3_client=_no_s3,
        )


def test_token_is_sent_as_bearer_and_never_logged(
    file_server: FileServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    file_server.cut_first_response_at = 1000  # also log a retry
    _fetch(file_server, tmp_path, token="hf_secret_token")
    assert [r["Authorization"] for r in file_server.requests] == ["Bearer hf_secret_token"] * 2
    assert "hf_secret_token" not in caplog.text
    assert "retrying from byte 1000" in caplog.text


def test_redirect_keeps_range_and_drops_the_token(file_server: FileServer, tmp_path: Path) -> None:
    """Hugging Face redirects to a CDN: the resume offset must follow, the token must not."""
    file_server.redirect_to_cdn = True
    file_server.cut_first_response_at = 100_000
    fetched = _fetch(file_server, tmp_path, token="hf_secret_token")
    assert fetched.path.read_bytes() == DATA
    resolve, cdn, resolve_again, cdn_again = file_server.requests
    assert resolve["Authorization"] == resolve_again["Authorization"] == "Bearer hf_secret_token"
    assert "Authorization" not in cdn
    assert "Authorization" not in cdn_again
    assert cdn["path"].startswith("/cdn/org/repo/resolve/")
    assert (resolve_again["Range"], cdn_again["Range"]) == ("bytes=100000-", "bytes=100000-")
