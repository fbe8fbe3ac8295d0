"""Bring the model up in the order that gives clear start errors, track its state, admit work.

Order: backends (so GPU requests can be checked), model files and manifest (required in
SageMaker's model directory), engine (weights read into memory, in the buffer types
SEMIF_WEIGHT_BUFFERS allows; one log line says which), chat template (it must
keep request-text markers), answer-label probe, one scored probe decision (finite logits,
plausible letter mass). Each failure is one readable line; /ping answers 503 while loading
and after a failure so SageMaker never routes traffic to a model that is not usable.
Admission (is the model ready and healthy, is the server stopping) is decided here and
nowhere else; the scheduler bounds the queue behind it. At shutdown admission stops at once
and in-flight work is cancelled after the grace period (`begin_shutdown`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Literal

from adapter.audit import AuditLog
from adapter.backends import cpu_backend, load_backends
from adapter.calibration import check_calibration
from adapter.core.engine import LlamaEngine
from adapter.core.failures import ModelLoadError
from adapter.errors import UnavailableError
from adapter.labels import LabelSet, probe_decision, probe_labels
from adapter.metrics import Metrics
from adapter.model_files import resolve_model_files
from adapter.prompts import (
    PAIR_LABEL_SEQUENCES,
    PROMPT_VERSION,
    ChatTemplate,
    TemplateRenderError,
    check_marks_survive,
)
from adapter.service import DecisionService
from adapter.settings import Settings
from adapter.template_text import TemplateText

LOG = logging.getLogger("adapter")
State = Literal["loading", "ready", "failed"]
# After the grace period, how long closing waits for a cancelled call to leave the engine.
CLOSE_WAIT_SECONDS = 3.0
# How an operator supplies a chat template (docs/adapter.md, "Chat template").
_SUPPLY_TEMPLATE = (
    "set SEMIF_CHAT_TEMPLATE to a Jinja chat template file, or pack one with "
    "model-build --chat-template"
)
_GPU_BACKEND_PREFIXES = ("CUDA", "ROCm", "HIP", "Vulkan", "Metal", "SYCL", "MUSA", "CANN")


class StartError(RuntimeError):
    """The server cannot serve with these settings and this model."""


def load_service(
    settings: Settings,
    cancel: threading.Event | None = None,
    metrics: Metrics | None = None,
) -> DecisionService:
    """Load backends, verify the model files and build the scoring service; `cancel` (set
    at shutdown) aborts the load and, later, in-flight work; `metrics` hears its passes and
    readouts."""
    backends = load_backends(settings.llama_lib_path)
    if settings.n_gpu_layers != 0 and not any(
        name.startswith(_GPU_BACKEND_PREFIXES) for name in backends
    ):
        raise StartError(
            f"SEMIF_N_GPU_LAYERS={settings.n_gpu_layers} asks for GPU offload but no GPU "
            f"backend is loaded (backends: {', '.join(backends) or 'none'}); use 0 for CPU"
        )
    files = resolve_model_files(
        settings.model_dir, settings.gguf_path, require_manifest=settings.manifest_required
    )
    # Before the load: a stale fit is refused at once.
    check_calibration(files.calibration, settings.likelihood_prompt)
    loaded = prepare_model(
        LlamaEngine(
            files.gguf,
            stream_cells=settings.stream_cells,
            # A question with letter-digit labels needs a sequence per distinct first letter.
            max_branches=max(settings.max_shared_decisions, PAIR_LABEL_SEQUENCES),
            threads=settings.threads,
            n_gpu_layers=settings.n_gpu_layers,
            weight_buffers=settings.weight_buffers,
            cpu=cpu_backend(settings.llama_lib_path),
            prefix_reuse=settings.prefix_reuse,
            exact=settings.exact_scoring,
            kv_budget=settings.kv_memory,
            cancel=cancel,
        ),
        # The explicit setting wins over the template model-build packed.
        settings.chat_template or files.chat_template,
    )
    engine = loaded.engine
    try:
        files.check_unchanged()  # the weights in memory are the bytes that were verified
    except BaseException:
        engine.close()
        raise
    model = {
        **files.identity,
        "backends": backends,
        "prompt_version": PROMPT_VERSION,
        "chat_template": loaded.template_text.identity(),
        "serving": {
            **engine.description(),
            "n_gpu_layers": settings.n_gpu_layers,
            "max_tokens": settings.max_tokens,
            "max_shared_decisions": settings.max_shared_decisions,
            **asdict(settings.queue_limits),
        },
    }
    return DecisionService(
        engine=engine,
        template=loaded.template,
        labels=loaded.labels,
        max_tokens=settings.max_tokens,
        model=model,
        calibration=files.calibration,
        option_order=settings.option_order,
        readout=settings.readout_choice,
        listing=settings.likelihood_prompt,
        limits=settings.queue_limits,
        metrics=metrics,
    )


@dataclass(frozen=True)
class LoadedModel:
    """An engine whose chat template compiled and whose answer labels were probed."""

    engine: LlamaEngine
    template: ChatTemplate
    labels: LabelSet
    template_text: TemplateText  # what `template` was compiled from, and where it came from


def prepare_model(engine: LlamaEngine, operator: TemplateText | None = None) -> LoadedModel:
    """Make a loaded engine servable: compile its chat template (the operator's when given,
    else the GGUF's), check it keeps request text marked, probe its labels and score one
    probe decision. A refused model frees its native memory (the engine is closed) before
    the error propagates. Where the weights went is logged first: a native crash in the
    first decode then has its context in the log."""
    LOG.info("%s", engine.weights.describe())
    try:
        text = operator or _gguf_template(engine)
        LOG.info("chat template: %s (sha256 %s)", text.origin, text.sha256)
        bos, eos = engine.vocab.special_texts()
        try:
            template = ChatTemplate(text.text, bos_token=bos, eos_token=eos)
            check_marks_survive(template)
            labels = probe_labels(engine, template)
            mass = probe_decision(engine, template, labels)
        except TemplateRenderError as error:
            # Named by origin: the operator's file to fix, or the GGUF's to replace.
            hint = f"; {_SUPPLY_TEMPLATE}" if text.source == "gguf" else ""
            raise TemplateRenderError(f"{text.origin}: {error}{hint}") from None
        LOG.info("probe decision: letter mass %.3g", mass)
        return LoadedModel(engine, template, labels, text)
    except BaseException:
        engine.close()
        raise


def _gguf_template(engine: LlamaEngine) -> TemplateText:
    """The GGUF's own chat template; without one (and no operator template) nothing can
    render a prompt, so the model is refused."""
    source = engine.vocab.chat_template_source()
    if source is None:
        raise ModelLoadError(
            "the model has no chat template (tokenizer.chat_template) and none was given: "
            + _SUPPLY_TEMPLATE
        )
    return TemplateText(source, "gguf", "the GGUF's chat template (tokenizer.chat_template)")


@dataclass
class Runtime:
    """What the HTTP layer needs to know about the model at any moment."""

    settings: Settings
    state: State = "loading"
    service: DecisionService | None = None
    error: str | None = None
    in_flight: int = 0
    stopping: bool = False
    # Set when in-flight work must stop (the grace period after SIGTERM ran out).
    cancel: threading.Event = field(default_factory=threading.Event)
    metrics: Metrics = field(default_factory=Metrics)  # GET /metrics (adapter.metrics)
    audit: AuditLog = field(init=False)  # a record per decision answered (SEMIF_AUDIT)

    def __post_init__(self) -> None:
        self.metrics.label_variant(self.settings.variant)
        self.metrics.watch(
            queue_depth=lambda: 0 if self.service is None else self.service.queue_depth,
            in_flight=lambda: self.in_flight,
        )
        self.audit = AuditLog(
            self.settings.audit,
            variant=self.settings.variant,
            on_written=self.metrics.audit_records.inc,
            on_dropped=self.metrics.audit_dropped.inc,
        )

    def load(self) -> None:
        """Blocking load; records failure instead of raising so /ping can report it."""
        started = time.monotonic()
        try:
            self.service = load_service(self.settings, self.cancel, self.metrics)
        except Exception as error:
            self.state, self.error = "failed", f"{type(error).__name__}: {error}"
            LOG.error("model load failed: %s", self.error)
            raise
        self.state = "ready"
        self.metrics.model_load_seconds.set(time.monotonic() - started)
        LOG.info("model ready: %s", self.service.model.get("file"))

    @property
    def healthy(self) -> bool:
        return (
            self.state == "ready"
            and not self.stopping
            and self.service is not None
            and self.service.health.healthy
        )

    def begin_shutdown(self, grace_seconds: float) -> None:
        """Stop admitting now; cancel a load at once and in-flight work after the grace
        period (it then ends at its next decode with a retryable 503)."""
        if self.stopping:
            return
        self.stopping = True
        LOG.info("shutting down: admission stopped; in-flight work has %.1f s", grace_seconds)
        if self.state == "loading" or self.in_flight == 0:
            self.cancel.set()
            return
        timer = threading.Timer(grace_seconds, self.cancel.set)
        timer.daemon = True
        timer.start()

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[DecisionService]:
        """Admit a validated request to the service (whose scheduler queues it), or refuse
        at once with a 503 that says whether a retry can help (loading) or not (unhealthy).
        A full queue is the scheduler's 429."""
        if self.stopping:
            raise UnavailableError("server is shutting down", retryable=True, cause="stopping")
        if not self.healthy or self.service is None:
            if self.state == "loading":
                raise UnavailableError("model is loading", retryable=True, cause="loading")
            raise UnavailableError("model is not healthy", retryable=False, cause="unhealthy")
        self.in_flight += 1
        try:
            yield self.service
        finally:
            self.in_flight -= 1

    def close(self) -> None:
        """Free the model; cancels whatever still runs and waits briefly for it to stop,
        then writes the audit records still queued."""
        self.stopping = True
        self.cancel.set()
        self.audit.close()
        if self.service is not None and not self.service.close(CLOSE_WAIT_SECONDS):
            LOG.error("a call still holds the model after cancellation; exiting without freeing")
