"""Shared fixtures: real llama.cpp models (a tiny generated GGUF, the embedded SmolLM2).

Helpers the tests import live in tests/support/; nothing imports this file.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from adapter.settings import Settings
from model_build.embedded import fetch_embedded_model
from model_build.tiny_gguf import write_tiny_gguf, write_tiny_hybrid_gguf, write_tiny_swa_gguf
from tests.support.serving import MODEL_CACHE, serving


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_hybrid_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The production architecture in miniature: Qwen3.5 (`qwen35`), three recurrent layers
    then one attention layer, with the same tokenizer and chat template as `tiny_gguf`."""
    return write_tiny_hybrid_gguf(tmp_path_factory.mktemp("hybrid") / "tiny-qwen35.gguf")


@pytest.fixture(scope="session")
def tiny_swa_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Sliding-window memory in miniature: Gemma 3 (`gemma3`) with a window of 8 tokens on
    every second layer, with the same tokenizer and chat template as `tiny_gguf`."""
    return write_tiny_swa_gguf(tmp_path_factory.mktemp("swa") / "tiny-gemma3.gguf")


@pytest.fixture(params=["llama", "qwen35", "gemma3"])
def tiny_any_gguf(
    request: pytest.FixtureRequest, tiny_gguf: Path, tiny_hybrid_gguf: Path, tiny_swa_gguf: Path
) -> Path:
    """Every memory kind: plain attention (prefixes cut and copied), sliding-window
    attention and hybrid (whole streams, checkpoints); tests that take it run on each."""
    return {"llama": tiny_gguf, "qwen35": tiny_hybrid_gguf, "gemma3": tiny_swa_gguf}[request.param]


@pytest.fixture
def tiny_model_dir(tmp_path: Path, tiny_gguf: Path) -> Path:
    """A SageMaker-like /opt/ml/model directory holding only the tiny GGUF."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copy(tiny_gguf, model_dir / tiny_gguf.name)
    return model_dir


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The embedded model; scripts/setup.sh prefetches it, so this is normally a cache hit."""
    return fetch_embedded_model(MODEL_CACHE)


@pytest.fixture
def tiny_client(tiny_model_dir: Path) -> Iterator[TestClient]:
    with serving(Settings(model_dir=tiny_model_dir, max_tokens=1024, threads=2)) as client:
        yield client


@pytest.fixture(scope="module")
def tiny_module_client(
    tmp_path_factory: pytest.TempPathFactory, tiny_gguf: Path
) -> Iterator[TestClient]:
    """`tiny_client` kept for a whole test module (a module of read-only API checks)."""
    model_dir = tmp_path_factory.mktemp("model")
    shutil.copy(tiny_gguf, model_dir / tiny_gguf.name)
    with serving(Settings(model_dir=model_dir, max_tokens=1024, threads=2)) as client:
        yield client
