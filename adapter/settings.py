"""Serving settings, read once from the environment and validated before anything starts.

A bad value stops the process with one line that names the variable and the allowed range,
so a misconfigured SageMaker endpoint fails its first health check with a readable log
instead of misbehaving later.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


class SettingsError(ValueError):
    """One environment variable holds a value outside its documented range."""


@dataclass(frozen=True)
class Settings:
    """Everything the server needs to know; immutable after start."""

    port: int = 8080
    host: str = "0.0.0.0"  # noqa: S104 - SageMaker reaches the container on its own interface
    model_dir: Path = Path("/opt/ml/model")
    gguf_path: Path | None = None
    threads: int | None = None
    n_gpu_layers: int = 0
    max_tokens: int = 4096
    max_in_flight: int = 1
    max_shared_decisions: int = 64
    max_body_bytes: int = 1 << 20
    llama_lib_path: Path | None = None
    prefix_reuse: bool = True
    max_chat_tokens: int = 512
    # Bearer key for the /v1 routes; SageMaker's /invocations is authenticated by IAM instead.
    api_key: str | None = field(default=None, repr=False)

    @property
    def kv_cells(self) -> int:
        """KV cache size: one full prompt plus as much again for batched decision branches."""
        return 2 * self.max_tokens


def _int(env: Mapping[str, str], name: str, default: int | None, low: int, high: int) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not an integer; allowed {low}..{high}") from None
    if not low <= value <= high:
        raise SettingsError(f"{name}={value} is out of range; allowed {low}..{high}")
    return value


def _required_int(env: Mapping[str, str], name: str, default: int, low: int, high: int) -> int:
    value = _int(env, name, default, low, high)
    assert value is not None  # a default was given
    return value


def _port(env: Mapping[str, str]) -> int:
    for name in ("SAGEMAKER_BIND_TO_PORT", "SEMIF_PORT"):
        if env.get(name, "").strip():
            return _required_int(env, name, 8080, 1, 65535)
    return 8080


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}={raw!r} is not a boolean; allowed true or false")


def _path(env: Mapping[str, str], name: str) -> Path | None:
    raw = env.get(name, "").strip()
    return Path(raw) if raw else None


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Build Settings from `env` (default: the process environment), validating every value."""
    env = os.environ if env is None else env
    gguf_path = _path(env, "SEMIF_GGUF_PATH")
    if gguf_path is not None and not gguf_path.is_file():
        raise SettingsError(f"SEMIF_GGUF_PATH={gguf_path} is not a file; give an existing .gguf")
    lib_path = _path(env, "LLAMA_CPP_LIB_PATH")
    if lib_path is not None and not lib_path.is_dir():
        raise SettingsError(f"LLAMA_CPP_LIB_PATH={lib_path} is not a directory")
    cpu_count = os.cpu_count() or 1
    max_tokens = _required_int(env, "SEMIF_MAX_TOKENS", 4096, 64, 131_072)
    return Settings(
        port=_port(env),
        host=env.get("SEMIF_HOST", "").strip() or Settings.host,
        model_dir=_path(env, "SEMIF_MODEL_DIR") or Settings.model_dir,
        gguf_path=gguf_path,
        threads=_int(env, "SEMIF_THREADS", None, 1, max(cpu_count, 1024)),
        n_gpu_layers=_required_int(env, "SEMIF_N_GPU_LAYERS", 0, -1, 100_000),
        max_tokens=max_tokens,
        max_in_flight=_required_int(env, "SEMIF_MAX_IN_FLIGHT", 1, 1, 64),
        max_shared_decisions=_required_int(env, "SEMIF_MAX_SHARED_DECISIONS", 64, 1, 1024),
        max_body_bytes=_required_int(env, "SEMIF_MAX_BODY_BYTES", 1 << 20, 1024, 64 << 20),
        llama_lib_path=lib_path,
        prefix_reuse=_flag(env, "SEMIF_PREFIX_REUSE", default=True),
        # Chat output shares the KV cache with its prompt: at most SEMIF_MAX_TOKENS of each.
        max_chat_tokens=_required_int(
            env, "SEMIF_MAX_CHAT_TOKENS", min(512, max_tokens), 1, max_tokens
        ),
        api_key=env.get("SEMIF_API_KEY", "").strip() or None,
    )
