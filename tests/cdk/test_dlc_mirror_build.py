"""The DLC mirror build's program (cdk_constructs/dlc_mirror_build.py) against an in-memory
registry: what it copies, what it serves SageMaker for each manifest type, what it refuses."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from cdk_constructs.dlc_mirror_build import (
    DOCKER_CONFIG,
    DOCKER_MANIFEST,
    DOCKER_MANIFEST_LIST,
    OCI_CONFIG,
    OCI_INDEX,
    OCI_MANIFEST,
    Crane,
    MirrorError,
    as_docker_v2,
    main,
    media_type,
    run,
    sha256,
)

SOURCE = "public.ecr.aws/deep-learning-containers/llama-cpp"
MIRROR = "111122223333.dkr.ecr.us-east-1.amazonaws.com/semif-dev/llama-cpp-dlc"
OCI_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
DOCKER_LAYER = "application/vnd.docker.image.rootfs.diff.tar.gzip"


def _encode(document: dict[str, Any]) -> bytes:
    return json.dumps(document, indent=2).encode()


class FakeRegistry:
    """Manifests by (repository, digest), tags by (repository, tag), config blobs by digest;
    `copy` carries an index's children along, as crane does."""

    def __init__(self) -> None:
        self.manifests: dict[tuple[str, str], bytes] = {}
        self.tags: dict[tuple[str, str], str] = {}
        self.configs: dict[str, bytes] = {}
        self.calls: list[str] = []

    def add(self, repository: str, raw: bytes) -> str:
        digest = sha256(raw)
        self.manifests[(repository, digest)] = raw
        return digest

    def add_config(self, architecture: str) -> dict[str, Any]:
        raw = json.dumps({"architecture": architecture, "os": "linux", "config": {}}).encode()
        self.configs[sha256(raw)] = raw
        return {"size": len(raw), "digest": sha256(raw)}

    def _resolve(self, ref: str) -> tuple[str, str | None]:
        if "@" in ref:
            repository, digest = ref.split("@", 1)
            return repository, digest if (repository, digest) in self.manifests else None
        repository, tag = ref.rsplit(":", 1)
        return repository, self.tags.get((repository, tag))

    def digest(self, ref: str) -> str | None:
        return self._resolve(ref)[1]

    def manifest(self, ref: str) -> bytes:
        repository, digest = self._resolve(ref)
        assert digest is not None, ref
        return self.manifests[(repository, digest)]

    def config(self, ref: str) -> bytes:
        return self.configs[json.loads(self.manifest(ref))["config"]["digest"]]

    def copy(self, source: str, target: str) -> None:
        self.calls.append(f"copy {source} {target}")
        source_repository, digest = self._resolve(source)
        assert digest is not None, source
        repository, tag = target.rsplit(":", 1)
        raw = self.manifests[(source_repository, digest)]
        for child in json.loads(raw).get("manifests", []):
            key = (source_repository, child["digest"])
            self.manifests[(repository, child["digest"])] = self.manifests[key]
        self.manifests[(repository, digest)] = raw
        self.tags[(repository, tag)] = digest

    def tag(self, ref: str, tag: str) -> None:
        self.calls.append(f"tag {ref} {tag}")
        repository, digest = self._resolve(ref)
        assert digest is not None
        self.tags[(repository, tag)] = digest

    def put_manifest(self, base: str, target: str, manifest: bytes) -> None:
        self.calls.append(f"put {base} {target}")
        repository, tag = target.rsplit(":", 1)
        assert base.startswith(repository + "@"), "the blobs must be in the target repository"
        self.tags[(repository, tag)] = self.add(repository, manifest)


def _image(registry: FakeRegistry, kind: str, *, arch: str = "amd64", layer: str = "") -> bytes:
    config = registry.add_config(arch)
    layers = [
        {
            "mediaType": layer or (OCI_LAYER if kind == OCI_MANIFEST else DOCKER_LAYER),
            "size": 1234,
            "digest": "sha256:" + "a" * 64,
        }
    ]
    config_type = OCI_CONFIG if kind == OCI_MANIFEST else DOCKER_CONFIG
    return _encode(
        {
            "schemaVersion": 2,
            "mediaType": kind,
            "config": {"mediaType": config_type, **config},
            "layers": layers,
            "annotations": {"org.opencontainers.image.created": "2026-01-01"},
        }
    )


def _index(
    registry: FakeRegistry, kind: str, children: list[tuple[bytes, dict[str, Any]]]
) -> bytes:
    entries = []
    for raw, extra in children:
        digest = registry.add(SOURCE, raw)
        entries.append(
            {"mediaType": json.loads(raw)["mediaType"], "size": len(raw), "digest": digest, **extra}
        )
    return _encode({"schemaVersion": 2, "mediaType": kind, "manifests": entries})


AMD64 = {"platform": {"os": "linux", "architecture": "amd64"}}
ARM64 = {"platform": {"os": "linux", "architecture": "arm64"}}
ATTESTATION = {
    "platform": {"os": "unknown", "architecture": "unknown"},
    "annotations": {"vnd.docker.reference.type": "attestation-manifest"},
}


def _run(registry: FakeRegistry, pin_raw: bytes, served: str | None) -> str:
    """Mirror `pin_raw` (published at SOURCE) as tag `cpu-x`, serving it when `served` is
    given ('pin' names the pin's own digest); returns the pin."""
    pin = registry.add(SOURCE, pin_raw)
    serves = "" if served is None else f"cpu-x={pin if served == 'pin' else served}"
    run(registry, MIRROR, f"cpu-x={SOURCE}@{pin}", serves)
    return pin


def test_a_docker_v2_manifest_is_copied_and_served_as_pinned() -> None:
    registry = FakeRegistry()
    pin = _run(registry, _image(registry, DOCKER_MANIFEST), served="pin")
    assert registry.tags == {(MIRROR, "cpu-x"): pin}  # nothing converted, nothing re-tagged
    assert registry.calls == [f"copy {SOURCE}@{pin} {MIRROR}:cpu-x"]
    registry.calls.clear()
    _run(registry, registry.manifests[(SOURCE, pin)], served="pin")
    assert registry.calls == []  # a second deploy finds it mirrored


def test_a_docker_v2_pin_with_another_served_digest_is_refused() -> None:
    registry = FakeRegistry()
    with pytest.raises(MirrorError, match=r"can serve only sha256:.*the pin itself.*or None"):
        _run(registry, _image(registry, DOCKER_MANIFEST), served="sha256:" + "0" * 64)


def test_an_oci_index_is_served_as_its_amd64_image_converted_to_docker_v2() -> None:
    registry = FakeRegistry()
    amd64 = _image(registry, OCI_MANIFEST)
    arm64 = _image(registry, OCI_MANIFEST, arch="arm64")
    attestation = _encode(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "size": 2,
                "digest": "sha256:" + "e" * 64,
            },
            "layers": [],
        }
    )
    index = _index(
        registry, OCI_INDEX, [(amd64, AMD64), (arm64, ARM64), (attestation, ATTESTATION)]
    )
    converted = as_docker_v2(json.loads(amd64), "amd64")
    # Until the config pins it, the build fails and names the digest to pin.
    with pytest.raises(MirrorError, match=sha256(converted)) as refused:
        _run(registry, index, served="pin")
    assert "cpu_served_digest" in str(refused.value)
    pin = sha256(index)
    assert registry.tags[(MIRROR, "cpu-x")] == pin  # the index itself, byte for byte
    assert registry.tags[(MIRROR, "cpu-x-sagemaker")] == sha256(converted)
    served = json.loads(registry.manifests[(MIRROR, sha256(converted))])
    original = json.loads(amd64)
    assert served["mediaType"] == DOCKER_MANIFEST
    assert served["config"] == {
        "mediaType": DOCKER_CONFIG,
        **{k: original["config"][k] for k in ("size", "digest")},
    }
    assert [(layer["mediaType"], layer["digest"]) for layer in served["layers"]] == [
        (DOCKER_LAYER, original["layers"][0]["digest"])
    ]
    # With the digest pinned the same build succeeds, and pushes nothing again.
    registry.calls.clear()
    _run(registry, index, served=sha256(converted))
    assert registry.calls == []


def test_a_docker_manifest_list_is_served_as_its_amd64_manifest_untouched() -> None:
    registry = FakeRegistry()
    amd64 = _image(registry, DOCKER_MANIFEST)
    arm64 = _image(registry, DOCKER_MANIFEST, arch="arm64")
    manifest_list = _index(registry, DOCKER_MANIFEST_LIST, [(arm64, ARM64), (amd64, AMD64)])
    pin = _run(registry, manifest_list, served=sha256(amd64))
    assert registry.calls == [
        f"copy {SOURCE}@{pin} {MIRROR}:cpu-x",
        f"tag {MIRROR}@{sha256(amd64)} cpu-x-sagemaker",  # tagged, not rewritten
    ]


def test_an_oci_manifest_pin_is_converted() -> None:
    registry = FakeRegistry()
    image = _image(registry, OCI_MANIFEST)
    converted = as_docker_v2(json.loads(image), "image")
    pin = _run(registry, image, served=sha256(converted))
    assert registry.calls[-1] == f"put {MIRROR}@{pin} {MIRROR}:cpu-x-sagemaker"


def test_conversion_is_deterministic_and_infers_a_missing_media_type() -> None:
    registry = FakeRegistry()
    document = json.loads(_image(registry, OCI_MANIFEST))
    del document["mediaType"]  # optional in OCI
    assert media_type(document) == OCI_MANIFEST
    assert as_docker_v2(document, "a") == as_docker_v2(dict(document), "b")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda r: _image(r, OCI_MANIFEST, layer="application/vnd.oci.image.layer.v1.tar+zstd"),
            r"tar\+zstd; a Docker v2 manifest holds only",
        ),
        (lambda r: _image(r, DOCKER_MANIFEST, arch="arm64"), r"'arm64'.*not"),
        (
            lambda r: _index(r, OCI_INDEX, [(_image(r, OCI_MANIFEST, arch="arm64"), ARM64)]),
            "with no linux/amd64 images",
        ),
        (
            lambda r: _index(
                r,
                OCI_INDEX,
                [(_image(r, OCI_MANIFEST), AMD64), (_image(r, DOCKER_MANIFEST), AMD64)],
            ),
            "with 2 linux/amd64 images",
        ),
        (
            lambda r: _index(r, OCI_INDEX, [(_index(r, OCI_INDEX, []), AMD64)]),
            "index inside an index",
        ),
        (
            lambda r: _encode(
                {
                    "schemaVersion": 1,
                    "mediaType": "application/vnd.docker.distribution.manifest.v1+prettyjws",
                }
            ),
            "only an application/vnd.oci.image.manifest.v1",
        ),
    ],
    ids=["zstd-layer", "arm64-image", "no-amd64", "two-amd64", "nested-index", "schema1"],
)
def test_what_sagemaker_cannot_serve_fails_the_build(build: Any, message: str) -> None:
    registry = FakeRegistry()
    with pytest.raises(MirrorError, match=message):
        _run(registry, build(registry), served="pin")


def test_an_image_only_built_upon_is_copied_whatever_its_type() -> None:
    registry = FakeRegistry()
    index = _index(registry, OCI_INDEX, [(_image(registry, OCI_MANIFEST, arch="arm64"), ARM64)])
    pin = _run(registry, index, served=None)  # the CUDA base: no served form needed
    assert registry.tags == {(MIRROR, "cpu-x"): pin}


def test_a_tag_holding_another_digest_or_a_changed_copy_fails() -> None:
    registry = FakeRegistry()
    image = _image(registry, DOCKER_MANIFEST)
    registry.tags[(MIRROR, "cpu-x")] = "sha256:" + "9" * 64
    with pytest.raises(MirrorError, match="holds sha256:9"):
        _run(registry, image, served=None)

    class Rewriting(FakeRegistry):
        def copy(self, source: str, target: str) -> None:
            repository, tag = target.rsplit(":", 1)
            self.tags[(repository, tag)] = self.add(repository, b'{"changed": true}')

    rewriting = Rewriting()
    with pytest.raises(MirrorError, match="not the pin"):
        _run(rewriting, _image(rewriting, DOCKER_MANIFEST), served=None)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (("", "a=b"), "give the mirror repository and at least one image"),
        ((MIRROR, " "), "give the mirror repository"),
        ((MIRROR, "nonsense"), "not '<tag>=<value>'"),
        ((MIRROR, f"cpu-x={SOURCE}:latest"), "is not pinned by digest"),
    ],
)
def test_bad_build_inputs_are_named(arguments: tuple[str, str], message: str) -> None:
    with pytest.raises(MirrorError, match=message):
        run(FakeRegistry(), *arguments)


def test_served_tags_must_be_mirrored() -> None:
    registry = FakeRegistry()
    pin = registry.add(SOURCE, _image(registry, DOCKER_MANIFEST))
    with pytest.raises(MirrorError, match="cuda-y is not one of the mirrored"):
        run(registry, MIRROR, f"cpu-x={SOURCE}@{pin}", f"cuda-y={pin}")


def test_the_build_step_exits_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([MIRROR]) == 2
    assert main([MIRROR, "nonsense", ""]) == 1
    assert capsys.readouterr().err.endswith(
        "dlc mirror: MIRROR_IMAGES: 'nonsense' is not '<tag>=<value>'\n"
    )


def test_crane_pushes_the_converted_manifest_on_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[list[str], bytes | None]] = []

    def fake_run(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
        seen.append((args, kwargs.get("input")))
        missing = args[1] == "digest"
        return subprocess.CompletedProcess(args, 1 if missing else 0, b"", b"MANIFEST_UNKNOWN")

    monkeypatch.setattr(subprocess, "run", fake_run)
    crane = Crane()
    assert crane.digest(f"{MIRROR}:absent") is None  # absent: the copy that follows says why
    crane.put_manifest(f"{MIRROR}@sha256:{'1' * 64}", f"{MIRROR}:t", b"{}")
    assert seen[-1] == (
        ["crane", "edit", "manifest", f"{MIRROR}@sha256:{'1' * 64}", "--tag", f"{MIRROR}:t"],
        b"{}",
    )
