"""`serve` as SageMaker runs it: a real process, real port, real start-up errors; and the
README's main job end to end."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from adapter.serve import HeadDeadlineProtocol, bind
from adapter.settings import Settings
from tests.support.live_server import live_server
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
    result = run_serve({"SEMIF_MAX_QUEUE": "0"})
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "serve: SEMIF_MAX_QUEUE=0 is out of range; allowed 1..4096"
    ]


def test_the_retired_max_in_flight_setting_stops_with_one_line() -> None:
    """SEMIF_MAX_IN_FLIGHT would silently do nothing under batching: it is a start error."""
    result = run_serve({"SEMIF_MAX_IN_FLIGHT": "1"})
    assert result.returncode != 0
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("serve: SEMIF_MAX_IN_FLIGHT is no longer read: ")
    assert "SEMIF_MAX_QUEUE" in line
    assert "SEMIF_MAX_BATCH_REQUESTS" in line


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


def wait_for_ping(port: int, timeout_s: float = 30) -> None:
    """Poll a started `serve` until /ping answers 200 (the tests then see any failure)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            connection.request("GET", "/ping")
            if connection.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.05)


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
        wait_for_ping(port)
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


def test_connections_on_the_served_socket_send_without_nagle_delay() -> None:
    """uvicorn accepts on `bind`'s socket through asyncio, which disables Nagle only where the
    socket names TCP; with Nagle on, each answer's body waits for the client's delayed ACK."""

    async def accept_one() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def connected(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        listening = bind(Settings(host="127.0.0.1", port=0))
        server = await asyncio.start_server(connected, sock=listening)
        async with server:
            _, writer = await asyncio.open_connection(*listening.getsockname())
            nodelay = await asyncio.wait_for(accepted, 10)
            writer.close()
            return nodelay

    assert asyncio.run(accept_one()) != 0


def test_a_request_head_must_arrive_in_time_from_its_first_byte(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection trickling header lines is closed once its head is late (slowloris); an
    idle connection waits for its first byte like a kept-alive one, then is served."""
    monkeypatch.setattr(HeadDeadlineProtocol, "head_timeout_seconds", 0.5)

    async def ping(request: Request) -> Response:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/ping", ping)])
    with live_server(app) as url:
        address = url.removeprefix("http://").split(":")
        host, port = address[0], int(address[1])
        with (
            socket.create_connection((host, port)) as idle,
            socket.create_connection((host, port)) as trickle,
        ):
            trickle.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n")
            started = time.monotonic()
            closed = False
            for index in range(30):  # one header line every 0.1 s: the head never ends
                time.sleep(0.1)
                try:
                    trickle.sendall(b"X-Line-%d: y\r\n" % index)
                except OSError:
                    closed = True
                    break
            if not closed:
                trickle.settimeout(5)
                closed = trickle.recv(1) == b""
            assert closed
            assert time.monotonic() - started < 2.5
            # The idle one waited longer than a head may take, then sends a whole request.
            idle.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
            idle.settimeout(5)
            assert idle.recv(1024).startswith(b"HTTP/1.1 200")


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
    assert "tickets.jsonl (offline batch, semif batch local): 13 lines answered: no errors" in out
    answers = (REPO / ".models" / "tickets-answers.jsonl").read_text().splitlines()
    assert [json.loads(line)["line"] for line in answers] == list(range(13))


# Imported by every Python process on its path: kills `serve` by signal at start, as a
# native crash in the model load or the first decode would.
_KILL_SERVE_HOOK = """import os, signal, sys
if os.path.basename(sys.argv[0]) == "serve":
    os.kill(os.getpid(), signal.SIGSEGV)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("setting", "cause", "log_line"),
    [
        (None, "serve exited: signal 11 (SIGSEGV)", None),
        (
            "amx",  # passes the shell; the server refuses it
            "serve exited: status 1",
            "serve: SEMIF_WEIGHT_BUFFERS='amx' is not allowed; allowed auto, plain, all",
        ),
    ],
    ids=["signal", "start-error"],
)
def test_the_demo_fails_fast_with_the_cause_when_the_server_dies(
    tmp_path: Path, setting: str | None, cause: str, log_line: str | None
) -> None:
    """The demo waits up to 120 s for /ping; a dead server must end it at once (the
    subprocess timeout is below that wait), saying how it died and showing the log."""
    env = dict(os.environ)
    if setting is None:
        (tmp_path / "sitecustomize.py").write_text(_KILL_SERVE_HOOK)
        env["PYTHONPATH"] = str(tmp_path)
    else:
        env["SEMIF_WEIGHT_BUFFERS"] = setting
    result = subprocess.run(
        ["bash", "scripts/demo.sh", str(tmp_path / "opt-ml-model")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert result.returncode == 1
    assert f"{cause}; server log (.models/serve.log):" in result.stderr
    if log_line is not None:
        assert log_line in result.stderr.splitlines()
    assert "ready on backends" not in result.stdout


# -- issue 10: start errors, keep-alive after bad input, body timeout, bounded shutdown ----


def test_lib_path_without_libllama_stops_with_one_line(tmp_path: Path) -> None:
    result = run_serve({"LLAMA_CPP_LIB_PATH": str(tmp_path)})
    assert result.returncode != 0
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"serve: LLAMA_CPP_LIB_PATH={tmp_path} holds no libllama.so")


def test_a_libllama_that_cannot_load_stops_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "libllama.so").write_bytes(b"not a shared library")
    result = run_serve({"LLAMA_CPP_LIB_PATH": str(tmp_path)})
    assert result.returncode != 0
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"serve: cannot load llama.cpp (LLAMA_CPP_LIB_PATH={tmp_path})")


def test_blank_api_key_stops_with_one_line() -> None:
    result = run_serve({"SEMIF_API_KEY": "  "})
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        "serve: SEMIF_API_KEY is set but blank; give a key, or unset it to run without one"
    ]


def test_port_in_use_stops_before_the_model_loads(tiny_model_dir: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        result = run_serve(
            {"SEMIF_MODEL_DIR": str(tiny_model_dir), "SEMIF_PORT": str(port)}, timeout=20
        )
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [
        f"serve: cannot listen on 127.0.0.1:{port} (SEMIF_HOST/SAGEMAKER_BIND_TO_PORT/"
        "SEMIF_PORT): Address already in use"
    ]
    assert "model ready" not in result.stdout


@pytest.fixture
def served(tiny_model_dir: Path) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    port = free_port()
    env = {
        **os.environ,
        "SEMIF_MODEL_DIR": str(tiny_model_dir),
        "SEMIF_PORT": str(port),
        "SEMIF_BODY_TIMEOUT_S": "1",
        "SEMIF_SHUTDOWN_GRACE_S": "2",
    }
    process = subprocess.Popen([SERVE], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for_ping(port)
        yield port, process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def test_bad_unicode_keeps_the_connection_and_logs_one_line(
    served: tuple[int, subprocess.Popen[bytes]],
) -> None:
    port, process = served
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"content-type": "application/json"}
    connection.request("POST", "/invocations", body=b'{"decision":{"\\ud800":1}}', headers=headers)
    bad = connection.getresponse()
    assert (bad.status, json.loads(bad.read())["field"]) == (400, 'decision["\\ud800"]')
    connection.request(
        "POST", "/invocations", body=json.dumps({"decision": decision()}), headers=headers
    )
    good = connection.getresponse()
    assert good.status == 200
    good.read()
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=15)
    statuses = [
        json.loads(line.split("adapter.requests ", 1)[1])["status"]
        for line in out.decode().splitlines()
        if "adapter.requests " in line
    ]
    assert statuses == [400, 200]
    assert "Traceback" not in out.decode()


def test_short_body_times_out_and_sigterm_exits_within_the_bound(
    served: tuple[int, subprocess.Popen[bytes]],
) -> None:
    port, process = served
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /invocations HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 100\r\n\r\n{"decision":'
        )
        started = time.monotonic()
        answer = sock.recv(65536).decode()
        waited = time.monotonic() - started
    assert answer.startswith("HTTP/1.1 408 ")
    assert waited < 5
    idle = socket.create_connection(("127.0.0.1", port), timeout=10)  # an idle keep-alive
    try:
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        # uvicorn re-raises the signal once it has shut down: "terminated by SIGTERM".
        assert process.wait(15) in (0, -signal.SIGTERM)
        assert time.monotonic() - started < 8  # grace 2 s + backstop 4 s at most
    finally:
        idle.close()
