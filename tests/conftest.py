"""Shared fixtures: real llama.cpp models (a tiny generated GGUF, the embedded SmolLM2)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from adapter.app import create_app
from adapter.settings import Settings
from model_build.embedded import fetch_embedded_model
from model_build.tiny_gguf import write_tiny_gguf

REPO = Path(__file__).resolve().parent.parent
MODEL_CACHE = REPO / ".cache" / "models"


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


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


def wait_until_ready(client: TestClient, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = client.get("/ping")
        if response.status_code == 200:
            return
        if response.json().get("status") == "failed":
            raise AssertionError(f"model failed to load: {response.json()}")
        time.sleep(0.01)
    raise AssertionError("model did not become ready")


@contextmanager
def serving(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as client:
        wait_until_ready(client)
        yield client


@pytest.fixture
def tiny_client(tiny_model_dir: Path) -> Iterator[TestClient]:
    with serving(Settings(model_dir=tiny_model_dir, max_tokens=1024, threads=2)) as client:
        yield client


def decision(
    decision_id: str = "support-route",
    state: object = "Customer asks to reset a forgotten password; the reset email never arrived.",
    question: str = "Which queue should handle this request?",
    options: tuple[tuple[str, str], ...] = (
        ("account_access", "Account access and authentication support."),
        ("billing", "Billing and payment support."),
        ("sales", "Sales and product evaluation."),
    ),
) -> dict[str, object]:
    return {
        "id": decision_id,
        "state": state,
        "question": question,
        "options": [{"id": oid, "description": text} for oid, text in options],
    }
