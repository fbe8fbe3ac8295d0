"""The decision API's answers: decisions scored in the policy's option order, shaped as results.

Each API shapes its own wire format beside its parser (this module with adapter/schema.py,
adapter/systemone.py, adapter/chat.py); the service (adapter/service.py) only renders,
limits and scores. A decision is read as its kind says: a "choice" by letters or by
likelihood (adapter.likelihood) as the policy or the server's default says, a
"multi_label" question by letters, a prompt per option (adapter.multi_label).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from adapter.calibration import conformal_scores, describe, prediction_set_fields
from adapter.cancel import Cancellation
from adapter.multi_label import READOUT_DETAIL, answer_fields, confidence
from adapter.ordering import Variants
from adapter.prompts import PROMPT_VERSION, answer_clones, prompt_sha256
from adapter.schema import DEFAULT_POLICY, Decision, Mode, Policy, decision_paths
from adapter.service import DecisionService


def decide(
    service: DecisionService,
    decisions: Sequence[Decision],
    mode: Mode,
    policy: Policy = DEFAULT_POLICY,
    cancel: Cancellation | None = None,
    *,
    retry_token: str | None = None,
) -> dict[str, Any]:
    """Score every decision in the policy's option order (adapter.ordering), all in one
    batch: a shared prefix, and every debiased rotation, is evaluated once. `retry_token`
    is the caller's place in the retry line (DecisionService.score)."""
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
    paths = decision_paths(mode, len(decisions))
    readings, batch = service.read_variants(variants, paths, cancel, retry_token=retry_token)
    results = []
    offset = 0
    for variant, reading in zip(variants, readings, strict=True):
        # Per result: tokens its prompts took from resident prefixes, and the rest (rows
        # shared with other prompts count for each; the request's timing counts them once).
        reused = sum(batch.reused_tokens[offset : offset + reading.prompts])
        offset += reading.prompts
        multi = variant.kind == "multi_label"
        read = variant.readout
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
        clones = answer_clones(variant.decision) if read.likelihood else []
        if clones:
            extra["option_clones"] = [[ids[i] for i in group] for group in clones]
        version = service.likelihood_prompt_version if read.likelihood else PROMPT_VERSION
        results.append(
            {
                "id": variant.decision.id,
                "option_ids": variant.decision.option_ids,
                "probabilities": reading.probabilities,
                "option_logits": reading.option_logits,
                "allowed_token_mass": reading.allowed_token_mass,
                "top_token": service.piece(reading.top_token_id),
                "abstained": reason is not None,
                "abstain_reason": reason,
                **extra,
                "option_order": variant.mode,
                "calibration": describe(service.calibration, variant.correction),
                "input_tokens": reading.input_tokens,
                "prompt_sha256": prompt_sha256(reading.prompt),
                "prompt_version": version,
                "readout": read.method,
                "normalization": read.normalization if read.likelihood else None,
                "readout_detail": READOUT_DETAIL if multi else read.describe(),
                "timing": {
                    "prompts": reading.prompts,
                    "evaluated_tokens": reading.input_tokens - reused,
                    "reused_tokens": reused,
                },
            }
        )
    return {"results": results, "timing": batch.timing_json()}
