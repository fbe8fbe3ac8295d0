"""Template priors from unlabelled traffic: Batch Calibration for `semif-calibrate --unlabelled`.

Batch Calibration (Zhou et al., ICLR 2024, "Batch Calibration: Rethinking Calibration for
In-Context Learning and Prompt Engineering"): the model's contextual bias for a question is
estimated by its mean predicted distribution over many inputs of that question, and divided
out (adapter.calibration serves it). Here a question is a template (adapter.template_key:
the question text and the option list, whatever the state), and its prior is the mean, by
option id, of the *uncorrected* distributions of its inputs read in the option-order mode
the prior will be served in: what the server divides it out of. A template with fewer than
`min_inputs` inputs gets no prior (its mean is mostly its inputs' content) and is reported.

Inputs, either:
- audit records (a file or s3:// of log lines: bench.audit_tasks.records), `digest` or
  `full`, of choice questions asked through the decision API (System One's and multi-label
  records are left out and counted). A record's own probabilities are used as they are when
  they are what the prior needs: a choice read by letters in the fit's option order, every
  option kept (`omitted` does not name `options`), uncorrected (no calibration, or one that
  applied temperature 1 and divided out no prior). A `full` record read any other way is
  scored again from its request text; a `digest` record read another way cannot be, and is
  left out and counted by reason. Inverting a served correction instead would need the
  priors the server held, which a record names but does not carry.
- JSON Lines of decision API bodies (what `semif batch` reads): every choice decision is
  scored (its body's option_order and readout are not what the prior is for: it is read by
  letters in the fit's mode); multi-label decisions are left out.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from adapter.errors import RequestError
from adapter.schema import Decision, parse_decision_body
from adapter.template_key import record_template_key, template_key
from bench import audit_tasks
from model_build.calibration import OptionOrder, TemplatePrior, TemplatePriors

MIN_INPUTS = 20  # inputs a template needs for a prior (--min-inputs overrides it)
# The least share a prior gives an option: an option the model never shows would otherwise
# be multiplied without bound when divided by its mean.
PRIOR_FLOOR = 1e-6
# Decisions one request line may hold: the adapter's own ceiling (SEMIF_MAX_SHARED_DECISIONS).
MAX_SHARED = 1024
Vector = npt.NDArray[np.float64]


class BatchPriorError(ValueError):
    """The source cannot give template priors; the message names the line or template."""


@dataclass(frozen=True)
class Observed:
    """One input's uncorrected distribution, by option id, read in the fit's mode."""

    key: str  # its template (adapter.template_key)
    option_ids: tuple[str, ...]
    probabilities: Vector

    @classmethod
    def of(cls, decision: Decision, probabilities: Vector) -> Observed:
        return cls(template_key(decision), tuple(decision.option_ids), probabilities)


@dataclass
class Gathered:
    """What a source gives: distributions to use as they are, decisions to score (their
    distributions are not the ones the prior needs, or were never read), and what was left
    out, by reason."""

    observed: list[Observed] = field(default_factory=list)
    rescore: list[Decision] = field(default_factory=list)
    left_out: Counter[str] = field(default_factory=Counter)
    prompt_versions: set[str] = field(default_factory=set)


def fit_priors(
    observed: Sequence[Observed],
    mode: OptionOrder,
    source_sha256: str,
    min_inputs: int = MIN_INPUTS,
) -> tuple[TemplatePriors, dict[str, int]]:
    """Each template's prior (the mean of its inputs' distributions, floored at PRIOR_FLOOR
    and renormalised), and the templates left out for having fewer than `min_inputs`
    inputs, with how many they had."""
    groups: dict[str, list[Observed]] = {}
    for item in observed:
        groups.setdefault(item.key, []).append(item)
    templates: dict[str, TemplatePrior] = {}
    too_few: dict[str, int] = {}
    for key, group in groups.items():
        ids = group[0].option_ids
        if any(item.option_ids != ids for item in group):
            raise BatchPriorError(f"template {key}: its inputs name different options")
        if len(group) < min_inputs:
            too_few[key] = len(group)
            continue
        mean = np.maximum(np.mean([item.probabilities for item in group], axis=0), PRIOR_FLOOR)
        prior = tuple(float(value) for value in mean / mean.sum())
        templates[key] = TemplatePrior(ids, prior, len(group))
    return TemplatePriors(mode, source_sha256, templates), too_few


def from_records(found: Iterable[Mapping[str, Any]], mode: OptionOrder) -> Gathered:
    """Audit records as distributions for the prior or decisions to score again (see the
    module docstring for which is which)."""
    gathered = Gathered()
    for record in found:
        name = f"{record.get('request_id')}/{record.get('decision_id')}"
        if record.get("api", "decision") != "decision":
            gathered.left_out["not a decision API record"] += 1
            continue
        if record.get("kind", "choice") != "choice":
            gathered.left_out["not a choice question"] += 1
            continue
        reason = unusable(record, mode)
        key = record_template_key(record)
        if reason is None and key is not None:
            probabilities = np.asarray(record["probabilities"], np.float64)
            gathered.observed.append(Observed(key, tuple(record["option_ids"]), probabilities))
            gathered.prompt_versions.add(str(record.get("prompt_version")))
        elif isinstance(record.get("request"), Mapping):
            gathered.rescore.append(recorded_decision(record["request"], name))
        else:
            gathered.left_out[reason or "no template hashes"] += 1
    return gathered


def unusable(record: Mapping[str, Any], mode: OptionOrder) -> str | None:
    """Why a record's probabilities are not the uncorrected distribution in `mode` that a
    prior is the mean of, or None when they are."""
    if "options" in record.get("omitted", ()):
        return "options left out of the record"
    if record.get("readout", "letters") != "letters":
        return "read by likelihood"
    if record.get("option_order") != mode:
        return f"read in option order {record.get('option_order')}"
    calibration = record.get("calibration")
    if isinstance(calibration, Mapping) and (
        calibration.get("temperature") != 1.0
        or calibration.get("position_prior")
        or calibration.get("template_prior")
    ):
        return "corrected by the calibration in force"
    return None


def recorded_decision(request: Mapping[str, Any], name: str) -> Decision:
    """A full record's decision as sent (its request text), to score again."""
    try:
        return audit_tasks.recorded_decision(request, name)
    except RequestError as error:
        raise BatchPriorError(f"record {name}: its request is malformed: {error}") from None


def request_decisions(lines: Iterable[str], source: str) -> Gathered:
    """The choice decisions of JSON Lines decision API bodies, all to be scored."""
    gathered = Gathered()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            request = parse_decision_body(json.loads(line), MAX_SHARED)
        except (json.JSONDecodeError, RequestError) as error:
            raise BatchPriorError(f"{source}:{number}: not a decision request: {error}") from None
        for decision in request.decisions:
            if decision.kind == "choice":
                gathered.rescore.append(decision)
            else:
                gathered.left_out["not a choice question"] += 1
    return gathered
