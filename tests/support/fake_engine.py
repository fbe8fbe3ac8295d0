"""An engine that only records what the scheduler asks of it, for scheduler tests.

It has what adapter.core.scheduler reads of a `LlamaEngine` (pass_rows, max_branches, stream_cells,
prefix_reuse, score, held, start_generation). Every pass waits for `release` (set it to let the
worker run; `entered` tells that a pass is waiting), then is recorded. Time is a
`FakeClock` that moves only while it works (a pass, a chat token): put the clock in place
of adapter.core.scheduler's `time` and expiries follow the schedule, not this machine's speed.
Each prompt's score is `identity(prompt)`, so answers can be checked against prompts.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adapter.core.engine import BatchTiming, PromptScore
from adapter.core.generation import Sampling
from adapter.core.layout import common_prefix_length

PASS_SECONDS = 1.0  # fake time a pass takes
TOKEN_SECONDS = 0.25  # fake time a chat token takes


class FakeClock:
    """monotonic() that moves only when `advance` says."""

    def __init__(self) -> None:
        self.now = 1000.0
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


def identity(prompt: Sequence[int]) -> float:
    """The score the fake engine gives a prompt: its own."""
    return float(hash(tuple(prompt)) % 1_000_003)


@dataclass(frozen=True)
class Pass:
    """One recorded pass."""

    prompts: tuple[tuple[int, ...], ...]
    continuations: tuple[tuple[int, ...], ...]
    continuing: bool
    started: float  # on the engine's clock
    chat_tokens_before: int  # chat tokens generated before it


class FakeRun:
    """A generation that ends after `length` steps, each one chat token."""

    def __init__(self, engine: FakeEngine, length: int) -> None:
        self.engine, self.length, self.steps = engine, length, 0

    def step(self) -> bool:
        self.steps += 1
        self.engine.chat_tokens += 1
        self.engine.clock.advance(TOKEN_SECONDS)
        return self.steps >= self.length

    def result(self) -> int:
        return self.steps

    def close(self) -> None:
        pass


@dataclass
class FakeEngine:
    """What the scheduler reads of an engine; see the module docstring."""

    pass_rows: int = 1024
    max_branches: int = 16
    prefix_reuse: bool = True
    clock: FakeClock = field(default_factory=FakeClock)
    stream_cells: int = 256  # a whole-stream copy is charged as one row (layout.price)
    passes: list[Pass] = field(default_factory=list)
    chat_tokens: int = 0
    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def score(
        self,
        prompts: Sequence[Sequence[int]],
        continuations: Sequence[Sequence[int]],
        *,
        continuing: bool,
        boundaries: Sequence[Sequence[int]] = (),
        scored: Sequence[int] = (),
        after: Sequence[Sequence[int]] = (),
    ) -> tuple[list[PromptScore], BatchTiming]:
        started = self.clock.monotonic()
        self.entered.set()
        assert self.release.wait(10)
        self.passes.append(
            Pass(
                tuple(tuple(p) for p in prompts),
                tuple(tuple(c) for c in continuations),
                continuing,
                started,
                self.chat_tokens,
            )
        )
        self.clock.advance(PASS_SECONDS)
        scores = [PromptScore(np.array([identity(p)], np.float32), len(p)) for p in prompts]
        return scores, BatchTiming(sum(map(len, prompts)), 0, 0, 0, PASS_SECONDS)

    def held(self, tokens: Sequence[int]) -> int:
        """The longest prefix of `tokens` a prompt scored before begins with (a cache that
        never forgets)."""
        return max((common_prefix_length(p, tokens) for p in self.scored()), default=0)

    def start_generation(
        self, prompt: Sequence[int], *, max_new_tokens: int, sampling: Sampling, stop: Any
    ) -> FakeRun:
        return FakeRun(self, max_new_tokens)

    def scored(self) -> list[tuple[int, ...]]:
        """Every prompt decoded, in order."""
        return [prompt for one in self.passes for prompt in one.prompts]
