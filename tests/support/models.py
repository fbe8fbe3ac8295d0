"""Models opened the way the server opens them (engine, template, probed labels)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from adapter.backends import cpu_backend
from adapter.core.engine import LlamaEngine
from adapter.kv_memory import KvBudget
from adapter.runtime import LoadedModel, prepare_model
from adapter.service import DecisionService


def open_test_model(gguf: Path, **options: Any) -> LoadedModel:
    """The engine as `open_engine` opens it (the same `options`), made servable as the
    server makes it: template compiled, labels probed."""
    return prepare_model(open_engine(gguf, **options))


def open_engine(
    gguf: Path,
    *,
    stream_cells: int = 4096,
    max_branches: int = 16,
    prefix_reuse: bool = True,
    threads: int = 2,
    kv_budget: KvBudget | None = None,
) -> LlamaEngine:
    """The engine alone, without the start-up probes (which refuse a random quantized model
    that puts no mass on the answer letters; engine tests need none)."""
    return LlamaEngine(
        gguf,
        stream_cells=stream_cells,
        max_branches=max_branches,
        threads=threads,
        n_gpu_layers=0,
        weight_buffers="auto",
        cpu=cpu_backend(None),
        prefix_reuse=prefix_reuse,
        kv_budget=kv_budget,
    )


def service_of(model: LoadedModel, max_tokens: int = 1024) -> DecisionService:
    """A service over `model` with no manifest identity (as the benchmarks build it)."""
    return DecisionService(
        engine=model.engine,
        template=model.template,
        labels=model.labels,
        max_tokens=max_tokens,
        model={},
    )
