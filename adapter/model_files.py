"""Find the one GGUF SageMaker unpacked and check it against model-manifest.json.

SageMaker unpacks model.tar.gz into /opt/ml/model. Serving the wrong file silently is the
worst failure a decision service can have, so discovery is strict (exactly one candidate)
and the manifest's size and sha256 are verified before the model is loaded. In SageMaker's
model directory the manifest is required (`require_manifest`): a GGUF nobody verified is
refused unless SEMIF_ALLOW_UNVERIFIED_MODEL=true says otherwise. An operator's chat template
the manifest lists (model-build --chat-template) is verified the same way and read here; a
template file the manifest does not list is never read.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adapter.template_text import TemplateText
from model_build.calibration import Calibration
from model_build.embedded import sha256_of
from model_build.manifest import (
    ChatTemplateFile,
    ChatTemplateFileError,
    Manifest,
    ManifestError,
    chat_template_text,
    load_manifest,
)

MANIFEST_NAME = "model-manifest.json"


class ModelFilesError(RuntimeError):
    """The model directory does not hold exactly one usable, verified GGUF."""


@dataclass(frozen=True)
class ModelFiles:
    """The GGUF to load and the identity reported with every response."""

    gguf: Path
    identity: dict[str, Any] = field(default_factory=dict)
    calibration: Calibration | None = None  # the manifest's, applied to option probabilities
    # The operator's chat template the manifest lists, verified (SEMIF_CHAT_TEMPLATE wins).
    chat_template: TemplateText | None = None
    # (size, mtime_ns) when verified: the load must read the very file that was checked.
    stamp: tuple[int, ...] = ()

    def check_unchanged(self) -> None:
        """Refuse a GGUF that changed on disk since it was verified (during the load)."""
        if file_stamp(self.gguf) != self.stamp:
            raise ModelFilesError(
                f"{self.gguf.name} changed on disk while it was being loaded; restart to "
                "verify and load the new file"
            )


def file_stamp(path: Path) -> tuple[int, ...]:
    """What changes when the file is rewritten or replaced: size, mtime, and inode, device
    and ctime, which a copy that preserves mtime (`cp -p`, `rsync -t`) still changes."""
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_dev, stat.st_ctime_ns


def discover_gguf(model_dir: Path) -> Path:
    """Return the single `*.gguf` in `model_dir` or one level below it."""
    if not model_dir.is_dir():
        raise ModelFilesError(f"model directory {model_dir} does not exist")
    found = sorted([*model_dir.glob("*.gguf"), *model_dir.glob("*/*.gguf")])
    found = [path for path in found if path.is_file()]
    if len(found) != 1:
        listing = ", ".join(str(path.relative_to(model_dir)) for path in found) or "none"
        raise ModelFilesError(
            f"expected exactly one *.gguf in {model_dir} or one level below, found "
            f"{len(found)}: {listing}"
        )
    return found[0]


def resolve_model_files(
    model_dir: Path, gguf_path: Path | None, *, require_manifest: bool = False
) -> ModelFiles:
    """Pick the GGUF (explicit path wins) and verify it against the manifest when present;
    with `require_manifest`, a GGUF without one is refused."""
    gguf = gguf_path if gguf_path is not None else discover_gguf(model_dir)
    stamp = file_stamp(gguf)
    manifest_path = gguf.parent / MANIFEST_NAME
    if not manifest_path.is_file():
        manifest_path = model_dir / MANIFEST_NAME
    if not manifest_path.is_file():
        if require_manifest:
            raise ModelFilesError(
                f"{gguf.name} has no {MANIFEST_NAME} beside it or in {model_dir}; SageMaker's "
                "model directory serves only models verified by model-build (set "
                "SEMIF_ALLOW_UNVERIFIED_MODEL=true to serve an unverified GGUF anyway)"
            )
        return ModelFiles(
            gguf=gguf,
            identity={"file": gguf.name, "bytes": stamp[0], "manifest": None},
            stamp=stamp,
        )
    manifest = _load(manifest_path)
    identity = verify_against_manifest(gguf, manifest_path, manifest)
    if file_stamp(gguf) != stamp:
        raise ModelFilesError(f"{gguf.name} changed on disk while its sha256 was checked")
    return ModelFiles(
        gguf=gguf,
        identity=identity,
        calibration=manifest.calibration,
        chat_template=None
        if manifest.chat_template is None
        else read_chat_template(manifest_path, manifest.chat_template),
        stamp=stamp,
    )


def _load(manifest_path: Path) -> Manifest:
    try:
        return load_manifest(manifest_path)
    except ManifestError as error:
        raise ModelFilesError(f"{manifest_path}: invalid manifest ({error})") from None


def verify_against_manifest(gguf: Path, manifest_path: Path, manifest: Manifest) -> dict[str, Any]:
    """Check name, size and sha256 against the manifest; return the identity to report."""
    expected = manifest.gguf
    if expected.file != gguf.name:
        raise ModelFilesError(
            f"{manifest_path}: gguf.file is {expected.file!r} but the model found is {gguf.name!r}"
        )
    actual_bytes = gguf.stat().st_size
    if actual_bytes != expected.bytes:
        raise ModelFilesError(
            f"{gguf.name}: size {actual_bytes} bytes does not match manifest {expected.bytes}"
        )
    actual_sha = sha256_of(gguf)
    if actual_sha != expected.sha256:
        raise ModelFilesError(
            f"{gguf.name}: sha256 {actual_sha} does not match manifest {expected.sha256}"
        )
    return {
        "file": gguf.name,
        "bytes": actual_bytes,
        "sha256": actual_sha,
        "source": manifest.source.uri,
        "revision": manifest.source.revision,
        "architecture": expected.architecture,
        "file_type": expected.file_type,
        "calibration": calibration_summary(manifest.calibration),
        "manifest": MANIFEST_NAME,
    }


def read_chat_template(manifest_path: Path, entry: ChatTemplateFile) -> TemplateText:
    """The packed chat template beside the manifest, refused unless its size and sha256 are
    the manifest's. Read once: the bytes checked are the text served."""
    path = manifest_path.parent / entry.file
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ModelFilesError(
            f"{manifest_path} lists chat template {entry.file}, which cannot be read "
            f"({error.strerror})"
        ) from None
    if len(data) != entry.bytes:
        raise ModelFilesError(
            f"{entry.file}: size {len(data)} bytes does not match manifest {entry.bytes}"
        )
    actual_sha = hashlib.sha256(data).hexdigest()
    if actual_sha != entry.sha256:
        raise ModelFilesError(
            f"{entry.file}: sha256 {actual_sha} does not match manifest {entry.sha256}"
        )
    try:
        text = chat_template_text(data)
    except ChatTemplateFileError as error:
        raise ModelFilesError(f"{entry.file} {error}") from None
    return TemplateText(text, "operator", f"{entry.file} (listed in {manifest_path.name})")


def calibration_summary(calibration: Calibration | None) -> dict[str, Any] | None:
    """What a response reports of the calibration: enough to tell which fit produced its
    probabilities (the priors, counts and fit metrics stay in the manifest)."""
    if calibration is None:
        return None
    return {
        "prompt_version": calibration.prompt_version,
        "option_order": calibration.option_order,
        "temperatures": dict(calibration.temperatures),
        "tasks_sha256": calibration.tasks_sha256,
        "likelihood": None
        if calibration.likelihood is None
        else {
            "prompt_version": calibration.likelihood.prompt_version,
            "temperatures": calibration.likelihood.temperatures,
        },
    }
