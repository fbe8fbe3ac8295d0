"""The decision request schema (drop-in for the AWS SemIf sample) and its validation.

Every rule violation raises RequestError with the JSON path of the offending field and the
rule it broke, e.g. `decision.options[2].id: duplicate "billing"`, so callers can fix a
request without reading server logs. The field rules themselves live in `adapter.fields`.

Beside `decision`/`decisions` a body may say how to read them (`Policy`): `option_order`
(`adapter.ordering`; the server's SEMIF_OPTION_ORDER when absent) and the abstention
thresholds `min_confidence` (on the top option's probability) and `min_allowed_token_mass`
(on the share of the model's probability that fell on the answer letters). A result below
a threshold still carries its full distribution; it says `abstained: true` and why. And
`readout` (`letters`, or `likelihood` with a `normalization`: adapter.likelihood; the
server's SEMIF_READOUT and SEMIF_NORMALIZATION when absent): a likelihood question may
declare up to MAX_LIKELIHOOD_OPTIONS options, a letter question MAX_OPTIONS. An option may
carry a `label` (up to MAX_LABEL_CHARS): the words the likelihood readout scores as its
answer instead of its description; the letter readout does not read it.

A decision's `kind` is `choice` (one option is the answer; the default) or `multi_label`
(each option judged on its own as applying or not: adapter.multi_label), whose options may
carry a `threshold` (the probability from which an option is said to apply, 0.5 when
absent) and may number from 1 to MAX_MULTI_LABEL_OPTIONS whatever the readout.

A body may carry an `audit_id`: the caller's key that each of its decisions' audit records
carries (adapter.audit), for joining them with labels or with a shadow's records later.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

from adapter import fields
from adapter.errors import RequestError
from adapter.fields import JsonState
from adapter.likelihood import (
    MAX_LIKELIHOOD_OPTIONS,
    READOUTS,
    Readout,
    ReadoutChoice,
)
from model_build.calibration import NORMALIZATIONS, OPTION_ORDERS, Normalization, OptionOrder
from model_build.conformal import METHODS, ConformalMethod

MIN_OPTIONS = 2
MAX_OPTIONS = 16
MAX_ID_CHARS = 256
MAX_AUDIT_ID_CHARS = 128
AUDIT_ID = re.compile(rf"[A-Za-z0-9._:/=+@-]{{1,{MAX_AUDIT_ID_CHARS}}}")
MAX_LABEL_CHARS = 256  # an option's likelihood answer text: a short name, not a paragraph
# Each option of a multi-label question is a prompt of its own (a branch of the shared
# state): the request token budget binds first; the cap keeps a request's plan small.
MAX_MULTI_LABEL_OPTIONS = 255
DEFAULT_THRESHOLD = 0.5  # a multi-label option applies from this probability on
Mode = Literal["single", "shared"]
DecisionKind = Literal["choice", "multi_label"]
DECISION_KINDS: tuple[DecisionKind, ...] = ("choice", "multi_label")


@dataclass(frozen=True)
class Option:
    id: str
    description: str
    # The words the likelihood readout scores as this option's answer instead of the
    # description (adapter.prompts.answer_text); the letter readout does not read it.
    label: str | None = None
    # multi_label only: the probability from which this option is said to apply.
    threshold: float | None = None


@dataclass(frozen=True)
class Decision:
    """One question about a state, with the options the application allows."""

    id: str
    state: JsonState
    question: str
    options: tuple[Option, ...]
    kind: DecisionKind = "choice"
    # The caller's join key for this decision's audit record (the body's `audit_id`): not
    # part of what is asked, so decisions that differ only in it are equal.
    audit_id: str | None = field(default=None, compare=False)

    @property
    def state_text(self) -> str:
        """The state as the model reads it: strings verbatim, JSON compactly and key-ordered
        as sent, so equal states always render to equal prompt prefixes."""
        if isinstance(self.state, str):
            return self.state
        return json.dumps(self.state, ensure_ascii=False)

    @property
    def option_ids(self) -> list[str]:
        return [option.id for option in self.options]


@dataclass(frozen=True)
class Policy:
    """How a request's decisions are read: option order and abstention thresholds."""

    option_order: OptionOrder | None = None  # None: the server's default
    min_confidence: float | None = None
    min_allowed_token_mass: float | None = None
    readout: Readout | None = None  # None: the server's default
    normalization: Normalization | None = None  # None: the server's default
    coverage: float | None = None  # a conformal prediction set's promised coverage
    coverage_method: ConformalMethod = "lac"

    def readout_choice(self, default: ReadoutChoice) -> ReadoutChoice:
        """The readout this policy asks for, the server's `default` filling what it omits."""
        return ReadoutChoice(
            self.readout or default.method, self.normalization or default.normalization
        )

    def abstain_reason(self, confidence: float, mass: float) -> str | None:
        """The threshold a reading falls below (the letter mass first: when the model
        wanted to say something else, its option probabilities mean little), else None.
        `confidence`: a choice's top probability; a multi-label question's least decided
        option's (adapter.multi_label.confidence)."""
        if self.min_allowed_token_mass is not None and mass < self.min_allowed_token_mass:
            return "min_allowed_token_mass"
        if self.min_confidence is not None and confidence < self.min_confidence:
            return "min_confidence"
        return None


DEFAULT_POLICY = Policy()  # the server's option order, no abstention
POLICY_FIELDS = (
    "option_order",
    "min_confidence",
    "min_allowed_token_mass",
    "readout",
    "normalization",
    "coverage",
    "coverage_method",
)


def option_order(
    value: Any, path: str, shape_error: fields.ShapeError = RequestError
) -> OptionOrder:
    """One of the option-order modes; the System One parser shares it."""
    return cast(OptionOrder, fields.one_of(value, path, OPTION_ORDERS, shape_error))


def fraction(entry: dict[str, Any], key: str, path: str | None = None) -> float | None:
    """`entry[key]` as a number from 0 to 1 (None when absent); errors name `path`, the key
    by default."""
    if key not in entry:
        return None
    value = entry[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise RequestError(path or key, "must be a number from 0 to 1")
    return float(value)


def parse_policy(entry: dict[str, Any]) -> Policy:
    """The reading policy beside the decisions (all fields optional)."""
    return Policy(
        option_order=option_order(entry["option_order"], "option_order")
        if "option_order" in entry
        else None,
        min_confidence=fraction(entry, "min_confidence"),
        min_allowed_token_mass=fraction(entry, "min_allowed_token_mass"),
        readout=readout_method(entry["readout"], "readout") if "readout" in entry else None,
        normalization=normalization(entry["normalization"], "normalization")
        if "normalization" in entry
        else None,
        coverage=coverage(entry),
        coverage_method=coverage_method(entry),
    )


def coverage_method(
    entry: dict[str, Any], shape_error: fields.ShapeError = RequestError
) -> ConformalMethod:
    """`lac` (the default) or `aps`; the System One parser shares it."""
    if "coverage_method" not in entry:
        return "lac"
    return cast(
        ConformalMethod,
        fields.one_of(entry["coverage_method"], "coverage_method", METHODS, shape_error),
    )


def coverage(entry: dict[str, Any]) -> float | None:
    """The coverage a prediction set promises: strictly between 0 and 1 (a set that must
    hold the right option always is every option; one that never need is empty)."""
    value = fraction(entry, "coverage")
    if value is not None and not 0 < value < 1:
        raise RequestError("coverage", "must be a number between 0 and 1, both excluded")
    return value


def readout_method(value: Any, path: str, shape_error: fields.ShapeError = RequestError) -> Readout:
    """`letters` or `likelihood`; the System One parser shares it."""
    return cast(Readout, fields.one_of(value, path, READOUTS, shape_error))


def normalization(
    value: Any, path: str, shape_error: fields.ShapeError = RequestError
) -> Normalization:
    """`sum`, `mean` or `pmi`; the System One parser shares it."""
    return cast(Normalization, fields.one_of(value, path, NORMALIZATIONS, shape_error))


def _options(
    container: dict[str, Any], path: str, bounds: tuple[int, int], *, thresholds: bool
) -> tuple[Option, ...]:
    """The options (`bounds`: how few and how many); `thresholds`: whether an option may
    carry one (multi-label questions only)."""
    options_path = f"{path}.options"
    raw = fields.required(container, "options", path)
    if not isinstance(raw, list):
        raise RequestError(options_path, "must be an array")
    fields.count(raw, options_path, *bounds, "options")
    allowed = ("id", "description", "label", *(("threshold",) if thresholds else ()))
    options: list[Option] = []
    seen: set[str] = set()
    for index, item in enumerate(raw):
        item_path = f"{options_path}[{index}]"
        entry = fields.json_object(item, item_path)
        if "threshold" in entry and not thresholds:
            raise RequestError(
                f"{item_path}.threshold", 'only options of a "multi_label" question take one'
            )
        fields.only_fields(entry, item_path, allowed)
        id_path = f"{item_path}.id"
        option_id = fields.text(
            fields.required(entry, "id", item_path), id_path, max_chars=MAX_ID_CHARS
        )
        if option_id in seen:
            raise RequestError(id_path, f"duplicate {json.dumps(option_id)}")
        seen.add(option_id)
        description = fields.required(entry, "description", item_path)
        label = entry.get("label")
        options.append(
            Option(
                option_id,
                fields.text(description, f"{item_path}.description"),
                None
                if label is None
                else fields.text(label, f"{item_path}.label", max_chars=MAX_LABEL_CHARS),
                fraction(entry, "threshold", f"{item_path}.threshold"),
            )
        )
    return tuple(options)


def parse_decision(value: Any, path: str, max_options: int = MAX_OPTIONS) -> Decision:
    """Validate one decision object found at `path` (a choice: up to `max_options`
    options; a multi-label question: 1 to MAX_MULTI_LABEL_OPTIONS)."""
    entry = fields.json_object(value, path)
    fields.only_fields(entry, path, ("id", "state", "question", "options", "kind"))
    kind = cast(
        DecisionKind,
        fields.one_of(entry["kind"], f"{path}.kind", DECISION_KINDS)
        if "kind" in entry
        else "choice",
    )
    multi = kind == "multi_label"
    bounds = (1, MAX_MULTI_LABEL_OPTIONS) if multi else (MIN_OPTIONS, max_options)
    return Decision(
        id=fields.text(fields.required(entry, "id", path), f"{path}.id", max_chars=MAX_ID_CHARS),
        state=fields.state(fields.required(entry, "state", path), f"{path}.state"),
        question=fields.text(fields.required(entry, "question", path), f"{path}.question"),
        options=_options(entry, path, bounds, thresholds=multi),
        kind=kind,
    )


def parse_decisions(value: Any, max_shared: int, max_options: int = MAX_OPTIONS) -> list[Decision]:
    """Validate a shared-state batch: 1..max_shared decisions, one state, unique ids."""
    if not isinstance(value, list) or not value:
        raise RequestError("decisions", "must be a non-empty array")
    if len(value) > max_shared:
        raise RequestError(
            "decisions",
            f"has {len(value)} decisions; the limit is {max_shared} (SEMIF_MAX_SHARED_DECISIONS)",
        )
    decisions = [
        parse_decision(item, f"decisions[{index}]", max_options) for index, item in enumerate(value)
    ]
    first = decisions[0]
    seen: set[str] = set()
    for index, decision in enumerate(decisions):
        if decision.id in seen:
            raise RequestError(f"decisions[{index}].id", f"duplicate {json.dumps(decision.id)}")
        seen.add(decision.id)
        if decision.state_text != first.state_text:
            raise RequestError(
                f"decisions[{index}].state", "must be exactly equal to decisions[0].state"
            )
    return decisions


@dataclass(frozen=True)
class DecisionRequest:
    mode: Mode
    decisions: list[Decision]
    policy: Policy


def parse_decision_body(
    body: Any, max_shared: int, default_readout: Readout = "letters"
) -> DecisionRequest:
    """A decision API body: one decision ("single") or a shared-state batch ("shared"),
    and the policy to read them with (a likelihood readout, the body's or the server's
    `default_readout`, allows more options)."""
    entry = fields.json_object(body, "body")
    has_single, has_shared = "decision" in entry, "decisions" in entry
    if has_single == has_shared:
        raise RequestError("body", 'give exactly one of "decision" or "decisions"')
    asked = "decision" if has_single else "decisions"
    fields.only_fields(entry, "body", (asked, *POLICY_FIELDS, "audit_id"))
    policy = parse_policy(entry)
    likely = (policy.readout or default_readout) == "likelihood"
    most = MAX_LIKELIHOOD_OPTIONS if likely else MAX_OPTIONS
    if has_single:
        decisions = [parse_decision(entry["decision"], "decision", most)]
    else:
        decisions = parse_decisions(entry["decisions"], max_shared, most)
    key = audit_id(entry)
    tagged = [replace(decision, audit_id=key) for decision in decisions]
    return DecisionRequest("single" if has_single else "shared", tagged, policy)


def audit_id(entry: dict[str, Any], shape_error: fields.ShapeError = RequestError) -> str | None:
    """The body's `audit_id`: the caller's key for joining the decisions' audit records
    with labels or a shadow's records later (adapter.audit); the System One parser shares
    it. A word of letters, digits and `._:/=+@-`, so it is safe in any log query."""
    if "audit_id" not in entry:
        return None
    value = entry["audit_id"]
    if not isinstance(value, str) or not AUDIT_ID.fullmatch(value):
        raise shape_error(
            "audit_id",
            f"must be 1 to {MAX_AUDIT_ID_CHARS} characters of letters, digits and ._:/=+@-",
        )
    return value


def decision_paths(mode: Mode, count: int) -> list[str]:
    """How the decision API names each decision in error messages."""
    return ["decision"] if mode == "single" else [f"decisions[{index}]" for index in range(count)]
