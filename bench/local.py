"""Local models for the benchmarks: server processes (our `serve`, llama-cpp-python's
server, llama.cpp's own `llama-server`, built by bench.peer_server), and our engine loaded
in this process as the limit they are measured against.

Servers run as real subprocesses on a free loopback port, so what is measured is what a
user runs. The start time is taken before the process is spawned, so cold start includes
the interpreter, imports and model load; /proc gives the peak resident memory afterwards.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Self

from adapter.backends import cpu_backend, load_backends
from adapter.runtime import load_service
from adapter.settings import Settings, load_settings
from adapter.weight_buffers import WeightBuffers, choose_buffers

LOOPBACK = "127.0.0.1"
READY_TIMEOUT_S = 180.0
POLL_INTERVAL_S = 0.02


def weight_buffers_setting() -> WeightBuffers:
    """SEMIF_WEIGHT_BUFFERS as the servers started here inherit it (validated as `serve`
    validates it): the in-process limits are built with the same setting."""
    raw = os.environ.get("SEMIF_WEIGHT_BUFFERS", "")
    return load_settings({"SEMIF_WEIGHT_BUFFERS": raw}).weight_buffers


def peer_extra_buffers() -> bool:
    """Whether the peers may use llama.cpp's extra weight buffer types: the choice our
    `serve` makes on this CPU, so every server holds its weights in the same layout (and
    no peer crashes where AMX is offered; adapter/weight_buffers.py)."""
    load_backends(None)
    return choose_buffers(weight_buffers_setting(), cpu_backend(None)).use_extra


def llama_server_weight_flags() -> list[str]:
    """llama-server's spelling of the same choice (it has no finer one than all or none)."""
    return [] if peer_extra_buffers() else ["--no-repack"]


class InProcessModel:
    """The server's engine (`load_service` on its settings) in this process, beside the
    servers measured against it: both stay loaded, one computes at a time."""

    def __init__(self, settings: Settings) -> None:
        self.service = load_service(settings)
        self.engine = self.service.engine

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.service.close(wait_seconds=5.0)


class ServerStartError(RuntimeError):
    """A benchmark server exited or never became ready; the message quotes its log."""


@dataclass
class ServerProcess:
    """A running server and what was measured while it started."""

    process: subprocess.Popen[bytes]
    base_url: str
    cold_start_seconds: float

    def peak_rss_bytes(self) -> int:
        """VmHWM of the server process: the most resident memory it ever held."""
        status = Path(f"/proc/{self.process.pid}/status").read_text(encoding="utf-8")
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmHWM in /proc/{self.process.pid}/status")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        port: int = probe.getsockname()[1]
        return port


def _log_tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


def _wait_ready(name: str, process: subprocess.Popen[bytes], url: str, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerStartError(
                f"{name} exited with {process.returncode} before it was ready:\n"
                + _log_tail(log_path)
            )
        try:
            with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310 - loopback
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(POLL_INTERVAL_S)
    raise ServerStartError(f"{name} not ready at {url} after {READY_TIMEOUT_S:.0f} s")


@contextmanager
def _spawn(
    name: str, argv: list[str], env: Mapping[str, str], ready_path: str, port: int, log_dir: Path
) -> Iterator[ServerProcess]:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    base_url = f"http://{LOOPBACK}:{port}"
    log: IO[bytes]
    with log_path.open("wb") as log:
        started = time.perf_counter()
        process = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=log)
        try:
            _wait_ready(name, process, base_url + ready_path, log_path)
            yield ServerProcess(
                process=process,
                base_url=base_url,
                cold_start_seconds=time.perf_counter() - started,
            )
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextmanager
def serve_model(
    gguf: Path,
    *,
    log_dir: Path,
    threads: int,
    n_gpu_layers: int = 0,
    prefix_reuse: bool = True,
    max_batch_requests: int | None = None,
    settings: Mapping[str, str] | None = None,
    name: str = "serve",
) -> Iterator[ServerProcess]:
    """Our `serve` (the container entry point) on `gguf`, as SageMaker would run it;
    `max_batch_requests=1` turns continuous batching off (one request per engine pass);
    `settings`: more SEMIF_* variables, for a server `name`d apart in the logs."""
    port = free_port()
    env = {
        "SEMIF_MODEL_DIR": str(gguf.parent),
        "SEMIF_GGUF_PATH": str(gguf),
        "SEMIF_HOST": LOOPBACK,
        "SEMIF_PORT": str(port),
        "SEMIF_THREADS": str(threads),
        "SEMIF_N_GPU_LAYERS": str(n_gpu_layers),
        "SEMIF_PREFIX_REUSE": "true" if prefix_reuse else "false",
        **(settings or {}),
    }
    name += "" if prefix_reuse else "-no-reuse"
    if max_batch_requests is not None:
        env["SEMIF_MAX_BATCH_REQUESTS"] = str(max_batch_requests)
        name += f"-batch{max_batch_requests}"
    argv = [sys.executable, "-m", "adapter.serve"]
    with _spawn(name, argv, env, "/ping", port, log_dir) as server:
        yield server


@contextmanager
def serve_peer(
    gguf: Path, *, log_dir: Path, threads: int, n_ctx: int, n_gpu_layers: int = 0
) -> Iterator[ServerProcess]:
    """llama-cpp-python's OpenAI-compatible server on `gguf`, with our weight-buffer choice
    (bench.python_peer).

    It can only return logprobs when built with logits_all=True (it then keeps logits for
    every prompt position), which is what a user of that server has to run.
    """
    port = free_port()
    extra = "on" if peer_extra_buffers() else "off"
    argv = [
        sys.executable, "-m", "bench.python_peer", extra,
        "--model", str(gguf),
        "--host", LOOPBACK,
        "--port", str(port),
        "--n_threads", str(threads),
        "--n_threads_batch", str(threads),
        "--n_gpu_layers", str(n_gpu_layers),
        "--n_ctx", str(n_ctx),
        "--logits_all", "True",
        "--verbose", "False",
    ]  # fmt: skip
    with _spawn("llama-cpp-python-server", argv, {}, "/v1/models", port, log_dir) as server:
        yield server


@contextmanager
def serve_llama_server(
    binary: Path,
    gguf: Path,
    *,
    log_dir: Path,
    threads: int,
    parallel: int,
    slot_context: int,
    n_gpu_layers: int = 0,
) -> Iterator[ServerProcess]:
    """llama.cpp's C++ server on `gguf` with `parallel` slots and continuous batching, as a
    user serving many clients would start it: each slot gets `slot_context` KV cells; its
    weights go where ours do (`llama_server_weight_flags`)."""
    port = free_port()
    argv = [
        str(binary),
        "--model", str(gguf),
        "--host", LOOPBACK,
        "--port", str(port),
        "--threads", str(threads),
        "--threads-batch", str(threads),
        "--n-gpu-layers", str(n_gpu_layers),
        "--parallel", str(parallel),
        "--cont-batching",
        "--ctx-size", str(parallel * slot_context),
        "--no-webui",
        *llama_server_weight_flags(),
    ]  # fmt: skip
    with _spawn(f"llama-server-np{parallel}", argv, {}, "/health", port, log_dir) as server:
        yield server
