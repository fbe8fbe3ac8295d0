"""Decisions in, results out: prompts, token limits, scoring and readout around the engine.

This is the one place that turns validated decisions into the response contract, so every
HTTP route (and the benchmarks) scores through the same code.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from adapter.engine import BatchTiming, LlamaEngine, NativeFailureError
from adapter.prompts import PROMPT_VERSION, prompt_sha256, render_decision
from adapter.readout import READOUT, NonFiniteLogitsError, read_slots
from adapter.schema import Decision, Mode, RequestError


@dataclass
class Health:
    """Whether the native side can still be trusted; /ping reports it."""

    healthy: bool = True
    error: str | None = None


@dataclass
class DecisionService:
    """Scores decisions with one engine; the lock serialises use of its single context."""

    engine: LlamaEngine
    max_tokens: int
    model: dict[str, Any]
    health: Health = field(default_factory=Health)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def render(self, decisions: Sequence[Decision], mode: Mode) -> list[tuple[str, list[int]]]:
        """Render and tokenize each decision, refusing any prompt over the token limit."""
        prompts = []
        for index, decision in enumerate(decisions):
            text = render_decision(self.engine.chat_template, decision)
            tokens = self.engine.tokenize(text)
            if len(tokens) > self.max_tokens:
                path = "decision" if mode == "single" else f"decisions[{index}]"
                raise RequestError(
                    path,
                    f"prompt is {len(tokens)} tokens; the limit is {self.max_tokens} "
                    "(SEMIF_MAX_TOKENS); shorten the state, question or options",
                )
            prompts.append((text, tokens))
        return prompts

    def decide(self, decisions: Sequence[Decision], mode: Mode) -> dict[str, Any]:
        """Score every decision; a shared batch evaluates its common prefix once."""
        started = time.perf_counter()
        with self._lock:
            waited = time.perf_counter() - started
            prompts = self.render(decisions, mode)
            try:
                scores, timing = self.engine.score([tokens for _, tokens in prompts])
                readouts = [
                    read_slots(score.logits, self.engine.slot_token_ids[: len(decision.options)])
                    for score, decision in zip(scores, decisions, strict=True)
                ]
            except (NativeFailureError, NonFiniteLogitsError) as error:
                self.health.healthy = False
                self.health.error = str(error)
                raise
        results = []
        for decision, (text, _), score, readout in zip(
            decisions, prompts, scores, readouts, strict=True
        ):
            # A shared prefix is evaluated once for the batch; each result counts its suffix.
            evaluated = score.input_tokens - timing.prefix_tokens
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
                    "input_tokens": score.input_tokens,
                    "prompt_sha256": prompt_sha256(text),
                    "prompt_version": PROMPT_VERSION,
                    "readout": READOUT,
                    "timing": {
                        "evaluated_tokens": evaluated,
                        "reused_tokens": score.input_tokens - evaluated,
                    },
                }
            )
        return {
            "results": results,
            "timing": _timing(timing, waited, time.perf_counter() - started),
        }


def _timing(timing: BatchTiming, queue_seconds: float, total_seconds: float) -> dict[str, Any]:
    return {
        "prefix_tokens": timing.prefix_tokens,
        "reused_tokens": timing.reused_tokens,
        "suffix_tokens": timing.suffix_tokens,
        "evaluated_tokens": timing.prefix_tokens - timing.reused_tokens + timing.suffix_tokens,
        "prefill_seconds": round(timing.prefill_seconds, 6),
        "suffix_seconds": round(timing.suffix_seconds, 6),
        "branch_waves": timing.branch_waves,
        "queue_seconds": round(queue_seconds, 6),
        "total_seconds": round(total_seconds, 6),
    }
