"""Serving helpers: an in-process app that waits for its model, and decision bodies."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from starlette.testclient import TestClient

from adapter.app import create_app
from adapter.settings import Settings

REPO = Path(__file__).resolve().parents[2]
MODEL_CACHE = REPO / ".cache" / "models"
JSON_HEADERS = {"content-type": "application/json"}


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


def post_ok(client: TestClient, body: Any, path: str = "/invocations") -> Any:
    """POST a JSON body and return the JSON answer; the test fails unless it is a 200."""
    response = client.post(path, content=json.dumps(body), headers=JSON_HEADERS)
    assert response.status_code == 200, response.text
    return response.json()
