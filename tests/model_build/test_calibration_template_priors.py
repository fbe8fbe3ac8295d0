"""The calibration file's `template_priors` section: written and read back unchanged, absent
unless fitted (older files hash as before), and every invalid field named."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from typing import Any

import pytest

from model_build import calibration as format_module
from model_build.calibration import (
    Calibration,
    CalibrationError,
    TemplatePrior,
    TemplatePriors,
    parse_calibration,
)

KEY = f"{'1' * 64}:{'2' * 64}"
BASE = Calibration("semif-direct-options/1", "canonical", {"choice": 1.5}, "a" * 64)
PRIORS = TemplatePriors(
    "debiased", "b" * 64, {KEY: TemplatePrior(("yes", "no"), (0.75, 0.25), inputs=40)}
)


def document() -> dict[str, Any]:
    return replace(BASE, template_priors=PRIORS).to_document()


def test_template_priors_round_trip_and_are_absent_unless_fitted() -> None:
    written = document()
    assert written["template_priors"] == {
        "option_order": "debiased",
        "source_sha256": "b" * 64,
        "templates": {KEY: {"option_ids": ["yes", "no"], "prior": [0.75, 0.25], "inputs": 40}},
    }
    parsed = parse_calibration(json.loads(json.dumps(written)))
    assert parsed.template_priors == PRIORS
    assert "template_priors" not in BASE.to_document()
    assert parse_calibration(BASE.to_document()).template_priors is None


def _set(path: list[str], value: Any) -> dict[str, Any]:
    changed = copy.deepcopy(document())
    holder = changed["template_priors"]
    for step in path[:-1]:
        holder = holder[step]
    holder[path[-1]] = value
    return changed


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        (["option_order"], "sorted", "calibration.template_priors.option_order: 'sorted'"),
        (["source_sha256"], "B" * 64, "calibration.template_priors.source_sha256"),
        (["templates"], [], "calibration.template_priors.templates: expected an object"),
        (["templates", KEY, "option_ids"], ["yes", "yes"], f"{KEY}.option_ids: ids must be"),
        (["templates", KEY, "option_ids"], ["yes"], f"{KEY}.option_ids: expected 2..260"),
        (["templates", KEY, "option_ids"], ["yes", ""], f"{KEY}.option_ids: expected"),
        (["templates", KEY, "prior"], [0.7, 0.2], f"{KEY}.prior: must sum to 1"),
        (["templates", KEY, "prior"], [1.0, 0.0], f"{KEY}.prior: expected 2 positive"),
        (["templates", KEY, "prior"], [0.5, 0.25, 0.25], f"{KEY}.prior: expected 2 positive"),
        (["templates", KEY, "inputs"], 0, f"{KEY}.inputs: must be a count >= 1"),
        (["templates", KEY, "inputs"], True, f"{KEY}.inputs: must be a count >= 1"),
    ],
)
def test_an_invalid_field_is_named(path: list[str], value: Any, named: str) -> None:
    with pytest.raises(CalibrationError) as raised:
        parse_calibration(_set(path, value))
    assert named in str(raised.value)


def test_a_key_that_is_not_two_hashes_is_named() -> None:
    changed = document()
    templates = changed["template_priors"]["templates"]
    templates["question:options"] = templates.pop(KEY)
    with pytest.raises(CalibrationError, match=r"templates\.question:options: keys are"):
        parse_calibration(changed)


def test_the_number_of_templates_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(format_module, "MAX_TEMPLATE_PRIORS", 1)
    changed = document()
    templates = changed["template_priors"]["templates"]
    templates[f"{'3' * 64}:{'4' * 64}"] = templates[KEY]
    with pytest.raises(CalibrationError, match=r"templates: 2 templates; at most 1"):
        parse_calibration(changed)
