"""`serve` as SageMaker runs it: a real process, real port, real start-up errors; and the
README's main job end to end."""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.serving import REPO, decision

SERVE = str(Path(sys.executable).with_name("serve"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run_serve(env: dict[str, str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SERVE], env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout
    )


def test_invalid_setting_stops_with_one_line() -> None:
    result = run_serve({"SEMIF_MAX_IN_FLIGHT": "0"})
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "serve: SEMIF_MAX_IN_FLIGHT=0 is out of range; allowed 1..64"
    ]


def test_missing_model_stops_the_process(tmp_path: Path) -> None:
    result = run_serve(
        {
            "SEMIF_MODEL_DIR": str(tmp_path),
            "SEMIF_HOST": "127.0.0.1",
            "SEMIF_PORT": str(free_port()),
        }
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"serve: model load failed: ModelFilesError: expected exactly one *.gguf in {tmp_path} "
        "or one level below, found 0: none"
    )


def test_gpu_layers_without_gpu_backend_stops_the_process(tiny_model_dir: Path) -> None:
    result = run_serve(
        {
            "SEMIF_MODEL_DIR": str(tiny_model_dir),
            "SEMIF_N_GPU_LAYERS": "-1",
            "SEMIF_HOST": "127.0.0.1",
            "SEMIF_PORT": str(free_port()),
        }
    )
    assert result.returncode == 1
    assert "SEMIF_N_GPU_LAYERS=-1 asks for GPU offload but no GPU backend is loaded" in (
        result.stderr
    )


@pytest.fixture
def served_tiny(tiny_model_dir: Path) -> Iterator[int]:
    port = free_port()
    env = {
        **os.environ,
        "SEMIF_MODEL_DIR": str(tiny_model_dir),
        "SEMIF_HOST": "127.0.0.1",
        "SEMIF_PORT": "1",  # SageMaker's variable must win
        "SAGEMAKER_BIND_TO_PORT": str(port),
    }
    process = subprocess.Popen([SERVE], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                connection.request("GET", "/ping")
                if connection.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        process.wait(10)


def test_serve_answers_on_the_sagemaker_port_with_keep_alive(served_tiny: int) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", served_tiny, timeout=10)
    body = json.dumps({"decision": decision()})
    for _ in range(2):  # the same connection serves both requests (HTTP/1.1 keep-alive)
        connection.request(
            "POST", "/invocations", body=body, headers={"content-type": "application/json"}
        )
        response = connection.getresponse()
        payload = json.loads(response.read())
        assert response.status == 200
        assert payload["result"]["option_ids"] == ["account_access", "billing", "sales"]
    assert connection.sock is not None


@pytest.mark.slow
def test_readme_main_job_end_to_end(tmp_path: Path) -> None:
    """The README's first command: build the embedded artifact, serve it, answer examples."""
    model_dir = tmp_path / "opt-ml-model"
    result = subprocess.run(
        ["bash", "scripts/demo.sh", str(model_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(path.name for path in model_dir.iterdir()) == [
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "model-manifest.json",
    ]
    out = result.stdout
    assert "model SmolLM2-135M-Instruct.Q4_1.gguf ready on backends CPU" in out
    assert "decision.json: 1 decision(s)" in out
    assert "shared-decisions.json: 3 decision(s)" in out
    for decision_id in ("support-route", "queue", "priority", "refund"):
        assert f"  {decision_id} " in out
