"""Source URI parsing: what is pinned is accepted, everything that could move is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_build.embedded import SMOLLM2
from model_build.errors import BuildError
from model_build.publish import LocalDestination, S3Destination, parse_destination
from model_build.sources import (
    PINNED_SHA256,
    PRODUCTION_MODEL,
    EmbeddedSource,
    HfSource,
    LocalSource,
    S3Source,
    file_name,
    parse_sha256,
    parse_source,
)

COMMIT = "4168f45a16a1290d65a4ec0fa312ae917a4c15d6"


def test_hf_source_with_a_subfolder() -> None:
    source = parse_source(f"hf://org/My.Repo-GGUF@{COMMIT}/quant/model-Q4_K_M.gguf")
    assert source == HfSource(
        repo="org/My.Repo-GGUF", revision=COMMIT, file="quant/model-Q4_K_M.gguf"
    )
    assert source.uri == f"hf://org/My.Repo-GGUF@{COMMIT}/quant/model-Q4_K_M.gguf"
    assert file_name(source) == "model-Q4_K_M.gguf"
    assert source.url("https://hf.example/") == (
        f"https://hf.example/org/My.Repo-GGUF/resolve/{COMMIT}/quant/model-Q4_K_M.gguf"
    )


def test_production_pin_parses() -> None:
    source = parse_source(PRODUCTION_MODEL.source_uri)
    assert isinstance(source, HfSource)
    assert (source.repo, source.revision) == ("bartowski/Qwen_Qwen3.5-4B-GGUF", COMMIT)
    assert parse_sha256(PRODUCTION_MODEL.sha256) == PRODUCTION_MODEL.sha256


def test_embedded_source_by_keyword_or_pypi_uri() -> None:
    source = parse_source("embedded")
    assert source == parse_source(SMOLLM2.source_uri) == EmbeddedSource()
    assert (source.uri, source.file, source.revision) == (SMOLLM2.source_uri, SMOLLM2.member, None)
    assert file_name(source) == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert PINNED_SHA256[source.uri] == SMOLLM2.sha256


def test_s3_and_local_sources(tmp_path: Path) -> None:
    assert parse_source("s3://my-bucket/models/m.gguf") == S3Source("my-bucket", "models/m.gguf")
    local = parse_source(str(tmp_path / "m.gguf"))
    assert local == LocalSource(
        path=tmp_path / "m.gguf", uri=(tmp_path / "m.gguf").as_uri(), file="m.gguf"
    )
    assert local.revision is None


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("hf://org/repo/m.gguf", "missing revision"),
        (f"hf://org/repo@{COMMIT[:12]}/m.gguf", "is not a full 40-hex commit"),
        (f"hf://org/repo@{COMMIT.upper()}/m.gguf", "is not a full 40-hex commit"),
        ("hf://org/repo@v1.0/m.gguf", "is not a full 40-hex commit"),
        (f"hf://org/repo@{COMMIT}/../m.gguf", "bad file path"),
        (f"hf://org/repo@{COMMIT}/", "expected hf://<org>/<repo>@<commit>/<file>.gguf"),
        (f"hf://-org/repo@{COMMIT}/m.gguf", "expected hf://"),
        (f"hf://org/repo@{COMMIT}/m.gguf.part", "must end in .gguf"),
        ("s3://Bad_Bucket/m.gguf", "expected s3://<bucket>/<key>.gguf"),
        ("https://huggingface.co/org/repo/resolve/main/m.gguf", "use hf://, s3:// or a local path"),
        ("pypi://other==1.0/m.gguf", "use hf://, s3:// or a local path"),
        ("model weights.gguf", "must end in .gguf and use only"),
    ],
)
def test_refused_sources(uri: str, message: str) -> None:
    with pytest.raises(BuildError, match=message):
        parse_source(uri)


def test_sha256_is_normalised_or_refused() -> None:
    assert parse_sha256(" " + "AB" * 32 + "\n") == "ab" * 32
    with pytest.raises(BuildError, match="expected 64 hex digits"):
        parse_sha256("ab" * 31)


def test_destinations(tmp_path: Path) -> None:
    assert parse_destination("s3://my-bucket/models/x/model.tar.gz") == S3Destination(
        "my-bucket", "models/x/model.tar.gz"
    )
    assert parse_destination(str(tmp_path / "model.tar.gz")) == LocalDestination(
        tmp_path / "model.tar.gz"
    )
    bad_destinations = (
        "s3://my-bucket/model.zip",
        "s3:///model.tar.gz",
        "s3://b/model.tar.gz",
        "gs://my-bucket/model.tar.gz",
        "out.tar",
    )
    for bad in bad_destinations:
        with pytest.raises(BuildError, match="bad destination"):
            parse_destination(bad)
