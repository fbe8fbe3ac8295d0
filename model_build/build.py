"""One model build: pinned source -> verified GGUF -> manifest -> model.tar.gz -> destination.

Every step refuses rather than guesses: the source must hash to the expected sha256, be a
GGUF with a chat template (its own, or an operator's packed beside it), and be packed byte
for byte as validated (the packer re-hashes what it reads). Nothing reaches the destination
until the whole archive exists and is hashed, and no partial archive survives a failure.

A build key (sha256 over the source URI, the expected GGUF sha256, the builder's version
and code, the calibration and the operator's chat template) identifies a build's inputs. It
is stored with the S3 object, so running the same build again finds the object and skips
download, packing and upload.
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from model_build.archive import ArchiveDigest, write_archive
from model_build.calibration import Calibration
from model_build.errors import BuildError
from model_build.fetch import HttpSettings, RetryPolicy, ensure_free_space, fetch
from model_build.gguf_info import inspect_gguf
from model_build.manifest import (
    CHAT_TEMPLATE_NAME,
    MANIFEST_NAME,
    SCHEMA_VERSION,
    BuildInfo,
    ChatTemplateFile,
    GgufInfo,
    Manifest,
    SourceInfo,
    calibration_sha256,
)
from model_build.publish import (
    META_BUILD_KEY,
    META_GGUF_BYTES,
    META_GGUF_FILE,
    META_GGUF_SHA256,
    META_SHA256,
    Destination,
    LocalDestination,
    PublishedArchive,
    atomic_output,
    find_existing,
    upload,
)
from model_build.sources import Source, file_name

log = logging.getLogger(__name__)

# Room for tar headers and gzip framing on top of the members themselves.
_ARCHIVE_OVERHEAD_BYTES = 1 << 20


def builder_version() -> str:
    """The installed project version, recorded in every manifest."""
    try:
        return metadata.version("semif-decision-cdk")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def builder_fingerprint() -> str:
    """sha256 over this package's code: a changed builder is a new build, version or not."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).parent.glob("*.py")):
        data = path.read_bytes()
        digest.update(f"{path.name}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()


@dataclass(frozen=True)
class BuildRequest:
    """Everything one build needs; the CLI fills it from flags and environment variables."""

    source: Source
    sha256: str
    dest: Destination
    work_dir: Path
    built_at: datetime
    http: HttpSettings
    retry: RetryPolicy
    kms_key_id: str | None = None
    calibration: Calibration | None = None  # recorded as the manifest's `calibration`
    # An operator's chat template (the file's bytes, checked UTF-8 text): packed as
    # CHAT_TEMPLATE_NAME and recorded as the manifest's `chat_template`.
    chat_template: bytes | None = None
    part_bytes: int = 64 << 20

    @property
    def chat_template_file(self) -> ChatTemplateFile | None:
        """The manifest entry of the operator's chat template, when one is given."""
        if self.chat_template is None:
            return None
        digest = hashlib.sha256(self.chat_template).hexdigest()
        return ChatTemplateFile(CHAT_TEMPLATE_NAME, len(self.chat_template), digest)


@dataclass(frozen=True)
class BuildResult:
    """What the build produced (or found already in place); printed as the final JSON line."""

    archive: PublishedArchive
    source_uri: str
    build_key: str
    skipped: bool

    def to_json(self) -> str:
        document = {
            "uri": self.archive.uri,
            "skipped": self.skipped,
            "archive_bytes": self.archive.size,
            "archive_sha256": self.archive.sha256,
            "gguf_file": self.archive.gguf_file,
            "gguf_bytes": self.archive.gguf_bytes,
            "gguf_sha256": self.archive.gguf_sha256,
            "source_uri": self.source_uri,
            "build_key": self.build_key,
            "version_id": self.archive.version_id,
        }
        return json.dumps(document, sort_keys=True)


def build_key(request: BuildRequest) -> str:
    """sha256 of everything that determines the archive contents (apart from `built_at`)."""
    inputs = {
        "schema_version": SCHEMA_VERSION,
        "source": request.source.uri,
        "sha256": request.sha256,
        "builder_version": builder_version(),
        "builder_fingerprint": builder_fingerprint(),
        "calibration_sha256": None
        if request.calibration is None
        else calibration_sha256(request.calibration),
        "chat_template_sha256": None
        if request.chat_template_file is None
        else request.chat_template_file.sha256,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def run_build(request: BuildRequest, s3_client: Callable[[], Any]) -> BuildResult:
    """Run the build; `s3_client` is called only when S3 is involved."""
    key = build_key(request)
    if not isinstance(request.dest, LocalDestination):
        existing = find_existing(s3_client(), request.dest, key)
        if existing is not None:
            log.info(
                "%s already holds this build (build key %s, sha256 %s): upload skipped",
                existing.uri,
                key,
                existing.sha256,
            )
            return BuildResult(existing, request.source.uri, key, skipped=True)
    request.work_dir.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s", request.source.uri)
    fetched = fetch(
        request.source,
        request.sha256,
        work_dir=request.work_dir,
        http=request.http,
        retry=request.retry,
        s3_client=s3_client,
    )
    name = file_name(request.source)
    log.info("verified %s: %d bytes, sha256 %s", name, fetched.size, fetched.sha256)
    gguf = inspect_gguf(
        fetched.path,
        file=name,
        size=fetched.size,
        sha256=fetched.sha256,
        operator_template=request.chat_template is not None,
    )
    log.info(
        "GGUF %s: architecture %s, file type %s, context %s, vocabulary %d",
        name,
        gguf.architecture,
        gguf.file_type,
        gguf.context_length,
        gguf.vocab_size,
    )
    template = request.chat_template_file
    if template is not None:
        log.info(
            "operator chat template: %d bytes, sha256 %s, packed as %s",
            template.bytes,
            template.sha256,
            template.file,
        )
    with tempfile.TemporaryDirectory(dir=request.work_dir, prefix="pack-") as scratch:
        manifest_path = Path(scratch) / MANIFEST_NAME
        manifest_path.write_text(_manifest(request, gguf).to_json(), encoding="utf-8")
        members = [(name, fetched.path), (MANIFEST_NAME, manifest_path)]
        if request.chat_template is not None:
            # Packed from these bytes, the ones hashed into the manifest.
            template_path = Path(scratch) / CHAT_TEMPLATE_NAME
            template_path.write_bytes(request.chat_template)
            members.append((CHAT_TEMPLATE_NAME, template_path))
        if isinstance(request.dest, LocalDestination):
            digest = _pack(members, request.dest.path, name, fetched.sha256)
            version_id = None
        else:
            archive_path = Path(scratch).absolute() / "model.tar.gz"
            digest = _pack(members, archive_path, name, fetched.sha256)
            log.info("uploading to %s", request.dest.uri)
            version_id = upload(
                s3_client(),
                archive_path,
                request.dest,
                metadata={
                    META_SHA256: digest.sha256,
                    META_BUILD_KEY: key,
                    META_GGUF_FILE: name,
                    META_GGUF_BYTES: str(fetched.size),
                    META_GGUF_SHA256: fetched.sha256,
                },
                kms_key_id=request.kms_key_id,
                part_bytes=request.part_bytes,
            )
    archive = PublishedArchive(
        uri=request.dest.uri,
        size=digest.size,
        sha256=digest.sha256,
        gguf_file=name,
        gguf_bytes=fetched.size,
        gguf_sha256=fetched.sha256,
        version_id=version_id,
    )
    return BuildResult(archive, request.source.uri, key, skipped=False)


def _manifest(request: BuildRequest, gguf: GgufInfo) -> Manifest:
    source = request.source
    return Manifest(
        source=SourceInfo(uri=source.uri, revision=source.revision, file=source.file),
        gguf=gguf,
        build=BuildInfo(
            built_at=request.built_at.strftime("%Y-%m-%dT%H:%M:%SZ"),
            builder_version=builder_version(),
        ),
        calibration=request.calibration,
        chat_template=request.chat_template_file,
    )


def _pack(
    members: list[tuple[str, Path]], path: Path, gguf_name: str, gguf_sha256: str
) -> ArchiveDigest:
    """Write the archive to `path` atomically, proving the packed GGUF is the verified one."""
    needed = sum(member.stat().st_size for _, member in members) + _ARCHIVE_OVERHEAD_BYTES
    ensure_free_space(_existing_dir(path), needed, f"packing {path.name}")
    with atomic_output(path) as out:
        digest = write_archive(members, out)
        packed = digest.members[gguf_name]
        if packed != gguf_sha256:
            raise BuildError(
                f"sha256 mismatch for {gguf_name}: it changed while being packed "
                f"(verified {gguf_sha256}, packed {packed})"
            )
    log.info("packed %s: %d bytes, sha256 %s", path, digest.size, digest.sha256)
    return digest


def _existing_dir(path: Path) -> Path:
    """The nearest existing ancestor of absolute `path`, where free space can be measured."""
    return next(parent for parent in path.parents if parent.is_dir())
