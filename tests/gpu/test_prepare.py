"""The GPU check's preparation (needs PyPI) and its measuring step on CPU (starts servers).

Preparation downloads the real sdist and wheels, so it is checked for real: a tarball that
fits the carry limit, holds what the build reads and nothing of tests, docs or web assets,
and a wheel for every requirement. pip's download cache makes a re-run take seconds.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tarfile
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

import pytest

from scripts.gpu.make_model import SHAPES, write_model
from scripts.gpu.prepare import MAX_TARBALL_BYTES, prepare, sha256_of

REPO = Path(__file__).resolve().parents[2]
NEEDED = (
    "CMakeLists.txt",
    "pyproject.toml",
    "llama_cpp/llama_cpp.py",
    "vendor/llama.cpp/CMakeLists.txt",
    "vendor/llama.cpp/include/llama.h",
    "vendor/llama.cpp/src/llama.cpp",
    "vendor/llama.cpp/common/CMakeLists.txt",
    "vendor/llama.cpp/ggml/CMakeLists.txt",
    "vendor/llama.cpp/ggml/src/ggml.c",
    "vendor/llama.cpp/ggml/src/ggml-cpu/CMakeLists.txt",
    "vendor/llama.cpp/ggml/src/ggml-cuda/CMakeLists.txt",
    "vendor/llama.cpp/ggml/src/ggml-cuda/ggml-cuda.cu",
)
UNWANTED_PARTS = {"tests", "docs", "examples", "tools", ".git", "public"}
UNWANTED_SUFFIXES = {".gguf", ".html", ".js", ".css", ".png", ".svg", ".ico", ".ipynb"}


def _index_reachable() -> bool:
    index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple/")
    parts = urlsplit(index)
    try:
        socket.create_connection((parts.hostname or "pypi.org", parts.port or 443), 5).close()
    except OSError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.skipif(not _index_reachable(), reason="preparation downloads from the package index")
def test_prepare_writes_a_trimmed_tarball_and_every_wheel(tmp_path: Path) -> None:
    prepared = prepare(tmp_path / "prep")
    manifest = prepared.manifest
    assert prepared.tarball.stat().st_size < MAX_TARBALL_BYTES
    assert manifest["tarball"]["sha256"] == sha256_of(prepared.tarball)
    on_disk = json.loads((prepared.folder / "prep.json").read_text(encoding="utf-8"))
    assert on_disk == manifest
    with tarfile.open(prepared.tarball) as tarball:
        names = tarball.getnames()
    top = {name.split("/", 1)[0] for name in names}
    assert top == {f"llama_cpp_python-{manifest['llama_cpp_python']}"}
    relative = {name.split("/", 1)[1] for name in names}
    assert set(NEEDED) <= relative
    for name in relative:
        path = PurePosixPath(name)
        assert not UNWANTED_PARTS & set(path.parts[:-1]), name
        assert not name.startswith("vendor/llama.cpp/models/"), name  # vocabulary GGUFs
        assert path.suffix not in UNWANTED_SUFFIXES, name
    wheel_names = {wheel.name.lower() for wheel in prepared.wheels}
    for requirement in manifest["requirements"]:
        name, version = requirement.split("==")
        prefix = f"{name.replace('-', '_').lower()}-{version}-"
        assert any(wheel.startswith(prefix) for wheel in wheel_names), requirement
    assert all(wheel.endswith("-none-any.whl") for wheel in wheel_names)


@pytest.mark.slow
def test_run_checks_on_cpu_writes_json_png_and_passes(tmp_path: Path) -> None:
    gguf = write_model(tmp_path / "small.gguf", SHAPES["small"])
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "scripts.gpu.run_checks", "--gguf", str(gguf),
        "--n-gpu-layers", "0", "--threads", "2", "--rounds", "1", "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "gpu-check.json").read_text(encoding="utf-8"))
    assert report["schema"] == "semif-gpu-check/1"
    assert [check["name"] for check in report["checks"]] == [
        "start", "labels", "engine_shared_state", "engine_prefix_reuse",
        "http_ping", "http_shared_state", "http_prefix_reuse",
    ]  # fmt: skip
    assert all(check["passed"] for check in report["checks"])
    assert {"adapter_overhead", "shared_state_speedup", "prefix_reuse"} <= report["figures"].keys()
    assert report["figures"]["adapter_overhead"]["goal"] == "<= 1.25"
    assert (out / "gpu-check-latency.png").stat().st_size > 0
    assert "engine_shared_state" in done.stdout
