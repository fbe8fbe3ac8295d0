"""The decision API's answers: decisions scored in the policy's option order, shaped as results.

Each API shapes its own wire format beside its parser (this module with adapter/schema.py,
adapter/systemone.py, adapter/chat.py); the service (adapter/service.py) only renders,
limits and scores. A decision is read as its kind says: a "choice" by letters or by
likelihood (adapter.likelihood) as the policy or the server's default says, a
"multi_label" question by letters, a prompt per option (adapter.multi_label).
A streamed request (`on_result`) hears each result as soon as its decision is scored, the
first decision alone in the first pass; the results are the same, bit for bit, as when the
request is answered whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from adapter.calibration import conformal_scores, prediction_set_fields
from adapter.cancel import Cancellation
from adapter.multi_label import answer_fields, confidence
from adapter.ordering import Reading, Variants
from adapter.prompts import answer_clones
from adapter.provenance import reading_fields, reused_per_reading
from adapter.schema import DEFAULT_POLICY, Decision, Mode, Policy, decision_paths
from adapter.service import DecisionService
from model_build.calibration import QuestionKind
from model_build.conformal import ConformalScores

# Hears each result of a streamed request: (its decision's index in the request, the result).
ResultObserver = Callable[[int, dict[str, Any]], None]


def decide(
    service: DecisionService,
    decisions: Sequence[Decision],
    mode: Mode,
    policy: Policy = DEFAULT_POLICY,
    cancel: Cancellation | None = None,
    *,
    retry_token: str | None = None,
    on_result: ResultObserver | None = None,
) -> dict[str, Any]:
    """Score every decision in the policy's option order (adapter.ordering), all in one
    batch: a shared prefix, and every debiased rotation, is evaluated once. `retry_token`
    is the caller's place in the retry line (DecisionService.score); `on_result` hears each
    result as it is ready (a streamed request)."""
    choice = policy.readout_choice(service.readout)
    # Read by likelihood, options are always listed in the content-derived order.
    order = "canonical" if choice.likelihood else policy.option_order or service.option_order
    variants = [Variants.of(d, d.kind, order, service.calibration, choice) for d in decisions]
    # The held-out scores each kind asked for draws its sets from (a 400 before scoring
    # when the calibration has none).
    scores = {
        variant.kind: conformal_scores(
            service.calibration, variant.readout, variant.kind, variant.mode
        )
        for variant in variants
        if policy.coverage is not None
    }

    told: dict[int, dict[str, Any]] = {}  # a streamed request's results, as told

    def shaped(index: int, reading: Reading, reused: int) -> dict[str, Any]:
        if index not in told:
            told[index] = result(service, variants[index], reading, reused, policy, scores)
        return told[index]

    def heard(index: int, reading: Reading, reused: int) -> None:
        if on_result is not None:
            on_result(index, shaped(index, reading, reused))

    paths = decision_paths(mode, len(decisions))
    readings, batch = service.read_variants(
        variants,
        paths,
        cancel,
        retry_token=retry_token,
        on_reading=None if on_result is None else heard,
    )
    reused = reused_per_reading(readings, batch)
    results = [
        shaped(index, *pair) for index, pair in enumerate(zip(readings, reused, strict=True))
    ]
    return {"results": results, "timing": batch.timing_json()}


def result(
    service: DecisionService,
    variant: Variants,
    reading: Reading,
    reused: int,
    policy: Policy,
    scores: Mapping[QuestionKind, ConformalScores],
) -> dict[str, Any]:
    """One decision's result: its distribution, the abstention the policy asks for, the
    prediction set, and how it was read (`reused`: the tokens its prompts took from
    resident prefixes; rows shared with other prompts count for each)."""
    multi = variant.kind == "multi_label"
    sure = confidence(reading.probabilities) if multi else max(reading.probabilities)
    reason = policy.abstain_reason(sure, reading.allowed_token_mass)
    extra = answer_fields(variant.decision, reading.probabilities) if multi else {}
    if policy.coverage is not None:
        extra |= prediction_set_fields(
            scores[variant.kind],
            policy.coverage_method,
            policy.coverage,
            variant.decision.option_ids,
            reading.probabilities,
            each_alone=multi,
        )
        # Acting on a choice's set of more than one would break the promise; a
        # multi-label set is the options that may apply, of any size.
        if reason is None and extra["set_size"] != 1 and not multi:
            reason = "prediction_set"
    ids = variant.decision.option_ids
    # Options sharing an answer text, whose probability is split between them.
    clones = answer_clones(variant.decision) if variant.readout.likelihood else []
    if clones:
        extra["option_clones"] = [[ids[i] for i in group] for group in clones]
    return {
        "id": variant.decision.id,
        "option_ids": ids,
        "probabilities": reading.probabilities,
        "option_logits": reading.option_logits,
        "allowed_token_mass": reading.allowed_token_mass,
        "top_token": service.piece(reading.top_token_id),
        "abstained": reason is not None,
        "abstain_reason": reason,
        **extra,
        **reading_fields(service, variant, reading, reused),
    }
