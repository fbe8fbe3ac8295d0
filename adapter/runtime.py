"""Bring the model up in the order that gives clear start errors, track its state, admit work.

Order: backends (so GPU requests can be checked), model files and manifest, engine, chat
template, answer-label probe. Each failure is one readable line; /ping answers 503 while
loading and after a failure so SageMaker never routes traffic to a model that is not
usable. Admission (is the model ready, is a slot free) is decided here and nowhere else.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from adapter.backends import load_backends
from adapter.engine import LlamaEngine
from adapter.errors import UnavailableError
from adapter.labels import LabelSet, probe_labels
from adapter.model_files import resolve_model_files
from adapter.prompts import PAIR_LABEL_SEQUENCES, PROMPT_VERSION, ChatTemplate
from adapter.service import DecisionService
from adapter.settings import Settings

LOG = logging.getLogger("adapter")
State = Literal["loading", "ready", "failed"]
_GPU_BACKEND_PREFIXES = ("CUDA", "ROCm", "HIP", "Vulkan", "Metal", "SYCL", "MUSA", "CANN")


class StartError(RuntimeError):
    """The server cannot serve with these settings and this model."""


def load_service(settings: Settings) -> DecisionService:
    """Load backends, verify the model files and build the scoring service."""
    backends = load_backends(settings.llama_lib_path)
    if settings.n_gpu_layers != 0 and not any(
        name.startswith(_GPU_BACKEND_PREFIXES) for name in backends
    ):
        raise StartError(
            f"SEMIF_N_GPU_LAYERS={settings.n_gpu_layers} asks for GPU offload but no GPU "
            f"backend is loaded (backends: {', '.join(backends) or 'none'}); use 0 for CPU"
        )
    files = resolve_model_files(settings.model_dir, settings.gguf_path)
    loaded = open_model(
        files.gguf,
        kv_cells=settings.kv_cells,
        # A question with letter-digit labels needs a sequence per distinct first letter.
        max_branches=max(settings.max_shared_decisions, PAIR_LABEL_SEQUENCES),
        threads=settings.threads,
        n_gpu_layers=settings.n_gpu_layers,
        prefix_reuse=settings.prefix_reuse,
    )
    engine = loaded.engine
    model = {
        **files.identity,
        "backends": backends,
        "prompt_version": PROMPT_VERSION,
        "serving": {
            **engine.description(),
            "n_gpu_layers": settings.n_gpu_layers,
            "max_tokens": settings.max_tokens,
            "max_in_flight": settings.max_in_flight,
            "max_shared_decisions": settings.max_shared_decisions,
        },
    }
    return DecisionService(
        engine=engine,
        template=loaded.template,
        labels=loaded.labels,
        max_tokens=settings.max_tokens,
        model=model,
        temperature=files.temperature,
    )


@dataclass(frozen=True)
class LoadedModel:
    """An engine whose chat template compiled and whose answer labels were probed."""

    engine: LlamaEngine
    template: ChatTemplate
    labels: LabelSet


def open_model(
    gguf: Path,
    *,
    kv_cells: int,
    max_branches: int,
    threads: int | None,
    n_gpu_layers: int,
    prefix_reuse: bool = True,
) -> LoadedModel:
    """Load the GGUF, compile its chat template and probe its labels; a refused model frees
    its native memory before the error propagates."""
    engine = LlamaEngine(
        gguf,
        kv_cells=kv_cells,
        max_branches=max_branches,
        threads=threads,
        n_gpu_layers=n_gpu_layers,
        prefix_reuse=prefix_reuse,
    )
    try:
        bos, eos = engine.special_texts()
        template = ChatTemplate(engine.chat_template_source(), bos_token=bos, eos_token=eos)
        return LoadedModel(engine, template, probe_labels(engine, template))
    except BaseException:
        engine.close()
        raise


@dataclass
class Runtime:
    """What the HTTP layer needs to know about the model at any moment."""

    settings: Settings
    state: State = "loading"
    service: DecisionService | None = None
    error: str | None = None
    in_flight: int = 0

    def load(self) -> None:
        """Blocking load; records failure instead of raising so /ping can report it."""
        try:
            self.service = load_service(self.settings)
        except Exception as error:
            self.state, self.error = "failed", f"{type(error).__name__}: {error}"
            LOG.error("model load failed: %s", self.error)
            raise
        self.state = "ready"
        LOG.info("model ready: %s", self.service.model.get("file"))

    @property
    def healthy(self) -> bool:
        return self.state == "ready" and self.service is not None and self.service.health.healthy

    @asynccontextmanager
    async def admit(self) -> AsyncIterator[DecisionService]:
        """Take one of SEMIF_MAX_IN_FLIGHT slots, or refuse at once with a 503 that says
        whether a retry can help (loading, busy) or not (unhealthy)."""
        if not self.healthy or self.service is None:
            message = "model is loading" if self.state == "loading" else "model is not healthy"
            raise UnavailableError(message, retryable=self.state == "loading")
        if self.in_flight >= self.settings.max_in_flight:
            raise UnavailableError("busy: all scoring slots are in use", retryable=True)
        self.in_flight += 1
        try:
            yield self.service
        finally:
            self.in_flight -= 1

    def close(self) -> None:
        if self.service is not None:
            self.service.engine.close()
