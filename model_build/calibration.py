"""The calibration file: what `semif-calibrate` fits and `model-build` packs into the manifest.

One definition for three users: `semif-calibrate` writes it, `model-build --calibration FILE`
records it as the manifest's `calibration` section, and the adapter applies it (refusing it
at start when it was fitted under another prompt version: a stale calibration is worse than
none). `parse_calibration` is pure and raises `CalibrationError` naming the field.

Format (schema version 1, documented in docs/manifest.md):
    {"schema_version": 1,
     "prompt_version": "semif-direct-options/1",
     "option_order": "canonical",               # as_given | canonical | debiased
     "temperatures": {"choice": 1.2, "noul": 0.9, "score": 1.0},
     "position_prior": {"2": [0.55, 0.45], "3": [0.4, 0.35, 0.25]},  # optional
     "tasks_sha256": "<64 hex>",
     "counts": {"choice": 40, "noul": 12, "score": 0},
     "metrics": {...}}                           # free-form report of the fit
`temperatures` holds one softmax temperature per question kind (System One's kinds; the
decision API's decisions are "choice"); a kind without one keeps 1.0. `position_prior[n]`
is the model's prior over answer positions for n options, divided out in canonical mode.
An optional `likelihood` section calibrates the likelihood readout (adapter.likelihood):
    "likelihood": {"prompt_version": "semif-option-likelihood/1",
                   "temperatures": {"mean": {"choice": 0.8, "noul": 1.1}, "sum": {...}}}
one temperature per normalization and question kind, for the likelihood prompt it names.
An optional `conformal` section holds what serving prediction sets needs, per readout
(`letters`, `likelihood:<normalization>`): model_build.conformal.
An optional `template_priors` section holds Batch Calibration priors fitted from unlabelled
traffic (`semif-calibrate --unlabelled`), per question template:
    "template_priors": {"option_order": "canonical", "source_sha256": "<64 hex>",
                        "templates": {"<question_sha256>:<options_sha256>":
                                      {"option_ids": ["a", "b"], "prior": [0.6, 0.4],
                                       "inputs": 120}}}
a template's key is adapter.template_key's (the hashes audit records carry); its prior is
the mean uncorrected distribution over its inputs, by option id, read in `option_order`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from model_build.conformal import ConformalError, ConformalSection, parse_conformal

CALIBRATION_SCHEMA_VERSION = 1
# multi_label: each option judged on its own as applying or not (adapter.multi_label).
QuestionKind = Literal["choice", "noul", "score", "multi_label"]
QUESTION_KINDS: tuple[QuestionKind, ...] = ("choice", "noul", "score", "multi_label")
OptionOrder = Literal["as_given", "canonical", "debiased"]
OPTION_ORDERS: tuple[OptionOrder, ...] = ("as_given", "canonical", "debiased")
# The likelihood readout's normalizations (adapter.likelihood), named here so the format
# can validate them without the adapter.
Normalization = Literal["sum", "mean", "pmi"]
NORMALIZATIONS: tuple[Normalization, ...] = ("sum", "mean", "pmi")
MAX_PRIOR_OPTIONS = 260
# Templates a calibration may hold priors for: the manifest is read at every start and
# answered from memory, so it stays bounded (at 16 options a template is about 0.5 KiB).
MAX_TEMPLATE_PRIORS = 10_000
# The readouts a conformal section is fitted for: letters, and likelihood per normalization.
CONFORMAL_READOUTS = ("letters", *(f"likelihood:{name}" for name in NORMALIZATIONS))
_SHA256 = re.compile(r"[0-9a-f]{64}")
_TEMPLATE_KEY = re.compile(r"[0-9a-f]{64}:[0-9a-f]{64}")
Name = TypeVar("Name", bound=str)


class CalibrationError(ValueError):
    """The calibration document is not valid; the message names the field."""


@dataclass(frozen=True)
class LikelihoodCalibration:
    """Temperatures for the likelihood readout, per normalization and question kind, fitted
    under the likelihood prompt `prompt_version`."""

    prompt_version: str
    temperatures: dict[Normalization, dict[QuestionKind, float]]

    def temperature(self, normalization: Normalization, kind: QuestionKind) -> float | None:
        """The fitted temperature, or None where this fit has none."""
        return self.temperatures.get(normalization, {}).get(kind)


@dataclass(frozen=True)
class TemplatePrior:
    """One question template's prior: the mean uncorrected distribution over its inputs."""

    option_ids: tuple[str, ...]  # the template's options, in the caller's order
    prior: tuple[float, ...]  # by option id (`option_ids[i]`), positive, summing to 1
    inputs: int  # how many inputs it is the mean of


@dataclass(frozen=True)
class TemplatePriors:
    """Batch Calibration priors per question template, all read in `option_order`, fitted
    from the unlabelled traffic whose sha256 is `source_sha256`."""

    option_order: OptionOrder
    source_sha256: str
    templates: dict[str, TemplatePrior]  # by "<question_sha256>:<options_sha256>"

    def to_document(self) -> dict[str, Any]:
        return {
            "option_order": self.option_order,
            "source_sha256": self.source_sha256,
            "templates": {
                key: {
                    "option_ids": list(fitted.option_ids),
                    "prior": list(fitted.prior),
                    "inputs": fitted.inputs,
                }
                for key, fitted in self.templates.items()
            },
        }


@dataclass(frozen=True)
class Calibration:
    """Per-kind temperatures and position priors fitted on labelled decisions; template
    priors (optional) fitted on unlabelled ones."""

    prompt_version: str
    option_order: OptionOrder
    temperatures: dict[QuestionKind, float]
    tasks_sha256: str
    counts: dict[QuestionKind, int] = field(default_factory=dict)
    position_prior: dict[int, tuple[float, ...]] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    likelihood: LikelihoodCalibration | None = None
    conformal: dict[str, ConformalSection] = field(default_factory=dict)  # by readout
    template_priors: TemplatePriors | None = None

    def temperature(self, kind: QuestionKind) -> float:
        return self.temperatures.get(kind, 1.0)

    def to_document(self) -> dict[str, Any]:
        """The JSON form (prior keys as strings, as JSON requires)."""
        document = asdict(self)
        document["position_prior"] = {
            str(count): list(prior) for count, prior in self.position_prior.items()
        }
        if self.likelihood is None:
            del document["likelihood"]  # absent, as in files written before the section
        # The optional sections are absent unless fitted: older files hash as before.
        del document["conformal"], document["template_priors"]
        if self.conformal:
            document["conformal"] = {
                readout: section.to_document() for readout, section in self.conformal.items()
            }
        if self.template_priors is not None:
            document["template_priors"] = self.template_priors.to_document()
        return {"schema_version": CALIBRATION_SCHEMA_VERSION, **document}

    def to_json(self) -> str:
        return json.dumps(self.to_document(), indent=2, sort_keys=True, allow_nan=False) + "\n"


def parse_calibration(document: object, where: str = "calibration") -> Calibration:
    """Validate decoded calibration JSON and return it typed; raises `CalibrationError`."""
    root = _mapping(document, where)
    if root.get("schema_version") != CALIBRATION_SCHEMA_VERSION:
        raise CalibrationError(
            f"{where}.schema_version: {root.get('schema_version')!r} is not supported "
            f"(expected {CALIBRATION_SCHEMA_VERSION})"
        )
    prompt_version = root.get("prompt_version")
    if not isinstance(prompt_version, str) or not prompt_version:
        raise CalibrationError(f"{where}.prompt_version: required, a non-empty string")
    option_order = _option_order(root, where)
    tasks_sha256 = _sha256(root, "tasks_sha256", where)
    metrics = root.get("metrics", {})
    if not isinstance(metrics, Mapping):
        raise CalibrationError(f"{where}.metrics: expected an object")
    return Calibration(
        prompt_version=prompt_version,
        option_order=option_order,
        temperatures=_temperatures(_mapping(root.get("temperatures"), f"{where}.temperatures")),
        tasks_sha256=tasks_sha256,
        counts=_counts(_mapping(root.get("counts", {}), f"{where}.counts"), where),
        position_prior=_priors(
            _mapping(root.get("position_prior", {}), f"{where}.position_prior"), where
        ),
        metrics=dict(metrics),
        likelihood=None
        if root.get("likelihood") is None
        else _likelihood(_mapping(root["likelihood"], f"{where}.likelihood"), where),
        conformal=_conformal(root.get("conformal", {}), f"{where}.conformal"),
        template_priors=None
        if root.get("template_priors") is None
        else _template_priors(_mapping(root["template_priors"], f"{where}.template_priors"), where),
    )


def load_calibration(path: Path) -> Calibration:
    """Read and validate a calibration file."""
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CalibrationError(f"{path}: cannot read calibration: {exc}") from None
    try:
        return parse_calibration(document)
    except CalibrationError as error:
        raise CalibrationError(f"{path}: {error}") from None


def _option_order(section: Mapping[str, Any], where: str) -> OptionOrder:
    value = section.get("option_order")
    for order in OPTION_ORDERS:
        if value == order:
            return order
    raise CalibrationError(
        f"{where}.option_order: {value!r} is not one of {', '.join(OPTION_ORDERS)}"
    )


def _sha256(section: Mapping[str, Any], key: str, where: str) -> str:
    value = section.get(key)
    if not isinstance(value, str) or not _SHA256.fullmatch(value):
        raise CalibrationError(f"{where}.{key}: expected 64 lowercase hex digits")
    return value


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise CalibrationError(f"{where}: expected an object")
    return value


def _member(key: str, allowed: tuple[Name, ...], where: str, what: str) -> Name:
    """`key` as one of `allowed` (a question kind, a normalization), else an error naming
    the field and the choices."""
    for name in allowed:
        if key == name:
            return name
    raise CalibrationError(f"{where}: {key!r} is not a {what} ({', '.join(allowed)})")


def _kind(key: str, where: str) -> QuestionKind:
    return _member(key, QUESTION_KINDS, where, "question kind")


def _temperatures(
    section: Mapping[str, Any], where: str = "calibration.temperatures"
) -> dict[QuestionKind, float]:
    temperatures: dict[QuestionKind, float] = {}
    for key, value in section.items():
        kind = _kind(key, where)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or not 0.01 <= value <= 100
        ):
            raise CalibrationError(f"{where}.{key}: must be a number in 0.01..100, got {value!r}")
        temperatures[kind] = float(value)
    return temperatures


def _likelihood(section: Mapping[str, Any], where: str) -> LikelihoodCalibration:
    path = f"{where}.likelihood"
    prompt_version = section.get("prompt_version")
    if not isinstance(prompt_version, str) or not prompt_version:
        raise CalibrationError(f"{path}.prompt_version: required, a non-empty string")
    temperatures: dict[Normalization, dict[QuestionKind, float]] = {}
    for key, value in _mapping(section.get("temperatures"), f"{path}.temperatures").items():
        normalization = _member(key, NORMALIZATIONS, f"{path}.temperatures", "normalization")
        kinds_path = f"{path}.temperatures.{key}"
        temperatures[normalization] = _temperatures(_mapping(value, kinds_path), kinds_path)
    return LikelihoodCalibration(prompt_version, temperatures)


def _conformal(section: object, where: str) -> dict[str, ConformalSection]:
    try:
        return parse_conformal(
            _mapping(section, where),
            where,
            readouts=CONFORMAL_READOUTS,
            kinds=QUESTION_KINDS,
            orders=OPTION_ORDERS,
        )
    except ConformalError as error:
        raise CalibrationError(str(error)) from None


def _counts(section: Mapping[str, Any], where: str) -> dict[QuestionKind, int]:
    counts: dict[QuestionKind, int] = {}
    for key, value in section.items():
        kind = _kind(key, f"{where}.counts")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CalibrationError(f"{where}.counts.{key}: must be a count >= 0")
        counts[kind] = value
    return counts


def _priors(section: Mapping[str, Any], where: str) -> dict[int, tuple[float, ...]]:
    priors: dict[int, tuple[float, ...]] = {}
    for key, values in section.items():
        path = f"{where}.position_prior.{key}"
        if not key.isdigit() or not 2 <= int(key) <= MAX_PRIOR_OPTIONS:
            raise CalibrationError(f"{path}: keys are option counts 2..{MAX_PRIOR_OPTIONS}")
        priors[int(key)] = _distribution(values, int(key), path)
    return priors


def _distribution(values: object, count: int, path: str) -> tuple[float, ...]:
    """`count` positive numbers summing to 1 (within 1e-3), renormalised exactly."""
    if (
        not isinstance(values, list)
        or len(values) != count
        or not all(_positive(value) for value in values)
    ):
        raise CalibrationError(f"{path}: expected {count} positive numbers")
    total = float(sum(values))
    if abs(total - 1.0) > 1e-3:
        raise CalibrationError(f"{path}: must sum to 1, sums to {total:.6g}")
    return tuple(float(v) / total for v in values)


def _template_priors(section: Mapping[str, Any], where: str) -> TemplatePriors:
    path = f"{where}.template_priors"
    option_order = _option_order(section, path)
    source_sha256 = _sha256(section, "source_sha256", path)
    templates = _mapping(section.get("templates"), f"{path}.templates")
    if len(templates) > MAX_TEMPLATE_PRIORS:
        raise CalibrationError(
            f"{path}.templates: {len(templates)} templates; at most {MAX_TEMPLATE_PRIORS}"
        )
    return TemplatePriors(
        option_order,
        source_sha256,
        {
            key: _template_prior(key, entry, f"{path}.templates.{key}")
            for key, entry in templates.items()
        },
    )


def _template_prior(key: str, entry: object, path: str) -> TemplatePrior:
    if not _TEMPLATE_KEY.fullmatch(key):
        raise CalibrationError(f"{path}: keys are <question_sha256>:<options_sha256>, hex")
    fitted = _mapping(entry, path)
    ids = fitted.get("option_ids")
    if (
        not isinstance(ids, list)
        or not 2 <= len(ids) <= MAX_PRIOR_OPTIONS
        or not all(isinstance(option, str) and option for option in ids)
    ):
        raise CalibrationError(
            f"{path}.option_ids: expected 2..{MAX_PRIOR_OPTIONS} non-empty strings"
        )
    if len(set(ids)) != len(ids):
        raise CalibrationError(f"{path}.option_ids: ids must be unique")
    inputs = fitted.get("inputs")
    if isinstance(inputs, bool) or not isinstance(inputs, int) or inputs < 1:
        raise CalibrationError(f"{path}.inputs: must be a count >= 1")
    prior = _distribution(fitted.get("prior"), len(ids), f"{path}.prior")
    return TemplatePrior(tuple(ids), prior, inputs)


def _positive(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )
