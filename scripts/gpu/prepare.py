"""Prepare what a GPU machine without network needs: a trimmed source tarball and wheels.

The llama-cpp-python sdist is 77 MB, mostly vocabulary GGUFs, docs and other backends'
sources; only the working tree and one prepared folder travel to a GPU machine (64 MiB in
all), so the tarball keeps only what the library build reads: the binding's package, its
CMakeLists, and llama.cpp's CMake files, headers, library sources, `common/` (the binding
forces LLAMA_BUILD_COMMON on), `vendor/` (added unconditionally) and the CPU and CUDA
backends. The wheels are the pure-Python packages the adapter, the build backend and the
benchmarks import that such a machine lacks or has in another version; they are taken at
the versions installed in the running environment (the project's .venv, installed from
requirements.txt), so the GPU run uses what CI tests. Binary packages (numpy, MarkupSafe,
PyYAML, matplotlib) are already on that machine and are not carried.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

SCHEMA = "semif-gpu-prep/1"
SDIST_NAME = "llama-cpp-python"
TARGET_PYTHON = "3.12"  # the GPU machine's python3
MAX_TARBALL_BYTES = 60 * 2**20
# The build backend is not in the .venv (pip builds the binding in an isolated env there).
BUILD_WHEELS = ("scikit-build-core==1.1.2",)
# What `adapter`, `bench` and the binding import at run time, with their own requirements.
RUNTIME_DISTRIBUTIONS = (
    "starlette", "anyio", "idna", "uvicorn", "click", "h11", "jinja2", "typing-extensions",
    "httpx", "httpcore", "certifi", "gguf", "diskcache",
)  # fmt: skip
_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")

# Paths inside the sdist (below its top folder) that the library build needs.
_TOP_FILES = {"CMakeLists.txt", "pyproject.toml", "PKG-INFO", "README.md", "LICENSE.md"}
_TOP_DIRS = ("llama_cpp",)
_LLAMA = ("vendor", "llama.cpp")
_LLAMA_FILES = {"CMakeLists.txt", "LICENSE"}
_LLAMA_DIRS = {"cmake", "include", "src", "common", "vendor", "licenses", "ggml"}
_GGML_BACKENDS = {"ggml-cpu", "ggml-cuda"}


class PrepareError(RuntimeError):
    """A download failed or the result would not fit or build on the GPU machine."""


def keep(relative: PurePosixPath) -> bool:
    """Whether a path below the sdist's top folder belongs in the trimmed tarball."""
    parts = relative.parts
    if "__pycache__" in parts:
        return False
    if len(parts) == 1:
        return parts[0] in _TOP_FILES
    if parts[0] in _TOP_DIRS:
        return True
    if parts[:2] != _LLAMA or len(parts) < 3:
        return False
    if len(parts) == 3:
        return parts[2] in _LLAMA_FILES
    if parts[2] not in _LLAMA_DIRS:
        return False
    in_backend_dir = parts[2:4] == ("ggml", "src") and len(parts) > 5
    return not in_backend_dir or parts[4] in _GGML_BACKENDS


def trim_sdist(sdist: Path, out: Path) -> int:
    """Write the kept files of `sdist` to `out` (same top folder); returns their count.
    Folders are not written: unpacking creates them, and none is kept empty."""
    kept = 0
    with tarfile.open(sdist, "r:gz") as source, tarfile.open(out, "w:gz") as target:
        for member in source:
            _, _, relative = member.name.partition("/")
            if member.isfile() and relative and keep(PurePosixPath(relative)):
                target.addfile(member, source.extractfile(member))
                kept += 1
    return kept


def pinned_version(distribution: str) -> str:
    """The version installed here; prepare runs in the project's environment on purpose."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise PrepareError(
            f"{distribution} is not installed in {sys.executable}; run prepare with the "
            "project's .venv (scripts/setup.sh installs it)"
        ) from None


def _pip(*args: str) -> None:
    command = [sys.executable, "-m", "pip", *args]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise PrepareError(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr}")


def download_sdist(version: str, folder: Path) -> Path:
    _pip("download", "--quiet", "--no-deps", "--no-binary", ":all:", "-d", str(folder),
         f"{SDIST_NAME}=={version}")  # fmt: skip
    found = sorted(folder.glob(f"{SDIST_NAME.replace('-', '_')}-{version}.tar.gz"))
    if len(found) != 1:
        raise PrepareError(f"pip saved no {SDIST_NAME} {version} sdist in {folder}")
    return found[0]


def download_wheels(requirements: list[str], folder: Path) -> list[Path]:
    """Pure-Python wheels only: they install on the GPU machine's 3.12 and here alike."""
    platforms = [flag for platform in _PLATFORMS for flag in ("--platform", platform)]
    _pip("download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--python-version", TARGET_PYTHON, "--implementation", "cp", *platforms,
         "-d", str(folder), *requirements)  # fmt: skip
    wheels = sorted(folder.glob("*.whl"))
    binary = [wheel.name for wheel in wheels if not wheel.name.endswith("-none-any.whl")]
    if binary:
        raise PrepareError(f"not pure-Python, would not install everywhere: {binary}")
    if len(wheels) != len(requirements):
        raise PrepareError(f"asked for {len(requirements)} wheels, {folder} holds {len(wheels)}")
    return wheels


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class Prepared:
    """Where prepare put things; `manifest` is also written to `folder/prep.json`."""

    folder: Path
    tarball: Path
    wheels: list[Path]
    manifest: dict[str, Any]


def prepare(folder: Path) -> Prepared:
    """Fill `folder` with the trimmed tarball, `wheels/` and `prep.json`, replacing both."""
    version = pinned_version(SDIST_NAME)
    folder.mkdir(parents=True, exist_ok=True)
    wheel_dir = folder / "wheels"
    for old in [*folder.glob("*.tar.gz"), *wheel_dir.glob("*.whl")]:
        old.unlink()
    tarball = folder / f"{SDIST_NAME.replace('-', '_')}-{version}-trimmed.tar.gz"
    with tempfile.TemporaryDirectory() as scratch:
        sdist = download_sdist(version, Path(scratch))
        members = trim_sdist(sdist, tarball)
        sdist_bytes = sdist.stat().st_size
    if tarball.stat().st_size > MAX_TARBALL_BYTES:
        raise PrepareError(f"{tarball} is {tarball.stat().st_size} bytes, over 60 MiB")
    runtime = [f"{name}=={pinned_version(name)}" for name in RUNTIME_DISTRIBUTIONS]
    wheel_dir.mkdir(exist_ok=True)
    wheels = download_wheels([*runtime, *BUILD_WHEELS], wheel_dir)
    manifest = {
        "schema": SCHEMA,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "llama_cpp_python": version,
        "target_python": TARGET_PYTHON,
        "sdist_bytes": sdist_bytes,
        "tarball": {
            "file": tarball.name,
            "bytes": tarball.stat().st_size,
            "sha256": sha256_of(tarball),
            "files": members,
        },
        "wheels": [{"file": wheel.name, "bytes": wheel.stat().st_size} for wheel in wheels],
        "requirements": [*runtime, *BUILD_WHEELS],
    }
    (folder / "prep.json").write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return Prepared(folder=folder, tarball=tarball, wheels=wheels, manifest=manifest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, nargs="?", default=Path(".gpu-prep"))
    args = parser.parse_args()
    try:
        prepared = prepare(args.folder)
    except PrepareError as error:
        sys.exit(f"prepare: {error}")
    total = sum(path.stat().st_size for path in prepared.folder.rglob("*") if path.is_file())
    tarball = prepared.manifest["tarball"]
    print(f"{prepared.tarball}: {tarball['bytes'] / 2**20:.1f} MiB, {tarball['files']} files")
    print(f"{prepared.folder / 'wheels'}: {len(prepared.wheels)} wheels, "
          f"{sum(w['bytes'] for w in prepared.manifest['wheels']) / 2**20:.1f} MiB")  # fmt: skip
    print(f"{prepared.folder}: {total / 2**20:.1f} MiB in all (carry it: `carry` names it)")


if __name__ == "__main__":
    main()
