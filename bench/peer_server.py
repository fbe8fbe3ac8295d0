"""llama.cpp's own `llama-server`, built from the exact sources the adapter runs on.

The peer a user would otherwise deploy is llama.cpp's C++ server with continuous batching.
To compare engines and not versions, it is built from the llama.cpp tree vendored in the
llama-cpp-python sdist pinned in requirements/runtime.txt: the sdist comes through pip (the
package index the project already uses), its sha256 must be one the lock pins, and only the
server target is compiled, with no network at build time (no curl, no OpenSSL, no web UI
download). The binary is statically linked and cached under `.cache/bench/llama-server/`,
keyed by version and backend, so only the first run pays for the build (minutes on a
2-core machine).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath

from model_build.embedded import sha256_of

SDIST = "llama-cpp-python"
LOCK = Path(__file__).resolve().parents[1] / "requirements" / "runtime.txt"
DEFAULT_CACHE = Path(".cache/bench/llama-server")
_VENDORED = PurePosixPath("vendor/llama.cpp")
# Everything off that would reach the network or build more than the server.
_CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary in the cache
    "-DGGML_NATIVE=ON",  # as the binding builds: tuned to this machine's CPU
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else the build downloads the web UI
    "-DLLAMA_OPENSSL=OFF",  # loopback HTTP only
)
_CUDA_FLAGS = ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=native")


class PeerBuildError(RuntimeError):
    """The sdist could not be fetched or verified, or the server did not build."""


@dataclass(frozen=True)
class Pin:
    """A requirement as the hashed lock pins it."""

    version: str
    sha256: frozenset[str]


def locked_pin(lock_text: str, name: str = SDIST) -> Pin:
    """The version and allowed hashes of `name` in a pip-compile lock with hashes."""
    match = re.search(
        rf"^{re.escape(name)}==(\S+)((?:\s*\\\n\s+--hash=sha256:[0-9a-f]{{64}})+)", lock_text, re.M
    )
    if match is None:
        raise PeerBuildError(f"{name} is not pinned with hashes in the lock")
    return Pin(match[1], frozenset(re.findall(r"sha256:([0-9a-f]{64})", match[2])))


@dataclass(frozen=True)
class PeerBinary:
    """A built llama-server and how it was built (`build.json` next to it)."""

    path: Path
    info: dict[str, object]


def _cache_folder(cache: Path, pin: Pin, cuda: bool) -> Path:
    return cache / f"{pin.version}-{'cuda' if cuda else 'cpu'}"


def cached_llama_server(cache: Path = DEFAULT_CACHE, *, cuda: bool = False) -> PeerBinary | None:
    """The llama-server already built for the pinned version, if any (nothing is built)."""
    folder = _cache_folder(cache, locked_pin(LOCK.read_text(encoding="utf-8")), cuda)
    binary, info_path = folder / "llama-server", folder / "build.json"
    if binary.is_file() and info_path.is_file():
        return PeerBinary(binary, json.loads(info_path.read_text(encoding="utf-8")))
    return None


def llama_server(cache: Path = DEFAULT_CACHE, *, cuda: bool = False) -> PeerBinary:
    """The cached llama-server for the pinned version, building it first if absent."""
    cached = cached_llama_server(cache, cuda=cuda)
    if cached is not None:
        return cached
    pin = locked_pin(LOCK.read_text(encoding="utf-8"))
    folder = _cache_folder(cache, pin, cuda)
    binary, info_path = folder / "llama-server", folder / "build.json"
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="llama-server-") as scratch:
        work = Path(scratch)
        sdist, sdist_sha256 = download_sdist(pin, work)
        source = extract_vendored(sdist, work / "src")
        flags = [*_CMAKE_FLAGS, *(_CUDA_FLAGS if cuda else ())]
        build = work / "build"
        _run(["cmake", "-S", str(source), "-B", str(build), *flags], work)
        jobs = str(os.cpu_count() or 1)
        _run(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], work)
        built = build / "bin" / "llama-server"
        if not built.is_file():
            raise PeerBuildError(f"the build finished but {built} does not exist")
        shutil.copy2(built, binary.with_suffix(".partial"))
        binary.with_suffix(".partial").rename(binary)  # a half-copied binary is never cached
    info: dict[str, object] = {
        "llama_cpp_python": pin.version,
        "sdist_sha256": sdist_sha256,
        "cmake_flags": flags,
        "build_seconds": time.perf_counter() - started,
        "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    info_path.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return PeerBinary(binary, info)


def download_sdist(pin: Pin, folder: Path) -> tuple[Path, str]:
    """The pinned sdist through pip and its sha256, refused unless the lock allows it."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
               "--no-binary", ":all:", "-d", str(folder), f"{SDIST}=={pin.version}"]  # fmt: skip
    _run(command, folder)
    sdist = folder / f"{SDIST.replace('-', '_')}-{pin.version}.tar.gz"
    if not sdist.is_file():
        raise PeerBuildError(f"pip saved no {sdist.name} in {folder}")
    digest = sha256_of(sdist)
    if digest not in pin.sha256:
        raise PeerBuildError(f"{sdist.name} has sha256 {digest}, which the lock does not pin")
    return sdist, digest


def extract_vendored(sdist: Path, target: Path) -> Path:
    """Unpack only `vendor/llama.cpp` of the sdist (the tarball's data filter refuses links
    and paths that leave `target`); returns the llama.cpp source folder."""
    with tarfile.open(sdist, "r:gz") as archive:
        members = [
            member
            for member in archive.getmembers()
            if PurePosixPath(member.name).parts[1:3] == _VENDORED.parts
        ]
        if not members:
            raise PeerBuildError(f"{sdist.name} holds no {_VENDORED}")
        archive.extractall(target, members=members, filter="data")
    top = PurePosixPath(members[0].name).parts[0]
    return target / top / _VENDORED


def _run(command: list[str], cwd: Path) -> None:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-3000:]
        raise PeerBuildError(f"{' '.join(command[:4])} ... failed ({done.returncode}):\n{tail}")
