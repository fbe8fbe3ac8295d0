"""Shared helpers for the model build tests: a loopback file server, a tiny GGUF, the CLI,
and a calibration (which the adapter's manifest tests use too).

The server is a real `http.server` on 127.0.0.1 (port 0) in a thread, serving files under
Hugging Face's `/<org>/<repo>/resolve/<revision>/<file>` layout, with switches for the
failures the downloader must survive: a connection cut (or stalled) mid-body, a server that
ignores `Range`, a redirect to a CDN, and scripted error statuses.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from model_build.calibration import Calibration
from model_build.cli import main
from model_build.tiny_gguf import CHAT_TEMPLATE, write_tiny_gguf

REVISION = "0123456789abcdef0123456789abcdef01234567"
CALIBRATION = Calibration(
    prompt_version="semif-direct-options/1",
    option_order="canonical",
    temperatures={"choice": 1.5, "noul": 0.8},
    tasks_sha256="d" * 64,
    counts={"choice": 40, "noul": 12},
    position_prior={2: (0.6, 0.4)},
    metrics={"nll_before": 0.71, "nll_after": 0.64},
)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class FileServer:
    """State shared with the request handler; tests set the switches and read `requests`."""

    files: dict[str, bytes] = field(default_factory=dict)
    cut_first_response_at: int | None = None
    stall_before_cut_s: float = 0.0
    honour_range: bool = True
    statuses: list[int] = field(default_factory=list)
    redirect_to_cdn: bool = False
    requests: list[dict[str, str]] = field(default_factory=list)
    released: threading.Event = field(default_factory=threading.Event)
    url: str = ""

    def add(self, repo: str, file: str, data: bytes) -> str:
        """Serve `data` as `hf://<repo>@REVISION/<file>` and return that source URI."""
        self.files[f"/{repo}/resolve/{REVISION}/{file}"] = data
        return f"hf://{repo}@{REVISION}/{file}"


def _handler(state: FileServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            """Silence the default stderr access log."""

        def do_GET(self) -> None:
            state.requests.append({"path": self.path, **dict(self.headers.items())})
            if state.statuses:
                self.send_error(state.statuses.pop(0))
                return
            if state.redirect_to_cdn and not self.path.startswith("/cdn/"):
                self.send_response(302)
                self.send_header("Location", f"/cdn{self.path}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            data = state.files.get(self.path.removeprefix("/cdn"))
            if data is None:
                self.send_error(404)
                return
            start = 0
            range_header = self.headers.get("Range")
            if range_header and state.honour_range:
                start = int(range_header.removeprefix("bytes=").rstrip("-"))
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            body = memoryview(data)[start:]  # no copy: tests measure the client's memory
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            cut = state.cut_first_response_at
            if cut is not None:
                state.cut_first_response_at = None
                self.wfile.write(body[:cut])
                self.wfile.flush()
                state.released.wait(state.stall_before_cut_s)  # ends early at teardown
                with suppress(OSError):  # the client may have gone already
                    self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            self.wfile.write(body)

    return Handler


@contextmanager
def serve_files() -> Iterator[FileServer]:
    """Run a loopback file server for the duration of the block."""
    state = FileServer()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    yield state
    state.released.set()
    server.shutdown()
    server.server_close()
    thread.join()


def closed_port_url() -> str:
    """A loopback URL nothing listens on (the port was just released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@dataclass(frozen=True)
class TinyModel:
    path: Path
    data: bytes
    sha256: str


def tiny_model(
    directory: Path,
    name: str = "tiny.gguf",
    *,
    chat_template: str | None = CHAT_TEMPLATE,
    n_embd: int = 32,
    n_layer: int = 2,
) -> TinyModel:
    """Write a tiny GGUF (see model_build.tiny_gguf) and return its bytes and sha256."""
    path = write_tiny_gguf(
        directory / name, chat_template=chat_template, n_embd=n_embd, n_layer=n_layer
    )
    data = path.read_bytes()
    return TinyModel(path=path, data=data, sha256=sha256_hex(data))


@dataclass(frozen=True)
class CliRun:
    code: int
    out: str
    err: str

    @property
    def result(self) -> dict[str, Any]:
        """The final JSON line on stdout."""
        lines = self.out.strip().splitlines()
        assert lines, f"no result line; stderr:\n{self.err}"
        document: dict[str, Any] = json.loads(lines[-1])
        return document

    @property
    def error(self) -> str:
        """The last stderr line, which names the problem when the build failed."""
        return self.err.strip().splitlines()[-1]


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> CliRun:
    """Run `model-build` in-process with `args` and capture its output."""
    code = main(list(args))
    captured = capsys.readouterr()
    return CliRun(code=code, out=captured.out, err=captured.err)


def write_calibration(path: Path, calibration: Calibration = CALIBRATION) -> Path:
    """Write `calibration` as semif-calibrate would and return the path."""
    path.write_text(calibration.to_json(), encoding="utf-8")
    return path
