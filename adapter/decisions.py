"""The decision API's answers: decisions scored in the policy's option order, shaped as results.

Each API shapes its own wire format beside its parser (this module with adapter/schema.py,
adapter/systemone.py, adapter/chat.py); the service (adapter/service.py) only renders,
limits and scores. Every decision is read as a "choice" question, by letters or by
likelihood (adapter.likelihood) as the policy or the server's default says.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from adapter.calibration import conformal_scores, describe, prediction_set_fields
from adapter.cancel import Cancellation
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
    variants = [Variants.of(d, "choice", order, service.calibration, choice) for d in decisions]
    scores = (
        None
        if policy.coverage is None
        else conformal_scores(service.calibration, choice, "choice", order)
    )
    version = service.likelihood_prompt_version if choice.likelihood else PROMPT_VERSION
    paths = decision_paths(mode, len(decisions))
    readings, batch = service.read_variants(variants, paths, cancel, retry_token=retry_token)
    results = []
    offset = 0
    for variant, reading in zip(variants, readings, strict=True):
        # Per result: tokens its prompts took from resident prefixes, and the rest (rows
        # shared with other prompts count for each; the request's timing counts them once).
        reused = sum(batch.reused_tokens[offset : offset + reading.prompts])
        offset += reading.prompts
        reason = policy.abstain_reason(reading.probabilities, reading.allowed_token_mass)
        conformal: dict[str, Any] = {}
        if scores is not None and policy.coverage is not None:
            conformal = prediction_set_fields(
                scores,
                policy.coverage_method,
                policy.coverage,
                variant.decision.option_ids,
                reading.probabilities,
            )
            if reason is None and conformal["set_size"] != 1:
                reason = "prediction_set"  # acting on it would break the promise
        ids = variant.decision.option_ids
        # Options sharing an answer text, whose probability is split between them.
        clones = answer_clones(variant.decision) if choice.likelihood else []
        shared = {"option_clones": [[ids[i] for i in group] for group in clones]} if clones else {}
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
                **conformal,
                **shared,
                "option_order": order,
                "calibration": describe(service.calibration, variant.correction),
                "input_tokens": reading.input_tokens,
                "prompt_sha256": prompt_sha256(reading.prompt),
                "prompt_version": version,
                "readout": choice.method,
                "normalization": choice.normalization if choice.likelihood else None,
                "readout_detail": choice.describe(),
                "timing": {
                    "prompts": reading.prompts,
                    "evaluated_tokens": reading.input_tokens - reused,
                    "reused_tokens": reused,
                },
            }
        )
    return {"results": results, "timing": batch.timing_json()}
