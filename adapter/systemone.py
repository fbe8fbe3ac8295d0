"""The System One (`/v1/systemone`) wire format, translated onto the decision engine.

Each question becomes a decision about the request's one state, so every question shares
the state's token prefix and all are scored in one batched engine call:
- noul: two options, "true" then "false" (their criteria descriptions, else Yes / No);
  the answer is P(true);
- choice: the options in request order, described by their criteria (null: the key);
- score: the levels in order, low to high; the answer is the expected level.
Question keys are never shown to the model (only instructions and descriptions are), so
renaming a key cannot change an answer.

Confidence, the same formula for choice and score: 1 - H(p) / ln(N), where H is the
Shannon entropy of the N option probabilities. It is 1 when all mass is on one option and
0 when the distribution is uniform, so it is comparable across option counts.

Errors: `SchemaError` (422) when the JSON does not have the format's shape, `RequestError`
(400) when it does but breaks a rule (counts, empty text); both name the field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from adapter.readout import SlotReadout
from adapter.schema import Decision, JsonState, Option, RequestError
from adapter.service import DecisionService, ScoredBatch

Kind = Literal["noul", "choice", "score"]
KINDS: tuple[Kind, ...] = ("noul", "choice", "score")
MIN_CHOICES, MAX_CHOICES = 2, 255
MIN_LEVELS, MAX_LEVELS = 2, 10
NOUL_DEFAULTS = {"true": "Yes", "false": "No"}


class SchemaError(RequestError):
    """The body does not match the System One schema (HTTP 422)."""


@dataclass(frozen=True)
class Question:
    """One System One question and the decision the model is asked."""

    key: str
    kind: Kind
    decision: Decision


@dataclass(frozen=True)
class SystemOneRequest:
    model: str | None
    questions: list[Question]


def _object(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise SchemaError(path, "must be a JSON object")
    return value


def _only(value: Mapping[str, Any], path: str, allowed: tuple[str, ...]) -> None:
    for key in value:
        if key not in allowed:
            raise SchemaError(f"{path}.{key}", f"unknown field; allowed: {', '.join(allowed)}")


def _text(value: Any, path: str) -> str:
    """A string (else 422) that is not blank (else 400)."""
    if not isinstance(value, str):
        raise SchemaError(path, "must be a string")
    if not value.strip():
        raise RequestError(path, "must not be empty")
    return value


def _state(body: Mapping[str, Any]) -> JsonState:
    if "state" not in body:
        raise SchemaError("state", "is required")
    state = body["state"]
    if not isinstance(state, str | dict | list):
        raise SchemaError("state", "must be a string, a JSON object or an array")
    if not (state.strip() if isinstance(state, str) else state):
        raise RequestError("state", "must not be empty")
    return state


def _count(items: Sequence[Any] | Mapping[str, Any], path: str, low: int, high: int) -> None:
    if not low <= len(items) <= high:
        raise RequestError(path, f"has {len(items)} entries; allowed {low}..{high}")


def _noul(criteria: Any, path: str) -> tuple[Option, ...]:
    if criteria is None:
        return tuple(Option(key, text) for key, text in NOUL_DEFAULTS.items())
    entry = _object(criteria, path)
    _only(entry, path, tuple(NOUL_DEFAULTS))
    return tuple(
        Option(key, _text(entry[key], f"{path}.{key}") if key in entry else default)
        for key, default in NOUL_DEFAULTS.items()
    )


def _choice(criteria: Any, path: str) -> tuple[Option, ...]:
    entry = _object(criteria, path)
    _count(entry, path, MIN_CHOICES, MAX_CHOICES)
    options = []
    for key, description in entry.items():
        if not key.strip():
            raise RequestError(path, "option keys must not be empty")
        text = key if description is None else _text(description, f"{path}.{key}")
        options.append(Option(key, text))
    return tuple(options)


def _score(criteria: Any, path: str) -> tuple[Option, ...]:
    if not isinstance(criteria, list):
        raise SchemaError(path, "must be an array of level descriptions, low to high")
    _count(criteria, path, MIN_LEVELS, MAX_LEVELS)
    return tuple(
        Option(str(level), _text(text, f"{path}[{level}]")) for level, text in enumerate(criteria)
    )


def _question(key: str, value: Any, state: JsonState) -> Question:
    path = f"questions.{key}"
    entry = _object(value, path)
    _only(entry, path, ("type", "instructions", "criteria"))
    kind = entry.get("type")
    if kind not in KINDS:
        raise SchemaError(f"{path}.type", f"must be one of {', '.join(KINDS)}")
    if "instructions" not in entry:
        raise SchemaError(f"{path}.instructions", "is required")
    instructions = _text(entry["instructions"], f"{path}.instructions")
    criteria_path = f"{path}.criteria"
    if kind != "noul" and "criteria" not in entry:
        raise SchemaError(criteria_path, "is required")
    options = question_options(kind, entry.get("criteria"), criteria_path)
    return Question(key, kind, Decision(key, state, instructions, options))


def question_options(kind: Kind, criteria: Any, path: str) -> tuple[Option, ...]:
    """The ordered options a question of `kind` declares: noul true/false, choice keys,
    score levels "0".."N-1". Shared with the benchmark task format, which uses the same
    question objects."""
    if kind == "noul":
        return _noul(criteria, path)
    if kind == "choice":
        return _choice(criteria, path)
    return _score(criteria, path)


def parse_systemone(body: Any, max_questions: int) -> SystemOneRequest:
    """Validate a System One request; every error names the offending field."""
    entry = _object(body, "body")
    _only(entry, "body", ("model", "state", "questions"))
    model = entry.get("model")
    if model is not None and not isinstance(model, str):
        raise SchemaError("model", "must be a string")
    state = _state(entry)
    if "questions" not in entry:
        raise SchemaError("questions", "is required")
    questions = _object(entry["questions"], "questions")
    _count(questions, "questions", 1, max_questions)
    for key in questions:
        if not key.strip():
            raise RequestError("questions", "question keys must not be empty")
    parsed = [_question(key, value, state) for key, value in questions.items()]
    return SystemOneRequest(model=model, questions=parsed)


def confidence(probabilities: Sequence[float]) -> float:
    """1 - H(p) / ln(N): 1 for a certain answer, 0 for a uniform one."""
    entropy = -sum(p * math.log(p) for p in probabilities if p > 0)
    return min(1.0, max(0.0, 1.0 - entropy / math.log(len(probabilities))))


def shape_answer(question: Question, readout: SlotReadout) -> dict[str, Any]:
    """One answer in the System One response shape."""
    probabilities = readout.probabilities
    options = question.decision.options
    if question.kind == "noul":
        return {"type": "noul", "noul": probabilities[0]}
    keyed = {option.id: p for option, p in zip(options, probabilities, strict=True)}
    if question.kind == "choice":
        return {
            "type": "choice",
            "choice": max(keyed, key=keyed.__getitem__),
            "probabilities": keyed,
            "confidence": confidence(probabilities),
        }
    return {
        "type": "score",
        "score": sum(level * p for level, p in enumerate(probabilities)),
        "legend": {option.id: option.description for option in options},
        "probabilities": keyed,
        "confidence": confidence(probabilities),
    }


def answer(
    service: DecisionService, request: SystemOneRequest
) -> tuple[dict[str, Any], ScoredBatch]:
    """Score all questions in one engine call and shape the System One response.

    `usage.input_tokens` counts the shared state prefix once; nothing is generated.
    """
    questions = request.questions
    batch = service.score(
        [question.decision for question in questions],
        [f"questions.{question.key}" for question in questions],
    )
    response = {
        "model": served_model_id(service),
        "answers": {
            question.key: shape_answer(question, readout)
            for question, readout in zip(questions, batch.readouts, strict=True)
        },
        "usage": {"input_tokens": batch.distinct_input_tokens, "output_tokens": 0},
    }
    return response, batch


def served_model_id(service: DecisionService) -> str:
    """The name clients see in responses and in GET /v1/models: the GGUF file name."""
    return str(service.model.get("file", "unknown"))
