"""The DLC mirror build's program: copy each pinned DLC image into the mirror repository, byte
for byte, and give SageMaker a manifest it accepts for each image an endpoint serves.

Runs in CodeBuild (`DlcMirror`, standard library only, registry calls through `crane`):

    python3 cdk_constructs/dlc_mirror_build.py "$MIRROR_REPOSITORY_URI" "$MIRROR_IMAGES" \
        "$MIRROR_SERVED"

with the repository, the images ("<tag>=<repo>@sha256:<digest>" separated by spaces: what
is copied, under `<tag>`) and the served ones ("<tag>=sha256:<digest>": for each copied
image a SageMaker model serves, the digest the model names).

Why more than a copy: SageMaker's CreateModel accepts only a Docker image manifest v2
(`application/vnd.docker.distribution.manifest.v2+json`); it refuses OCI manifests and
image indexes ("Unsupported manifest media type application/vnd.oci.image.manifest.v1+json",
aws/amazon-sagemaker-feedback#180), and images built with buildx are often an OCI index
(one entry per platform plus attestations). So, per served image:

- a Docker v2 manifest pin is served as pinned (its digest is the served one);
- an index (OCI, or a Docker manifest list) is resolved to its one linux/amd64 image,
  whose digest the index's own bytes name, so the pin still decides what is served;
- that image, if an OCI manifest, is rewritten as a Docker v2 manifest with the same config
  and layer blobs (only media types change; gzip layers only, as Docker v2 has no zstd),
  which is deterministic, so the served digest is a pure function of the pin;
- anything else (schema 1, nested indexes, zstd layers, artifacts) is refused.

The served manifest is tagged `<tag>-sagemaker` unless it is the pin itself. The build then
fails unless the served digest is the one the stack names (`MIRROR_SERVED`), saying which
digest to pin (`DlcImages.cpu_served_digest`) when the pin is not a Docker v2 manifest.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
INDEXES = (DOCKER_MANIFEST_LIST, OCI_INDEX)
DOCKER_CONFIG = "application/vnd.docker.container.image.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
# OCI layer type -> its Docker v2 twin (same bytes). Docker v2 has no zstd or plain-tar type.
DOCKER_LAYERS = {
    "application/vnd.oci.image.layer.v1.tar+gzip": (
        "application/vnd.docker.image.rootfs.diff.tar.gzip"
    ),
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip": (
        "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip"
    ),
}
PLATFORM = {"os": "linux", "architecture": "amd64"}  # every SageMaker instance type we serve on
SERVED_SUFFIX = "-sagemaker"
# buildx marks the attestation entries of an index with this annotation.
REFERENCE_TYPE = "vnd.docker.reference.type"


class MirrorError(Exception):
    """The mirror cannot give SageMaker what the stack names; the message says why."""


class Registry(Protocol):
    """The registry calls the build makes (`Crane` in CodeBuild, a fake in the tests)."""

    def digest(self, ref: str) -> str | None:
        """The digest `ref` resolves to, None when it does not exist (or cannot be read)."""

    def manifest(self, ref: str) -> bytes: ...

    def config(self, ref: str) -> bytes:
        """The config blob of the image manifest `ref`."""

    def copy(self, source: str, target: str) -> None: ...

    def tag(self, ref: str, tag: str) -> None:
        """Add `tag` (a bare tag) to the manifest `ref`, in its repository."""

    def put_manifest(self, base: str, target: str, manifest: bytes) -> None:
        """Push `manifest` as `target`, a tag in `base`'s repository, which holds its blobs."""


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def media_type(document: Mapping[str, Any]) -> str:
    """The document's media type; OCI allows leaving it out, so then its shape decides."""
    declared = document.get("mediaType")
    if isinstance(declared, str):
        return declared
    if "manifests" in document:
        return OCI_INDEX
    if "config" in document and "layers" in document:
        return OCI_MANIFEST
    return "(no mediaType)"


def platform_image(index: Mapping[str, Any], where: str) -> str:
    """The digest of the one linux/amd64 image an index lists (attestations skipped)."""
    found = []
    for entry in index.get("manifests", []):
        platform = entry.get("platform") or {}
        attestation = (entry.get("annotations") or {}).get(REFERENCE_TYPE)
        if attestation is None and all(platform.get(k) == v for k, v in PLATFORM.items()):
            found.append(str(entry.get("digest")))
    if len(found) != 1:
        count = "no" if not found else f"{len(found)}"
        raise MirrorError(f"{where} is an image index with {count} linux/amd64 images, not one")
    return found[0]


def as_docker_v2(manifest: Mapping[str, Any], where: str) -> bytes:
    """The same image as a Docker v2 manifest: only media types change, so the config and
    layer blobs (and the image's content) are the ones the pin names. Deterministic bytes."""
    if media_type(manifest) != OCI_MANIFEST:
        raise MirrorError(
            f"{where} has media type {media_type(manifest)}: SageMaker serves only "
            f"{DOCKER_MANIFEST}, and only an {OCI_MANIFEST} can be converted to it"
        )
    if "artifactType" in manifest or "subject" in manifest:
        raise MirrorError(f"{where} is an OCI artifact (artifactType/subject), not an image")
    config = manifest["config"]
    if config.get("mediaType") != OCI_CONFIG:
        raise MirrorError(f"{where}: config media type {config.get('mediaType')} is not an image")
    layers = []
    for layer in manifest["layers"]:
        docker_type = DOCKER_LAYERS.get(layer.get("mediaType"))
        if docker_type is None:
            raise MirrorError(
                f"{where}: layer {layer.get('digest')} is {layer.get('mediaType')}; a Docker "
                f"v2 manifest holds only {sorted(DOCKER_LAYERS)} layers (gzip)"
            )
        urls = {"urls": layer["urls"]} if layer.get("urls") else {}
        layers.append(
            {"mediaType": docker_type, "size": layer["size"], "digest": layer["digest"], **urls}
        )
    converted = {
        "schemaVersion": 2,
        "mediaType": DOCKER_MANIFEST,
        "config": {"mediaType": DOCKER_CONFIG, "size": config["size"], "digest": config["digest"]},
        "layers": layers,
    }
    return json.dumps(converted, separators=(",", ":")).encode()


def _document(registry: Registry, ref: str, digest: str) -> tuple[bytes, dict[str, Any]]:
    """The manifest at `repo@digest`, checked against its digest (the pin, or what the
    pinned index names)."""
    raw = registry.manifest(ref)
    if sha256(raw) != digest:
        raise MirrorError(f"{ref} read back as {sha256(raw)}, not {digest}")
    document = json.loads(raw)
    if not isinstance(document, dict):
        raise MirrorError(f"{ref} is not a JSON object")
    return raw, document


@dataclass(frozen=True)
class Served:
    """What SageMaker can serve of one pinned image: its Docker v2 manifest (`manifest`, with
    digest `digest`) and the mirrored manifest it was derived from (`base`)."""

    digest: str
    manifest: bytes
    base: str
    base_is_served: bool  # the base's own bytes (a tag is enough) or a conversion


def servable(registry: Registry, repository: str, pin: str) -> Served:
    """Resolve the mirrored `repository@pin` to the Docker v2 linux/amd64 manifest SageMaker
    serves (module doc), checking each step against the digests the pin implies."""
    base = f"{repository}@{pin}"
    raw, document = _document(registry, base, pin)
    if media_type(document) in INDEXES:
        child = platform_image(document, base)
        base = f"{repository}@{child}"
        raw, document = _document(registry, base, child)
        if media_type(document) in INDEXES:
            raise MirrorError(f"{base} is an index inside an index; pin an image instead")
    as_is = media_type(document) == DOCKER_MANIFEST
    manifest = raw if as_is else as_docker_v2(document, base)
    config = json.loads(registry.config(base))
    platform = {key: config.get(key) for key in PLATFORM}
    if platform != PLATFORM:
        raise MirrorError(f"{base} is an image for {platform}, not {PLATFORM}")
    return Served(sha256(manifest), manifest, base, base_is_served=as_is)


def mirror(registry: Registry, repository: str, tag: str, source: str) -> str:
    """Copy `source` (`repo@sha256:...`) to `repository:tag` unless it is there already;
    the copy must keep the pinned digest. Returns the pin."""
    pin = source.rpartition("@")[2]
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", pin):
        raise MirrorError(f"{source} is not pinned by digest (repo@sha256:<64 hex>)")
    target = f"{repository}:{tag}"
    existing = registry.digest(target)
    if existing is None:
        registry.copy(source, target)
        existing = registry.digest(target)
        if existing != pin:
            raise MirrorError(f"the copy of {source} has digest {existing}, not the pin {pin}")
        print(f"{tag}: mirrored {source} as {repository}@{pin}")
    elif existing != pin:
        raise MirrorError(f"{target} holds {existing}, not {pin}")
    else:
        print(f"{tag}: already mirrored as {pin}")
    return pin


def serve(registry: Registry, repository: str, tag: str, pin: str, expected: str) -> str:
    """Put the Docker v2 form of the mirrored `pin` in the repository (tagged `<tag>-sagemaker`
    when it is not the pin itself) and check it is the `expected` digest the stack names."""
    served = servable(registry, repository, pin)
    target = f"{repository}:{tag}{SERVED_SUFFIX}"
    if served.digest != pin:
        present = registry.digest(target)
        if present is None:
            if served.base_is_served:
                registry.tag(served.base, tag + SERVED_SUFFIX)
            else:
                registry.put_manifest(served.base, target, served.manifest)
            present = registry.digest(target)
        if present != served.digest:
            raise MirrorError(f"{target} holds {present}, not {served.digest}")
    kind = media_type(json.loads(registry.manifest(f"{repository}@{served.digest}")))
    if kind != DOCKER_MANIFEST:
        raise MirrorError(f"{repository}@{served.digest} reads back as {kind}")
    if served.digest != expected:
        where = "the pin itself" if served.digest == pin else f"{target}, derived from {pin}"
        raise MirrorError(
            f"{tag}: the stack serves {expected}, but SageMaker can serve only {served.digest} "
            f"({where}, a Docker v2 linux/amd64 manifest). Set DlcImages(cpu_served_digest="
            f"{served.digest!r}) in stacks/environments.py"
            + (" (or None: the pin is served as it is)" if served.digest == pin else "")
        )
    print(f"{tag}: SageMaker serves {repository}@{served.digest} ({DOCKER_MANIFEST})")
    return served.digest


def pairs(text: str, what: str) -> list[tuple[str, str]]:
    """`a=b c=d` as [(a, b), (c, d)], else a MirrorError naming the variable."""
    found = []
    for item in text.split():
        key, separator, value = item.partition("=")
        if not separator or not key or not value:
            raise MirrorError(f"{what}: {item!r} is not '<tag>=<value>'")
        found.append((key, value))
    return found


class Crane:
    """`Registry` through the crane CLI, logged in to the mirror by the buildspec."""

    def _run(self, *args: str, stdin: bytes | None = None) -> bytes:
        done = subprocess.run(["crane", *args], input=stdin, capture_output=True, check=False)
        if done.returncode != 0:
            raise MirrorError(f"crane {' '.join(args)}: {done.stderr.decode().strip()}")
        return done.stdout

    def digest(self, ref: str) -> str | None:
        try:
            return self._run("digest", ref).decode().strip()
        except MirrorError:
            return None  # absent or unreadable: the copy that follows says which

    def manifest(self, ref: str) -> bytes:
        return self._run("manifest", ref)

    def config(self, ref: str) -> bytes:
        return self._run("config", ref)

    def copy(self, source: str, target: str) -> None:
        self._run("copy", source, target)

    def tag(self, ref: str, tag: str) -> None:
        self._run("tag", ref, tag)

    def put_manifest(self, base: str, target: str, manifest: bytes) -> None:
        self._run("edit", "manifest", base, "--tag", target, stdin=manifest)


def run(registry: Registry, repository: str, images: str, served: str = "") -> None:
    """Mirror every image (`images`: "<tag>=<repo>@<digest> ..."), then check what
    SageMaker will serve of each served one (`served`: "<tag>=<digest> ...")."""
    if not repository or not images.strip():
        raise MirrorError("give the mirror repository and at least one image")
    mirrored = dict(pairs(images, "MIRROR_IMAGES"))
    pins = {tag: mirror(registry, repository, tag, source) for tag, source in mirrored.items()}
    for tag, expected in pairs(served, "MIRROR_SERVED"):
        if tag not in pins:
            raise MirrorError(f"MIRROR_SERVED: {tag} is not one of the mirrored {sorted(pins)}")
        serve(registry, repository, tag, pins[tag], expected)


def main(argv: Sequence[str] | None = None) -> int:
    """The build step: `REPOSITORY_URI IMAGES [SERVED]`, as the buildspec passes the
    project's variables."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) not in (2, 3):
        print("usage: dlc_mirror_build.py REPOSITORY_URI IMAGES [SERVED]", file=sys.stderr)
        return 2
    try:
        run(Crane(), *args)
    except MirrorError as error:
        print(f"dlc mirror: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
