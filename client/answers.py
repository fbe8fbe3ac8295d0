"""What a 2xx answer says: the JSON (or JSON Lines) body parsed, and the typed results the
client hands back (a decision, System One answers, a chat completion).

Parsing is apart from the transports that fetch the bytes and from the client that picks
which result to build, so each answer's shape is read in one place.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from client.errors import EndpointError
from client.wire import JSON, JSON_LINES


@dataclass(frozen=True)
class DecisionResult:
    """One decision's answer: probabilities over the options, in the request's order."""

    id: str
    option_ids: list[str]
    probabilities: list[float]
    allowed_token_mass: float
    input_tokens: int
    prompt_sha256: str
    raw: dict[str, Any] = field(repr=False)
    readout: str = "letters"  # or "likelihood" (then `raw["normalization"]` says which)
    # Asked with a coverage: the conformal prediction set (option ids, request order) and
    # the coverage it promises; `raw["conformal"]` says what backs it.
    prediction_set: list[str] | None = None
    coverage: float | None = None
    # A multi-label question: each option's own probability (they need not sum to 1), the
    # options at or above their thresholds, and the probability that none applies.
    kind: str = "choice"
    applies: list[str] | None = None
    none_probability: float | None = None

    @classmethod
    def from_json(cls, result: Mapping[str, Any]) -> DecisionResult:
        members = result.get("prediction_set")
        applies = result.get("applies")
        none = result.get("none_probability")
        return cls(
            kind=str(result.get("kind", "choice")),
            applies=None if applies is None else [str(member) for member in applies],
            none_probability=None if none is None else float(none),
            readout=str(result.get("readout", "letters")),
            prediction_set=None if members is None else [str(member) for member in members],
            coverage=None if result.get("coverage") is None else float(result["coverage"]),
            id=result["id"],
            option_ids=list(result["option_ids"]),
            probabilities=[float(p) for p in result["probabilities"]],
            allowed_token_mass=float(result["allowed_token_mass"]),
            input_tokens=int(result["input_tokens"]),
            prompt_sha256=result["prompt_sha256"],
            raw=dict(result),
        )

    @property
    def choice(self) -> str:
        """The most probable option id (the first one on a tie; of a multi-label question,
        the option most likely to apply)."""
        best = max(range(len(self.probabilities)), key=self.probabilities.__getitem__)
        return self.option_ids[best]

    def probability(self, option_id: str) -> float:
        return self.probabilities[self.option_ids.index(option_id)]


@dataclass(frozen=True)
class NoulAnswer:
    yes: float  # P(yes)


@dataclass(frozen=True)
class ChoiceAnswer:
    choice: str
    probabilities: dict[str, float]
    confidence: float


@dataclass(frozen=True)
class ScoreAnswer:
    score: float  # expected level, 0..N-1
    legend: dict[str, str]
    probabilities: dict[str, float]
    confidence: float


@dataclass(frozen=True)
class MultiAnswer:
    """A multi question: the keys that apply, each key's own probability of applying."""

    applies: list[str]
    probabilities: dict[str, float]
    none_probability: float
    confidence: float  # the least decided key's max(p, 1 - p)


SystemOneAnswer = NoulAnswer | ChoiceAnswer | ScoreAnswer | MultiAnswer


def _system_one_answer(answer: Mapping[str, Any]) -> SystemOneAnswer:
    kind = answer["type"]
    if kind == "noul":
        return NoulAnswer(yes=float(answer["noul"]))
    probabilities = {key: float(p) for key, p in answer["probabilities"].items()}
    if kind == "choice":
        return ChoiceAnswer(answer["choice"], probabilities, float(answer["confidence"]))
    if kind == "multi":
        return MultiAnswer(
            [str(key) for key in answer["multi"]],
            probabilities,
            float(answer["none_probability"]),
            float(answer["confidence"]),
        )
    if kind == "score":
        return ScoreAnswer(
            float(answer["score"]),
            dict(answer["legend"]),
            probabilities,
            float(answer["confidence"]),
        )
    raise EndpointError(200, f"unknown System One answer type {kind!r}", answer)


@dataclass(frozen=True)
class SystemOneAnswers:
    """Answers keyed like the request's questions."""

    model: str
    answers: dict[str, SystemOneAnswer]
    input_tokens: int
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> SystemOneAnswers:
        return cls(
            model=body["model"],
            answers={key: _system_one_answer(value) for key, value in body["answers"].items()},
            input_tokens=int(body["usage"]["input_tokens"]),
            raw=dict(body),
        )

    def __getitem__(self, key: str) -> SystemOneAnswer:
        return self.answers[key]


@dataclass(frozen=True)
class ChatCompletion:
    id: str
    model: str
    content: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ChatCompletion:
        choice = body["choices"][0]
        return cls(
            id=body["id"],
            model=body["model"],
            content=choice["message"]["content"],
            finish_reason=choice["finish_reason"],
            prompt_tokens=int(body["usage"]["prompt_tokens"]),
            completion_tokens=int(body["usage"]["completion_tokens"]),
            raw=dict(body),
        )


def parse_answer(text: str | bytes, content_type: str = JSON) -> Any:
    """The 2xx answer: one JSON value, or for a JSON Lines request the list of its lines."""
    try:
        if content_type == JSON_LINES:
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        return json.loads(text)
    except ValueError:
        raise EndpointError(200, "the endpoint answered with invalid JSON", text) from None
