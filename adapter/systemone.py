"""The System One (`/v1/systemone`) wire format, translated onto the decision engine.

Each question becomes a decision about the request's one state, so every question shares
the state's token prefix and all are scored in one batched engine call:
- noul: two options, "true" then "false" (their criteria descriptions, else Yes / No);
  the answer is P(true);
- choice: the options in request order, described by their criteria (null: the key);
- score: the levels in order, low to high; the answer is the expected level;
- multi: keyed options as choice's (from one), each judged on its own as applying or not
  (adapter.multi_label); the answer is the keys at or above the question's optional
  `threshold` (0.5), with each key's probability (they need not sum to 1), the
  probability that none applies and the least decided key's confidence (max(p, 1 - p)).
Question keys are never shown to the model (only instructions and descriptions are), so
renaming a key cannot change an answer. An optional top-level `option_order` (as_given,
canonical, debiased; `adapter.ordering`) overrides the server's SEMIF_OPTION_ORDER; score
levels keep their order in every mode. The model's calibration applies each kind's own
temperature (`adapter.calibration`); the answers keep the format's exact shape. Optional
top-level `readout` and `normalization` (adapter.likelihood; the server's SEMIF_READOUT and
SEMIF_NORMALIZATION when absent) say how choice and noul questions are read; score
questions are always read by letters (their levels are positions), multi questions too (a
prompt per key). An optional top-level
`coverage` (with `coverage_method`, as in the decision API) adds to every answer a conformal
prediction set of option keys (noul: "true", "false"), from the calibration's section for
the question's kind and readout; without one, a 400 naming `coverage`. An optional
`audit_id`, as in the decision API, goes into every question's audit record
(adapter.audit), whose `decision_id` is the question's key.

Confidence, the same formula for choice and score: 1 - H(p) / ln(N), where H is the
Shannon entropy of the N option probabilities. It is 1 when all mass is on one option and
0 when the distribution is uniform, so it is comparable across option counts.

Errors: `SchemaError` (422) when the JSON does not have the format's shape, `RequestError`
(400) when it does but breaks a rule (counts, empty text); both name the field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from adapter import fields, multi_label
from adapter.calibration import conformal_scores, prediction_set_fields
from adapter.cancel import Cancellation
from adapter.errors import RequestError, SchemaError
from adapter.fields import JsonState, member_path
from adapter.likelihood import LETTERS, Readout, ReadoutChoice
from adapter.ordering import Variants
from adapter.provenance import reading_fields, reused_per_reading
from adapter.schema import (
    Decision,
    Option,
    audit_id,
    coverage,
    coverage_method,
    fraction,
    normalization,
    option_order,
    readout_method,
)
from model_build.calibration import Normalization, OptionOrder, QuestionKind
from model_build.conformal import ConformalMethod

if TYPE_CHECKING:  # the parser loads no model (the JSON Lines planner uses it)
    from adapter.service import DecisionService, ScoredBatch

# What a question's audit record copies of its answer: the prediction set asked for.
_SET_FIELDS = ("prediction_set", "coverage", "coverage_method")

Kind = Literal["noul", "choice", "score", "multi"]
KINDS: tuple[Kind, ...] = ("noul", "choice", "score", "multi")
# How the calibration and the metrics name each kind (a multi question is multi-label).
QUESTION_KIND: dict[Kind, QuestionKind] = {
    "noul": "noul",
    "choice": "choice",
    "score": "score",
    "multi": "multi_label",
}
MIN_CHOICES, MAX_CHOICES = 2, 255
MIN_LEVELS, MAX_LEVELS = 2, 10
NOUL_DEFAULTS = {"true": "Yes", "false": "No"}


@dataclass(frozen=True)
class Question:
    """One System One question and the decision the model is asked."""

    key: str
    kind: Kind
    decision: Decision

    @property
    def question_kind(self) -> QuestionKind:
        return QUESTION_KIND[self.kind]


@dataclass(frozen=True)
class SystemOneRequest:
    model: str | None
    questions: list[Question]
    option_order: OptionOrder | None = None  # None: the server's default
    readout: Readout | None = None  # choice and noul questions; None: the server's default
    normalization: Normalization | None = None
    coverage: float | None = None  # a prediction set on every answer
    coverage_method: ConformalMethod = "lac"

    def readout_for(self, question: Question, default: ReadoutChoice) -> ReadoutChoice:
        """How `question` is read: score and multi questions by letters, the others as
        asked."""
        if question.kind in ("score", "multi"):
            return LETTERS
        return ReadoutChoice(
            self.readout or default.method, self.normalization or default.normalization
        )


def _text(value: Any, path: str) -> str:
    return fields.text(value, path, shape_error=SchemaError)


def _noul(criteria: Any, path: str) -> tuple[Option, ...]:
    if criteria is None:
        return tuple(Option(key, text) for key, text in NOUL_DEFAULTS.items())
    entry = fields.json_object(criteria, path, SchemaError)
    fields.only_fields(entry, path, tuple(NOUL_DEFAULTS), SchemaError)
    return tuple(
        Option(key, _text(entry[key], member_path(path, key)) if key in entry else default)
        for key, default in NOUL_DEFAULTS.items()
    )


def _choice(
    criteria: Any, path: str, fewest: int = MIN_CHOICES, threshold: float | None = None
) -> tuple[Option, ...]:
    """Keyed options (a choice's, or a multi question's each with its `threshold`)."""
    entry = fields.json_object(criteria, path, SchemaError)
    fields.count(entry, path, fewest, MAX_CHOICES)
    options = []
    for key, description in entry.items():
        if not key.strip():
            raise RequestError(member_path(path, key), "option keys must not be empty")
        text = key if description is None else _text(description, member_path(path, key))
        options.append(Option(key, text, threshold=threshold))
    return tuple(options)


def _score(criteria: Any, path: str) -> tuple[Option, ...]:
    if not isinstance(criteria, list):
        raise SchemaError(path, "must be an array of level descriptions, low to high")
    fields.count(criteria, path, MIN_LEVELS, MAX_LEVELS)
    return tuple(
        Option(str(level), _text(text, f"{path}[{level}]")) for level, text in enumerate(criteria)
    )


def _question(key: str, value: Any, state: JsonState, audit_key: str | None) -> Question:
    path = member_path("questions", key)
    entry = fields.json_object(value, path, SchemaError)
    kind = entry.get("type")
    if kind not in KINDS:
        raise SchemaError(f"{path}.type", f"must be one of {', '.join(KINDS)}")
    allowed = ("type", "instructions", "criteria", *(("threshold",) if kind == "multi" else ()))
    fields.only_fields(entry, path, allowed, SchemaError)
    instructions = _text(
        fields.required(entry, "instructions", path, SchemaError), f"{path}.instructions"
    )
    criteria_path = f"{path}.criteria"
    if kind != "noul" and "criteria" not in entry:
        raise SchemaError(criteria_path, "is required")
    limit = fraction(entry, "threshold", f"{path}.threshold")
    options = question_options(kind, entry.get("criteria"), criteria_path, limit)
    decision = Decision(key, state, instructions, options, audit_id=audit_key)
    if kind == "multi":
        decision = replace(decision, kind="multi_label")
    return Question(key, kind, decision)


def question_options(
    kind: Kind, criteria: Any, path: str, threshold: float | None = None
) -> tuple[Option, ...]:
    """The ordered options a question of `kind` declares: noul true/false, choice and multi
    keys (multi: from one, each with the question's `threshold`), score levels "0".."N-1".
    Shared with the benchmark task format, which uses the same question objects."""
    if kind == "noul":
        return _noul(criteria, path)
    if kind == "choice":
        return _choice(criteria, path)
    if kind == "multi":
        return _choice(criteria, path, fewest=1, threshold=threshold)
    return _score(criteria, path)


def parse_systemone(body: Any, max_questions: int) -> SystemOneRequest:
    """Validate a System One request; every error names the offending field."""
    entry = fields.json_object(body, "body", SchemaError)
    allowed = (
        "model",
        "state",
        "questions",
        "option_order",
        "readout",
        "normalization",
        "coverage",
        "coverage_method",
        "audit_id",
    )
    fields.only_fields(entry, "body", allowed, SchemaError)
    model = entry.get("model")
    if model is not None and not isinstance(model, str):
        raise SchemaError("model", "must be a string")
    if "state" not in entry:
        raise SchemaError("state", "is required")
    state = fields.state(entry["state"], "state", SchemaError)
    if "questions" not in entry:
        raise SchemaError("questions", "is required")
    questions = fields.json_object(entry["questions"], "questions", SchemaError)
    fields.count(questions, "questions", 1, max_questions)
    for key in questions:
        if not key.strip():
            raise RequestError(member_path("questions", key), "question keys must not be empty")
    audit_key = audit_id(entry, SchemaError)
    parsed = [_question(key, value, state, audit_key) for key, value in questions.items()]
    order = entry.get("option_order")
    return SystemOneRequest(
        model=model,
        questions=parsed,
        option_order=None if order is None else option_order(order, "option_order", SchemaError),
        readout=readout_method(entry["readout"], "readout", SchemaError)
        if "readout" in entry
        else None,
        normalization=normalization(entry["normalization"], "normalization", SchemaError)
        if "normalization" in entry
        else None,
        coverage=coverage(entry),
        coverage_method=coverage_method(entry, SchemaError),
    )


def confidence(probabilities: Sequence[float]) -> float:
    """1 - H(p) / ln(N): 1 for a certain answer, 0 for a uniform one."""
    entropy = -sum(p * math.log(p) for p in probabilities if p > 0)
    return min(1.0, max(0.0, 1.0 - entropy / math.log(len(probabilities))))


def shape_answer(question: Question, probabilities: Sequence[float]) -> dict[str, Any]:
    """One answer in the System One response shape, from its options' probabilities."""
    options = question.decision.options
    if question.kind == "noul":
        return {"type": "noul", "noul": probabilities[0]}
    keyed = {option.id: p for option, p in zip(options, probabilities, strict=True)}
    if question.kind == "multi":
        judged = multi_label.answer_fields(question.decision, probabilities)
        return {
            "type": "multi",
            "multi": judged["applies"],
            "probabilities": keyed,
            "none_probability": judged["none_probability"],
            "confidence": multi_label.confidence(probabilities),
        }
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


@dataclass(frozen=True)
class SystemOneAnswer:
    """The response, the batch it was scored in, and per question what its audit record
    keeps (the response's exact shape has no room for how each was read)."""

    response: dict[str, Any]
    batch: ScoredBatch
    readings: list[dict[str, Any]]  # per question: option ids, probabilities, how read


def answer(
    service: DecisionService,
    request: SystemOneRequest,
    cancel: Cancellation | None = None,
    *,
    retry_token: str | None = None,
) -> SystemOneAnswer:
    """Score all questions in one engine call and shape the System One response
    (`retry_token`: the caller's place in the retry line, DecisionService.score).

    `usage.input_tokens` counts the shared state prefix once (and every debiased rotation's
    suffix); nothing is generated.
    """
    questions = request.questions
    mode = request.option_order or service.option_order
    choices = [request.readout_for(question, service.readout) for question in questions]
    variants = [
        Variants.of(question.decision, question.question_kind, mode, service.calibration, choice)
        for question, choice in zip(questions, choices, strict=True)
    ]
    # Checked before scoring: a set no calibration backs is refused, never answered.
    scores = [
        None
        if request.coverage is None
        else conformal_scores(service.calibration, variant.readout, variant.kind, variant.mode)
        for variant in variants
    ]
    readings, batch = service.read_variants(
        variants,
        [member_path("questions", question.key) for question in questions],
        cancel,
        retry_token=retry_token,
    )
    answers, read = {}, []
    reused = reused_per_reading(readings, batch)
    for question, variant, reading, held, own in zip(
        questions, variants, readings, scores, reused, strict=True
    ):
        keys = [option.id for option in question.decision.options]
        answers[question.key] = shape_answer(question, reading.probabilities)
        if held is not None and request.coverage is not None:
            answers[question.key] |= prediction_set_fields(
                held,
                request.coverage_method,
                request.coverage,
                keys,
                reading.probabilities,
                each_alone=question.kind == "multi",
            )
        read.append(
            {
                "option_ids": keys,
                "probabilities": reading.probabilities,
                **{k: v for k, v in answers[question.key].items() if k in _SET_FIELDS},
                "kind": variant.kind,
                **reading_fields(service, variant, reading, own),
            }
        )
    response = {
        "model": service.model_id,
        "answers": answers,
        "usage": {"input_tokens": batch.distinct_input_tokens, "output_tokens": 0},
    }
    return SystemOneAnswer(response, batch, read)
