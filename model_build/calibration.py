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
# The readouts a conformal section is fitted for: letters, and likelihood per normalization.
CONFORMAL_READOUTS = ("letters", *(f"likelihood:{name}" for name in NORMALIZATIONS))
_SHA256 = re.compile(r"[0-9a-f]{64}")
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
class Calibration:
    """Per-kind temperatures and position priors fitted on labelled decisions."""

    prompt_version: str
    option_order: OptionOrder
    temperatures: dict[QuestionKind, float]
    tasks_sha256: str
    counts: dict[QuestionKind, int] = field(default_factory=dict)
    position_prior: dict[int, tuple[float, ...]] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    likelihood: LikelihoodCalibration | None = None
    conformal: dict[str, ConformalSection] = field(default_factory=dict)  # by readout

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
        del document["conformal"]  # absent unless fitted: older files hash as before
        if self.conformal:
            document["conformal"] = {
                readout: section.to_document() for readout, section in self.conformal.items()
            }
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
    option_order = root.get("option_order")
    if option_order not in OPTION_ORDERS:
        raise CalibrationError(
            f"{where}.option_order: {option_order!r} is not one of {', '.join(OPTION_ORDERS)}"
        )
    tasks_sha256 = root.get("tasks_sha256")
    if not isinstance(tasks_sha256, str) or not _SHA256.fullmatch(tasks_sha256):
        raise CalibrationError(f"{where}.tasks_sha256: expected 64 lowercase hex digits")
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
        count = int(key)
        if (
            not isinstance(values, list)
            or len(values) != count
            or not all(_positive(value) for value in values)
        ):
            raise CalibrationError(f"{path}: expected {count} positive numbers")
        total = float(sum(values))
        if abs(total - 1.0) > 1e-3:
            raise CalibrationError(f"{path}: must sum to 1, sums to {total:.6g}")
        priors[count] = tuple(float(v) / total for v in values)
    return priors


def _positive(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )
