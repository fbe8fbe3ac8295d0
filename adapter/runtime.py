"""Bring the model up in the order that gives clear start errors, and track its state.

Order: backends (so GPU requests can be checked), model files and manifest, engine with
its answer-slot check. Each failure is one readable line; /ping answers 503 while loading
and after a failure so SageMaker never routes traffic to a model that is not usable.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from adapter.backends import load_backends
from adapter.engine import LlamaEngine
from adapter.model_files import resolve_model_files
from adapter.prompts import PAIR_LABEL_SEQUENCES, PROMPT_VERSION
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
    engine = LlamaEngine(
        files.gguf,
        kv_cells=settings.kv_cells,
        # A question with letter-digit labels needs a sequence per distinct first letter.
        max_branches=max(settings.max_shared_decisions, PAIR_LABEL_SEQUENCES),
        threads=settings.threads,
        n_gpu_layers=settings.n_gpu_layers,
        prefix_reuse=settings.prefix_reuse,
    )
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
        engine=engine, max_tokens=settings.max_tokens, model=model, temperature=files.temperature
    )


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

    def close(self) -> None:
        if self.service is not None:
            self.service.engine.close()
