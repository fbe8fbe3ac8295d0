"""The one door to the engine: prompts, the token limit, scoring, readout and generation.

Every HTTP route (and the benchmarks) reaches the model through this service, so the token
limit is checked in one place, the engine's lock is taken in one place, and a native
failure marks the service unhealthy in one place.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from adapter.engine import (
    BatchTiming,
    CancelledWorkError,
    CapacityError,
    Generation,
    LlamaEngine,
    NativeFailureError,
    Sampling,
)
from adapter.errors import RequestError, UnavailableError
from adapter.labels import LabelError, LabelSet
from adapter.prompts import (
    PROMPT_VERSION,
    ChatTemplate,
    RenderedPrompt,
    TemplateRenderError,
    answer_labels,
    prompt_sha256,
    render_chat_prompt,
    render_decision_prompt,
)
from adapter.readout import READOUT, NonFiniteLogitsError, SlotReadout, read_labels
from adapter.schema import Decision, Mode


@dataclass
class Health:
    """Whether the native side can still be trusted; /ping reports it."""

    healthy: bool = True
    error: str | None = None


@dataclass(frozen=True)
class ScoredBatch:
    """Readouts of one engine call, in request order, with how the work was done."""

    prompts: list[str]
    input_tokens: list[int]
    readouts: list[SlotReadout]
    timing: BatchTiming
    queue_seconds: float
    total_seconds: float

    @property
    def distinct_input_tokens(self) -> int:
        """Prompt tokens with the shared prefix counted once."""
        return self.timing.prefix_tokens + self.timing.suffix_tokens

    def timing_json(self) -> dict[str, Any]:
        timing = self.timing
        return {
            "prefix_tokens": timing.prefix_tokens,
            "reused_tokens": timing.reused_tokens,
            "suffix_tokens": timing.suffix_tokens,
            "evaluated_tokens": timing.prefix_tokens - timing.reused_tokens + timing.suffix_tokens,
            "prefill_seconds": round(timing.prefill_seconds, 6),
            "suffix_seconds": round(timing.suffix_seconds, 6),
            "branch_waves": timing.branch_waves,
            "queue_seconds": round(self.queue_seconds, 6),
            "total_seconds": round(self.total_seconds, 6),
        }


@dataclass
class DecisionService:
    """Scores decisions with one engine; the lock serialises use of its single context."""

    engine: LlamaEngine
    template: ChatTemplate
    labels: LabelSet
    max_tokens: int
    model: dict[str, Any]
    temperature: float = 1.0  # calibration.temperature from the model's manifest
    health: Health = field(default_factory=Health)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _closed: bool = False

    @property
    def model_id(self) -> str:
        """The name clients see in responses and in GET /v1/models: the GGUF file name."""
        return str(self.model.get("file", "unknown"))

    @contextmanager
    def exclusive(self) -> Iterator[float]:
        """Hold the engine (yielding the seconds waited for it). A native failure marks the
        service unhealthy so /ping takes the instance out of service; a batch that does not
        fit the KV cache is a retryable 503."""
        started = time.perf_counter()
        with self._lock:
            if self._closed:  # a call that queued behind close() must not touch freed memory
                raise UnavailableError("the server is shutting down", retryable=True)
            try:
                yield time.perf_counter() - started
            except (NativeFailureError, NonFiniteLogitsError) as error:
                self.health.healthy = False
                self.health.error = str(error)
                raise
            except CapacityError as error:
                raise UnavailableError(str(error), retryable=True) from None
            except CancelledWorkError as error:
                raise UnavailableError(str(error), retryable=True) from None

    def close(self, wait_seconds: float) -> bool:
        """Free the engine once no call holds it; False (and nothing freed) if one still
        runs after `wait_seconds` (the process is exiting: leaking beats a use-after-free)."""
        if not self._lock.acquire(timeout=wait_seconds):
            return False
        try:
            self._closed = True
            self.engine.close()
        finally:
            self._lock.release()
        return True

    def tokenize_prompt(self, prompt: RenderedPrompt, path: str, hint: str = "") -> list[int]:
        """Tokenize a rendered prompt (request spans as plain text), refusing one over
        SEMIF_MAX_TOKENS (the one check)."""
        tokens = self.engine.tokenize_prompt(prompt.text, prompt.user_spans)
        if len(tokens) > self.max_tokens:
            raise RequestError(
                path,
                f"prompt is {len(tokens)} tokens; the limit is {self.max_tokens} "
                f"(SEMIF_MAX_TOKENS){hint}",
            )
        return tokens

    def render(self, decisions: Sequence[Decision], mode: Mode) -> list[tuple[str, list[int]]]:
        """Render and tokenize each decision, refusing any prompt over the token limit."""
        return self._render(decisions, _paths(mode, len(decisions)))

    def _render(
        self, decisions: Sequence[Decision], paths: Sequence[str]
    ) -> list[tuple[str, list[int]]]:
        prompts = []
        for decision, path in zip(decisions, paths, strict=True):
            try:
                prompt = render_decision_prompt(self.template, decision)
            except (TemplateRenderError, ValueError) as error:
                raise RequestError(path, str(error)) from None
            hint = "; shorten the state, question or options"
            prompts.append((prompt.text, self.tokenize_prompt(prompt, path, hint)))
        return prompts

    def _labels(self, decision: Decision, path: str) -> list[tuple[int, ...]]:
        try:
            return self.labels.token_ids(answer_labels(len(decision.options)))
        except LabelError as error:
            raise RequestError(path, str(error)) from None

    def score(self, decisions: Sequence[Decision], paths: Sequence[str]) -> ScoredBatch:
        """Score decisions of any size (2..260 options) in one engine call.

        `paths` name each decision in errors. Decisions about one state share its prefix;
        options labelled with two tokens get their second-token logits in the same batch.
        """
        started = time.perf_counter()
        with self.exclusive() as waited:
            prompts = self._render(decisions, paths)
            labels = [self._labels(d, path) for d, path in zip(decisions, paths, strict=True)]
            firsts = [sorted({label[0] for label in group if len(label) > 1}) for group in labels]
            token_lists = [tokens for _, tokens in prompts]
            # Only two-token labels need continuations; letters keep the plain call.
            scores, timing = (
                self.engine.score(token_lists, firsts)
                if any(firsts)
                else self.engine.score(token_lists)
            )
            readouts = [
                read_labels(score.logits, score.next_logits, group, self.temperature)
                for score, group in zip(scores, labels, strict=True)
            ]
        return ScoredBatch(
            prompts=[text for text, _ in prompts],
            input_tokens=[score.input_tokens for score in scores],
            readouts=readouts,
            timing=timing,
            queue_seconds=waited,
            total_seconds=time.perf_counter() - started,
        )

    def decide(self, decisions: Sequence[Decision], mode: Mode) -> dict[str, Any]:
        """Score every decision; a shared batch evaluates its common prefix once."""
        batch = self.score(decisions, _paths(mode, len(decisions)))
        timing = batch.timing
        results = []
        for decision, text, input_tokens, readout in zip(
            decisions, batch.prompts, batch.input_tokens, batch.readouts, strict=True
        ):
            # A shared prefix is evaluated once for the batch; each result counts its suffix.
            evaluated = input_tokens - timing.prefix_tokens
            if mode == "single":
                evaluated += timing.prefix_tokens - timing.reused_tokens
            results.append(
                {
                    "id": decision.id,
                    "option_ids": decision.option_ids,
                    "probabilities": readout.probabilities,
                    "option_logits": readout.option_logits,
                    "allowed_token_mass": readout.allowed_token_mass,
                    "top_token": self.engine.piece(readout.top_token_id),
                    "input_tokens": input_tokens,
                    "prompt_sha256": prompt_sha256(text),
                    "prompt_version": PROMPT_VERSION,
                    "readout": READOUT,
                    "timing": {
                        "evaluated_tokens": evaluated,
                        "reused_tokens": input_tokens - evaluated,
                    },
                }
            )
        return {"results": results, "timing": batch.timing_json()}

    def generate(
        self,
        messages: Sequence[dict[str, str]],
        *,
        max_new_tokens: int,
        sampling: Sampling,
        stop: Sequence[str],
    ) -> Generation:
        """Chat: render the messages, check the prompt limit, and generate while holding the
        engine."""
        with self.exclusive():
            try:
                prompt = render_chat_prompt(self.template, messages)
            except (TemplateRenderError, ValueError) as error:
                raise RequestError("messages", str(error)) from None
            return self.engine.generate(
                self.tokenize_prompt(prompt, "messages"),
                max_new_tokens=max_new_tokens,
                sampling=sampling,
                stop=stop,
            )


def _paths(mode: Mode, count: int) -> list[str]:
    """How the decision API names each decision in error messages."""
    return ["decision"] if mode == "single" else [f"decisions[{index}]" for index in range(count)]
