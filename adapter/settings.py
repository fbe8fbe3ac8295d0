"""Serving settings, read once from the environment and validated before anything starts.

A bad value stops the process with one line that names the variable and the allowed range,
so a misconfigured SageMaker endpoint fails its first health check with a readable log
instead of misbehaving later.

One rule decides what "inside SageMaker" means: the model is served from SageMaker's model
directory, /opt/ml/model (the default). There the server binds every interface (SageMaker
reaches the container on its own interface), leaves /invocations to SageMaker's IAM, and
refuses a GGUF without model-manifest.json unless SEMIF_ALLOW_UNVERIFIED_MODEL=true.
Anywhere else it binds loopback by default and, with SEMIF_API_KEY set, guards every route
but /ping.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

from adapter.kv_memory import AUTO, KvBudget, KvMemoryError
from adapter.likelihood import (
    LISTINGS,
    READOUTS,
    Listing,
    Readout,
    ReadoutChoice,
)
from adapter.template_text import TemplateText
from adapter.weight_buffers import WEIGHT_BUFFERS, WeightBuffers
from model_build.calibration import NORMALIZATIONS, OPTION_ORDERS, Normalization, OptionOrder
from model_build.manifest import ChatTemplateFileError, read_chat_template

# How much each decision's audit record keeps (adapter.audit).
AuditLevel = Literal["none", "digest", "full"]
AUDIT_LEVELS: tuple[AuditLevel, ...] = ("none", "digest", "full")
VARIANT_NAME = re.compile(r"[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}")

# Where SageMaker unpacks model.tar.gz; serving from here is what "inside SageMaker" means.
SAGEMAKER_MODEL_DIR = Path("/opt/ml/model")
ALL_INTERFACES = "0.0.0.0"  # noqa: S104 - SageMaker reaches the container on its own interface
LOOPBACK = "127.0.0.1"
# SageMaker sends SIGKILL 30 s after SIGTERM; in-flight work must end well before that.
SAGEMAKER_STOP_GRACE_SECONDS = 30
# The grace for in-flight work, plus serve's backstop (4 s) and the wait to free the model
# (3 s), plus a second of margin, must end before SageMaker's SIGKILL.
MAX_SHUTDOWN_GRACE_SECONDS = SAGEMAKER_STOP_GRACE_SECONDS - 8
BATCH_TIMEOUT_S = 3600.0  # SageMaker's longest batch and async invocation
_LIBLLAMA_NAMES = ("libllama.so", "libllama.dylib", "llama.dll")
_Choice = TypeVar("_Choice", bound=str)


class SettingsError(ValueError):
    """One environment variable holds a value outside its documented range."""


def _within(path: Path, directory: Path) -> bool:
    try:
        path.resolve().relative_to(directory.resolve())
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class QueueLimits:
    """How much waits and for how long: the five queue settings as one value, from
    `Settings.queue_limits` to the service (deadline, request budget) and its scheduler
    (queue depth, queue timeout, requests per pass)."""

    # Continuous batching: requests waiting for a pass, and how long one may wait there.
    max_queue: int = 256
    queue_timeout_seconds: float = 20.0
    # Queue plus scoring; past it the request is dropped between passes (a 429).
    request_timeout_seconds: float = 50.0
    # Requests one batched pass takes; 1 scores one request at a time (serial).
    max_batch_requests: int = 32
    # Tokens one request may cost: every prompt and label continuation of its decisions.
    max_request_tokens: int = 16_384


@dataclass(frozen=True)
class Settings:
    """Everything the server needs to know; immutable after start."""

    port: int = 8080
    # load_settings binds every interface inside SageMaker and loopback elsewhere.
    host: str = LOOPBACK
    model_dir: Path = Path("/opt/ml/model")
    gguf_path: Path | None = None
    threads: int | None = None
    n_gpu_layers: int = 0
    max_tokens: int = 4096
    max_shared_decisions: int = 64
    # The queue's limits (QueueLimits: one value for the service and the scheduler).
    max_queue: int = QueueLimits.max_queue
    queue_timeout_seconds: float = QueueLimits.queue_timeout_seconds
    request_timeout_seconds: float = QueueLimits.request_timeout_seconds
    max_batch_requests: int = QueueLimits.max_batch_requests
    max_request_tokens: int = QueueLimits.max_request_tokens
    # Bit-identical scores whatever came before or rode along (aligned KV layout, no
    # flash attention); false trades that for a little speed.
    exact_scoring: bool = True
    max_body_bytes: int = 1 << 20
    # A JSON Lines body (adapter.lines): many requests, each line within max_body_bytes.
    max_lines_bytes: int = 100 << 20
    # Lines one JSON Lines body may hold: each line costs an answer line and a parse whatever
    # its size, so bytes alone do not bound the work (1 MB of newlines is 10^6 lines). At
    # least a 6 MB batch transform mini-batch of the smallest valid requests (~100 bytes).
    max_lines: int = 100_000
    # Inside a SageMaker batch transform job (SAGEMAKER_BATCH): the deadline is then
    # SEMIF_BATCH_TIMEOUT_S.
    batch: bool = False
    llama_lib_path: Path | None = None
    prefix_reuse: bool = True
    max_chat_tokens: int = 512
    # Bearer key: the /v1 routes always, every route but /ping outside SageMaker.
    api_key: str | None = field(default=None, repr=False)
    # Serve a GGUF without model-manifest.json from SageMaker's model directory anyway.
    allow_unverified_model: bool = False
    # Seconds a request body may take to arrive in full (408 after that).
    body_timeout_seconds: float = 30.0
    # After SIGTERM: seconds in-flight work may still run before it is cancelled.
    shutdown_grace_seconds: float = 20.0
    # How options are ordered in prompts when a request does not say (adapter.ordering).
    option_order: OptionOrder = "canonical"
    # How options are read when a request does not say (adapter.likelihood): the letters
    # stay the default until the likelihood readout measures better (docs/decision-quality.md).
    readout: Readout = "letters"
    normalization: Normalization = "mean"  # measured the best calibrated (decision-quality.md)
    # Whether the likelihood prompt lists the options (adapter.prompts.likelihood_messages):
    # not by default, measured better and cheaper (docs/decision-quality.md).
    likelihood_prompt: Listing = "unlisted"
    # Which of llama.cpp's extra weight buffer types may hold weights (adapter.weight_buffers).
    weight_buffers: WeightBuffers = "auto"
    # What the KV cache may take; the number of streams follows (adapter.kv_memory).
    kv_memory: KvBudget = field(default_factory=lambda: KvBudget(AUTO))
    # SEMIF_CHAT_TEMPLATE, read at start: renders prompts instead of the model's template.
    chat_template: TemplateText | None = field(default=None, repr=False)
    # SEMIF_AUDIT: a record per decision (adapter.audit); `full` keeps request text, so it
    # needs SEMIF_AUDIT_ALLOW_FULL=true (checked at start).
    audit: AuditLevel = "none"
    # SEMIF_VARIANT: the SageMaker variant serving (the CDK sets it on each variant's model),
    # named in every audit record so a shadow test's two sides can be told apart.
    variant: str | None = None

    @property
    def queue_limits(self) -> QueueLimits:
        return QueueLimits(
            max_queue=self.max_queue,
            queue_timeout_seconds=self.queue_timeout_seconds,
            request_timeout_seconds=self.request_timeout_seconds,
            max_batch_requests=self.max_batch_requests,
            max_request_tokens=self.max_request_tokens,
        )

    @property
    def readout_choice(self) -> ReadoutChoice:
        """The readout a request gets when it names none."""
        return ReadoutChoice(self.readout, self.normalization)

    @property
    def stream_cells(self) -> int:
        """Cells of one KV stream: the longest prompt and one label continuation token (the
        engine keeps as many streams as SEMIF_KV_MEMORY holds)."""
        return self.max_tokens + 1

    @property
    def in_sagemaker(self) -> bool:
        """The model comes from SageMaker's model directory (the container contract)."""
        if self.gguf_path is not None:
            return _within(self.gguf_path, SAGEMAKER_MODEL_DIR)
        return _within(self.model_dir, SAGEMAKER_MODEL_DIR)

    @property
    def manifest_required(self) -> bool:
        """Inside SageMaker an unverified GGUF is refused unless explicitly allowed."""
        return self.in_sagemaker and not self.allow_unverified_model

    @property
    def guard_invocations(self) -> bool:
        """Whether SEMIF_API_KEY also guards /invocations and the SageMaker runtime path:
        outside SageMaker it does; inside, SageMaker's IAM authenticates those and the
        container never sees a key."""
        return self.api_key is not None and not self.in_sagemaker


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


def _seconds(env: Mapping[str, str], name: str, default: float, low: float, high: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not a number; allowed {low:g}..{high:g}") from None
    if not low <= value <= high:  # also refuses nan
        raise SettingsError(f"{name}={raw} is out of range; allowed {low:g}..{high:g}")
    return value


def _choice(
    env: Mapping[str, str], name: str, allowed: tuple[_Choice, ...], default: _Choice
) -> _Choice:
    """One of a fixed set of words (a Literal type's values); blank means the default."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    for value in allowed:
        if raw == value:
            return value
    raise SettingsError(f"{name}={raw!r} is not allowed; allowed {', '.join(allowed)}")


def _lib_path(env: Mapping[str, str]) -> Path | None:
    """An external llama.cpp build: a directory holding libllama (the binding loads it at
    import, so this is checked before anything imports llama_cpp)."""
    lib_path = _path(env, "LLAMA_CPP_LIB_PATH")
    if lib_path is None:
        return None
    if not lib_path.is_dir():
        raise SettingsError(f"LLAMA_CPP_LIB_PATH={lib_path} is not a directory")
    if not any((lib_path / name).is_file() for name in _LIBLLAMA_NAMES):
        raise SettingsError(
            f"LLAMA_CPP_LIB_PATH={lib_path} holds no libllama.so; point it at a llama.cpp "
            "build's library directory (the DLC's /opt/llama.cpp/bin) or unset it"
        )
    return lib_path


def _chat_template(env: Mapping[str, str]) -> TemplateText | None:
    """The operator's chat template file, read once here: it then wins over the model's
    (the packed one and the GGUF's), and is compiled and probed with the model at load."""
    path = _path(env, "SEMIF_CHAT_TEMPLATE")
    if path is None:
        return None
    try:
        _, text = read_chat_template(path)
    except ChatTemplateFileError as error:
        raise SettingsError(
            f"SEMIF_CHAT_TEMPLATE={path} {error}; give a Jinja chat template file or unset it"
        ) from None
    return TemplateText(text, "operator", f"SEMIF_CHAT_TEMPLATE={path}")


def _api_key(env: Mapping[str, str]) -> str | None:
    if "SEMIF_API_KEY" not in env:
        return None
    key = env["SEMIF_API_KEY"].strip()
    if not key:
        # A blank key must not silently turn authentication off.
        raise SettingsError(
            "SEMIF_API_KEY is set but blank; give a key, or unset it to run without one"
        )
    return key


# Settings no longer read, with what replaces them. Each is a start error while set (blank
# is unset): a value that silently did nothing would look like a setting that works.
RETIRED = {
    "SEMIF_MAX_IN_FLIGHT": (
        "requests now queue for batched passes; use SEMIF_MAX_QUEUE (waiting requests) and "
        "SEMIF_MAX_BATCH_REQUESTS (requests per pass) instead"
    ),
    # Every time setting ends in _S.
    "SEMIF_BODY_TIMEOUT_SECONDS": "it is named SEMIF_BODY_TIMEOUT_S now",
    "SEMIF_SHUTDOWN_GRACE_SECONDS": "it is named SEMIF_SHUTDOWN_GRACE_S now",
}


def _refuse_retired(env: Mapping[str, str]) -> None:
    for name, instead in RETIRED.items():
        if env.get(name, "").strip():
            raise SettingsError(f"{name} is no longer read: {instead}; unset it")


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Build Settings from `env` (default: the process environment), validating every value."""
    env = os.environ if env is None else env
    gguf_path = _path(env, "SEMIF_GGUF_PATH")
    if gguf_path is not None and not gguf_path.is_file():
        raise SettingsError(f"SEMIF_GGUF_PATH={gguf_path} is not a file; give an existing .gguf")
    lib_path = _lib_path(env)
    cpu_count = os.cpu_count() or 1
    max_tokens = _required_int(env, "SEMIF_MAX_TOKENS", 4096, 64, 131_072)
    model_dir = _path(env, "SEMIF_MODEL_DIR") or Settings.model_dir
    allow_unverified = _flag(env, "SEMIF_ALLOW_UNVERIFIED_MODEL", default=False)
    located = Settings(model_dir=model_dir, gguf_path=gguf_path)
    _refuse_retired(env)
    queue_timeout = _seconds(
        env, "SEMIF_QUEUE_TIMEOUT_S", Settings.queue_timeout_seconds, 0.1, 55.0
    )
    request_timeout = _seconds(
        env, "SEMIF_REQUEST_TIMEOUT_S", Settings.request_timeout_seconds, 1.0, BATCH_TIMEOUT_S
    )
    # A batch transform job runs the endpoint's model, SEMIF_REQUEST_TIMEOUT_S (sized for
    # SageMaker's 60 s online limit) included, but waits up to its own invocation timeout
    # (at most 3600 s) for a mini-batch: there SEMIF_BATCH_TIMEOUT_S is the deadline.
    batch = _flag(env, "SAGEMAKER_BATCH", default=False)
    if batch:
        request_timeout = _seconds(
            env, "SEMIF_BATCH_TIMEOUT_S", BATCH_TIMEOUT_S, 1.0, BATCH_TIMEOUT_S
        )
    if request_timeout < queue_timeout:
        raise SettingsError(
            f"SEMIF_REQUEST_TIMEOUT_S={request_timeout:g} is below SEMIF_QUEUE_TIMEOUT_S="
            f"{queue_timeout:g}; the request deadline covers the queue wait"
        )
    max_body_bytes = _required_int(env, "SEMIF_MAX_BODY_BYTES", 1 << 20, 1024, 64 << 20)
    max_request_tokens = _required_int(
        env,
        "SEMIF_MAX_REQUEST_TOKENS",
        max(Settings.max_request_tokens, max_tokens),
        max_tokens,
        1 << 20,
    )
    return Settings(
        port=_port(env),
        host=env.get("SEMIF_HOST", "").strip()
        or (ALL_INTERFACES if located.in_sagemaker else LOOPBACK),
        model_dir=model_dir,
        gguf_path=gguf_path,
        threads=_int(env, "SEMIF_THREADS", None, 1, max(cpu_count, 1024)),
        n_gpu_layers=_required_int(env, "SEMIF_N_GPU_LAYERS", 0, -1, 100_000),
        max_tokens=max_tokens,
        max_shared_decisions=_required_int(env, "SEMIF_MAX_SHARED_DECISIONS", 64, 1, 1024),
        max_queue=_required_int(env, "SEMIF_MAX_QUEUE", Settings.max_queue, 1, 4096),
        queue_timeout_seconds=queue_timeout,
        request_timeout_seconds=request_timeout,
        max_batch_requests=_required_int(
            env, "SEMIF_MAX_BATCH_REQUESTS", Settings.max_batch_requests, 1, 256
        ),
        max_request_tokens=max_request_tokens,
        exact_scoring=_flag(env, "SEMIF_EXACT_SCORING", default=True),
        max_body_bytes=max_body_bytes,
        max_lines_bytes=_required_int(
            env,
            "SEMIF_MAX_LINES_BYTES",
            max(Settings.max_lines_bytes, max_body_bytes),
            max(1 << 20, max_body_bytes),
            1 << 30,
        ),
        max_lines=_required_int(env, "SEMIF_MAX_LINES", Settings.max_lines, 1, 10_000_000),
        batch=batch,
        llama_lib_path=lib_path,
        prefix_reuse=_flag(env, "SEMIF_PREFIX_REUSE", default=True),
        # Chat output shares the KV cache with its prompt: at most SEMIF_MAX_TOKENS of each.
        max_chat_tokens=_required_int(
            env, "SEMIF_MAX_CHAT_TOKENS", min(512, max_tokens), 1, max_tokens
        ),
        api_key=_api_key(env),
        allow_unverified_model=allow_unverified,
        body_timeout_seconds=_seconds(env, "SEMIF_BODY_TIMEOUT_S", 30.0, 1.0, 600.0),
        # Below SageMaker's 30 s SIGTERM-to-SIGKILL window, leaving time to answer and exit.
        shutdown_grace_seconds=_seconds(
            env, "SEMIF_SHUTDOWN_GRACE_S", 20.0, 0.0, MAX_SHUTDOWN_GRACE_SECONDS
        ),
        option_order=_choice(env, "SEMIF_OPTION_ORDER", OPTION_ORDERS, Settings.option_order),
        readout=_choice(env, "SEMIF_READOUT", READOUTS, Settings.readout),
        normalization=_choice(env, "SEMIF_NORMALIZATION", NORMALIZATIONS, Settings.normalization),
        likelihood_prompt=_choice(
            env, "SEMIF_LIKELIHOOD_PROMPT", LISTINGS, Settings.likelihood_prompt
        ),
        weight_buffers=_choice(
            env, "SEMIF_WEIGHT_BUFFERS", WEIGHT_BUFFERS, Settings.weight_buffers
        ),
        kv_memory=_kv_memory(env),
        chat_template=_chat_template(env),
        audit=_audit(env),
        variant=_variant(env),
    )


def _audit(env: Mapping[str, str]) -> AuditLevel:
    """SEMIF_AUDIT; `full` records request text, so an environment must opt in to it."""
    level = _choice(env, "SEMIF_AUDIT", AUDIT_LEVELS, Settings.audit)
    if level == "full" and not _flag(env, "SEMIF_AUDIT_ALLOW_FULL", default=False):
        raise SettingsError(
            "SEMIF_AUDIT=full records every request's text; set SEMIF_AUDIT_ALLOW_FULL=true "
            "where the environment may keep it, or use SEMIF_AUDIT=digest"
        )
    return level


def _variant(env: Mapping[str, str]) -> str | None:
    """SEMIF_VARIANT: a SageMaker variant name (letters, digits, inner hyphens, at most 63
    characters); blank means none (a local server)."""
    name = env.get("SEMIF_VARIANT", "").strip()
    if not name:
        return None
    if not VARIANT_NAME.fullmatch(name):
        raise SettingsError(
            f"SEMIF_VARIANT must be a SageMaker variant name (letters, digits and inner "
            f"hyphens, at most 63 characters), not {name[:80]!r}"
        )
    return name


def _kv_memory(env: Mapping[str, str]) -> KvBudget:
    text = env.get("SEMIF_KV_MEMORY", "").strip()
    if not text:
        return KvBudget(AUTO)
    try:
        return KvBudget.parse(text)
    except KvMemoryError as error:
        raise SettingsError(str(error)) from None
