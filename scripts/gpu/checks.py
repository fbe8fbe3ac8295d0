"""Correctness checks on the machine being measured: start and offload, shared state and
prefix reuse, in-process and through a real `serve` process.

The repository's tests check the same behaviour on the tiny CPU model; these run the same
assertions on the generated model with the requested offload, because CUDA kernels, batch
shapes and KV-cache copies are exactly what differs on a GPU. Each check records what it
measured, so a failure on a lent machine (minutes of time, no second chance) is diagnosable
from the JSON alone.
"""

from __future__ import annotations

import ctypes
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import llama_cpp
import llama_cpp._logger

from adapter.core.layout import MIN_ROWS
from adapter.decisions import decide
from adapter.runtime import load_service
from adapter.schema import Decision, Option
from adapter.service import DecisionService
from adapter.settings import Settings
from bench.runner import Invoker
from bench.tasks import shared_body, single_body

# Probabilities of one decision scored two ways (batched or alone, reused or cold) may
# differ by kernel choice and f16 rounding; more than this is a bug, not rounding.
TOLERANCE = 0.02
GPU_BACKEND_PREFIXES = ("CUDA", "ROCm", "HIP", "Vulkan", "Metal", "SYCL", "MUSA", "CANN")
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_BUFFER = re.compile(r"(\S+) model buffer size =\s*([\d.]+) MiB")
_DEVICE = re.compile(r"Device \d+: [^\n]+")


class CheckFailedError(AssertionError):
    """A check's condition did not hold; the message says what was measured."""


def require(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailedError(message)


@dataclass
class Check:
    name: str
    passed: bool
    detail: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class CheckList:
    """Runs checks one after another; a failure is recorded and the next check still runs."""

    results: list[Check] = field(default_factory=list)

    def run(self, name: str, action: Callable[[], dict[str, Any]]) -> bool:
        try:
            detail = action()
        except Exception as error:  # every failure is reported, none stops the run
            self.results.append(Check(name, False, error=f"{type(error).__name__}: {error}"))
            return False
        self.results.append(Check(name, True, detail))
        return True

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.results)


def is_gpu_backend(name: str) -> bool:
    return name.startswith(GPU_BACKEND_PREFIXES)


@contextmanager
def llama_log() -> Iterator[list[str]]:
    """Collect llama.cpp's log (the adapter silences it): the only place that says how many
    layers were offloaded and how big each device's weight buffer is."""
    lines: list[str] = []

    def record(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        lines.append(text.decode("utf-8", errors="replace"))

    callback = llama_cpp.llama_log_callback(record)
    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    try:
        yield lines
    finally:
        llama_cpp.llama_log_set(llama_cpp._logger.llama_log_callback, ctypes.c_void_p(0))


def start(settings: Settings) -> tuple[DecisionService | None, Check]:
    """The adapter's own start path (backends, GPU-backend check, files, engine, label
    probe), then: with offload requested every layer must be on the GPU."""
    with llama_log() as lines:
        started = time.perf_counter()
        try:
            service = load_service(settings)
        except Exception as error:  # a refused start is the finding, not a crash
            return None, Check("start", False, error=f"{type(error).__name__}: {error}")
        seconds = time.perf_counter() - started
    log = "".join(lines)
    backends: list[str] = service.model["backends"]
    offloaded = _OFFLOADED.search(log)
    layers = [int(offloaded[1]), int(offloaded[2])] if offloaded else None
    detail = {
        "load_seconds": seconds,
        "backends": backends,
        "gpu_offload": service.model["serving"]["gpu_offload"],
        "offloaded_layers": layers,
        "model_buffers_mib": {name: float(mib) for name, mib in _BUFFER.findall(log)},
        "devices": _DEVICE.findall(log),
    }
    try:
        if settings.n_gpu_layers != 0:
            require(any(map(is_gpu_backend, backends)), f"no GPU backend among {backends}")
            require(layers is not None and layers[0] == layers[1], f"offloaded: {layers}")
        else:
            require(not layers or layers[0] == 0, f"a CPU run offloaded layers: {layers}")
    except CheckFailedError as error:
        return service, Check("start", False, detail, str(error))
    return service, Check("start", True, detail)


def _probabilities(answer: dict[str, Any]) -> list[list[float]]:
    results = answer["results"] if "results" in answer else [answer["result"]]
    return [list(result["probabilities"]) for result in results]


def _largest_difference(first: list[list[float]], second: list[list[float]]) -> float:
    require(len(first) == len(second), f"{len(first)} results against {len(second)}")
    return max(
        abs(left - right)
        for one, other in zip(first, second, strict=True)
        for left, right in zip(one, other, strict=True)
    )


def _require_distributions(answer: dict[str, Any]) -> None:
    for probabilities in _probabilities(answer):
        require(abs(sum(probabilities) - 1.0) < 1e-6, f"probabilities sum to {sum(probabilities)}")


def labels(service: DecisionService) -> dict[str, Any]:
    """Letters A..P (checked at start) and letter-digit labels (above 52 options) score."""
    counts = (16, 60)
    for count in counts:
        options = tuple(Option(f"o{index}", f"Option number {index}.") for index in range(count))
        answer = decide(service, [Decision("labels", "Any evidence.", "Which?", options)], "single")
        _require_distributions(answer)
    return {"option_counts": list(counts)}


def shared_state(service: DecisionService, decisions: Sequence[Decision]) -> dict[str, Any]:
    """One shared batch gives each decision what it gets alone, evaluating the state once."""
    service.engine.reset()
    shared = decide(service, decisions, "shared")
    timing = shared["timing"]
    state_tokens = len(service.engine.vocab.tokenize(decisions[0].state_text))
    # Decoded once, whatever the passes: each further prompt saves its state, less the
    # MIN_ROWS tokens the exact path re-decodes where prompts diverge.
    saved = timing["input_tokens"] - timing["evaluated_tokens"]
    least = (len(decisions) - 1) * (state_tokens - 2 * MIN_ROWS)
    require(saved >= least, f"only {saved} tokens decoded once for all (at least {least})")
    _require_distributions(shared)
    alone: list[list[float]] = []
    for decision in decisions:
        service.engine.reset()
        alone.extend(_probabilities(decide(service, [decision], "single")))
    difference = _largest_difference(_probabilities(shared), alone)
    require(difference <= TOLERANCE, f"shared vs alone differ by {difference:.4f}")
    return {"timing": timing, "largest_difference": difference, "probabilities": alone}


def prefix_reuse(service: DecisionService, first: Decision, second: Decision) -> dict[str, Any]:
    """A second question about the cached state evaluates only its suffix and answers as
    a cold forward of its whole prompt does."""
    engine = service.engine
    engine.reset()
    cold_first = decide(service, [first], "single")
    require(cold_first["timing"]["reused_tokens"] == 0, "a reset cache reused tokens")
    warm = decide(service, [second], "single")
    tokens = warm["results"][0]["input_tokens"]
    reused, evaluated = warm["timing"]["reused_tokens"], warm["timing"]["evaluated_tokens"]
    require(reused + evaluated == tokens, f"{reused} + {evaluated} != {tokens} tokens")
    require(reused > len(engine.vocab.tokenize(second.state_text)), f"only {reused} tokens reused")
    require(evaluated < tokens / 3, f"{evaluated} of {tokens} tokens evaluated")
    repeat = decide(service, [second], "single")
    _require_only_the_tail_again(repeat["timing"])
    engine.reset()
    cold = decide(service, [second], "single")
    difference = max(
        _largest_difference(_probabilities(warm), _probabilities(cold)),
        _largest_difference(_probabilities(repeat), _probabilities(cold)),
    )
    require(difference <= TOLERANCE, f"reused vs cold differ by {difference:.4f}")
    return {"input_tokens": tokens, "evaluated_tokens": evaluated, "largest_difference": difference}


def http_ping(base_url: str, n_gpu_layers: int) -> dict[str, Any]:
    response = httpx.get(f"{base_url}/ping", timeout=30)
    require(response.status_code == 200, f"/ping answered {response.status_code}")
    body: dict[str, Any] = response.json()
    if n_gpu_layers != 0:
        require(any(map(is_gpu_backend, body["backends"])), f"/ping backends {body['backends']}")
    return body


def http_shared_state(
    client: Invoker, decisions: Sequence[Decision], n_gpu_layers: int, expected: list[list[float]]
) -> dict[str, Any]:
    """`serve` answers a shared request in order, on the GPU, with the in-process numbers."""
    answer: dict[str, Any] = client.invoke(shared_body(decisions))
    ids = [result["id"] for result in answer["results"]]
    require(ids == [decision.id for decision in decisions], f"results in order {ids}")
    serving = answer["model"]["serving"]
    require(serving["n_gpu_layers"] == n_gpu_layers, f"serving {serving}")
    require(serving["gpu_offload"] == (n_gpu_layers != 0), f"serving {serving}")
    _require_distributions(answer)
    difference = _largest_difference(_probabilities(answer), expected)
    require(difference <= TOLERANCE, f"served vs in-process differ by {difference:.4f}")
    return {"timing": answer["timing"], "largest_difference": difference}


def http_prefix_reuse(client: Invoker, first: Decision, second: Decision) -> dict[str, Any]:
    """Across requests `serve` keeps the state: the follow-up evaluates only its suffix."""
    client.invoke(single_body(first))
    warm: dict[str, Any] = client.invoke(single_body(second))
    tokens = warm["result"]["input_tokens"]
    evaluated = warm["timing"]["evaluated_tokens"]
    require(evaluated < tokens / 3, f"{evaluated} of {tokens} tokens evaluated")
    repeat: dict[str, Any] = client.invoke(single_body(second))
    _require_only_the_tail_again(repeat["timing"])
    return {"input_tokens": tokens, "evaluated_tokens": evaluated}


def _require_only_the_tail_again(timing: dict[str, Any]) -> None:
    """A fully resident prompt asked again decodes only its last MIN_ROWS tokens (the exact
    path, adapter.core.layout), never the whole prompt."""
    evaluated = timing["evaluated_tokens"]
    require(1 <= evaluated <= MIN_ROWS, f"a repeated prompt was re-evaluated ({evaluated} tokens)")
