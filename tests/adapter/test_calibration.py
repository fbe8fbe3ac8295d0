"""The calibration in force, on the real tiny model: each kind's temperature and the position
prior are applied where the calibration was fitted, a template prior by option id on its own
template only, the likelihood readout's temperature per normalization and kind, reported per
result, and a calibration fitted under another prompt version (letters or likelihood) is
refused at start."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from adapter.calibration import CalibrationMismatchError
from adapter.ordering import canonical_order, to_caller
from adapter.prompts import LIKELIHOOD_PROMPT_VERSIONS, PROMPT_VERSION
from adapter.runtime import load_service
from adapter.schema import parse_decision
from adapter.settings import Settings
from adapter.template_key import template_key
from model_build.calibration import (
    Calibration,
    LikelihoodCalibration,
    TemplatePrior,
    TemplatePriors,
)
from tests.support.manifests import write_manifest
from tests.support.serving import decision, serving

HEADERS = {"content-type": "application/json"}
PRIOR = (0.5, 0.3, 0.2)
CALIBRATION = Calibration(
    prompt_version=PROMPT_VERSION,
    option_order="canonical",
    temperatures={"choice": 2.0, "noul": 0.5, "score": 3.0},
    tasks_sha256="a" * 64,
    position_prior={3: PRIOR},
    likelihood=LikelihoodCalibration(
        LIKELIHOOD_PROMPT_VERSIONS["unlisted"], {"mean": {"choice": 2.5}, "pmi": {"noul": 0.4}}
    ),
)
QUESTIONS = {
    "refund": {"type": "noul", "instructions": "Is a refund asked for?"},
    "urgency": {
        "type": "score",
        "instructions": "How urgent is it?",
        "criteria": ["Not urgent.", "Urgent.", "Very urgent."],
    },
}


def post(client: TestClient, body: Any, path: str = "/invocations") -> dict[str, Any]:
    response = client.post(path, content=json.dumps(body), headers=HEADERS)
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def ask(client: TestClient) -> dict[str, Any]:
    """Everything the test compares, from one server: decisions in two modes, System One."""
    return (
        {
            mode: post(client, {"decision": decision(), "option_order": mode})["result"]
            for mode in ("canonical", "as_given")
        }
        | {
            f"likelihood {normalization}": post(
                client,
                {"decision": decision(), "readout": "likelihood", "normalization": normalization},
            )["result"]
            for normalization in ("mean", "sum")
        }
        | {
            "systemone": post(
                client, {"state": "Charged twice.", "questions": QUESTIONS}, "/v1/systemone"
            )["answers"],
            "systemone pmi": post(
                client,
                {
                    "state": "Charged twice.",
                    "questions": {"refund": QUESTIONS["refund"]},
                    "readout": "likelihood",
                    "normalization": "pmi",
                },
                "/v1/systemone",
            )["answers"],
        }
    )


@pytest.fixture
def answers(tiny_model_dir: Path) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """The same requests without and then with the calibration; no prefix reuse, so both
    servers do the same arithmetic and differ only by the calibration."""
    settings = Settings(model_dir=tiny_model_dir, threads=2, prefix_reuse=False)
    with serving(settings) as client:
        plain = ask(client)
    write_manifest(tiny_model_dir, CALIBRATION)
    with serving(settings) as client:
        yield plain, ask(client)


def tempered(probabilities: list[float], temperature: float, prior: Any = None) -> np.ndarray:
    scores = np.log(probabilities) - (0 if prior is None else np.log(prior))
    weights = np.exp((scores - scores.max()) / temperature)
    result: np.ndarray = weights / weights.sum()
    return result


def test_canonical_divides_the_prior_and_applies_the_choice_temperature(
    answers: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    plain, calibrated = answers[0]["canonical"], answers[1]["canonical"]
    options = parse_decision(decision(), "decision").options
    prior_by_id = to_caller(PRIOR, canonical_order(options))
    expected = tempered(plain["probabilities"], 2.0, prior_by_id)
    assert calibrated["probabilities"] == pytest.approx(list(expected), abs=1e-6)
    assert calibrated["option_logits"] == pytest.approx(plain["option_logits"], abs=1e-6)
    assert calibrated["allowed_token_mass"] == pytest.approx(plain["allowed_token_mass"])
    assert calibrated["calibration"] == {
        "tasks_sha256": "a" * 64,
        "option_order": "canonical",
        "applied": True,
        "temperature": 2.0,
        "position_prior": True,
        "template_prior": False,
    }


@pytest.mark.parametrize("asked", ["as_given", "likelihood sum"])
def test_what_the_fit_does_not_cover_is_served_uncalibrated(
    answers: tuple[dict[str, Any], dict[str, Any]], asked: str
) -> None:
    """Another order than the fitted one; a likelihood normalization without a temperature."""
    plain, calibrated = answers[0][asked], answers[1][asked]
    assert calibrated["probabilities"] == pytest.approx(plain["probabilities"], abs=1e-6)
    assert calibrated["calibration"]["applied"] is False
    assert calibrated["calibration"]["temperature"] == 1.0
    assert calibrated["calibration"]["position_prior"] is False


def test_systemone_applies_each_kinds_temperature(
    answers: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    plain, calibrated = answers[0]["systemone"], answers[1]["systemone"]
    p_true = plain["refund"]["noul"]
    expected = tempered([p_true, 1 - p_true], 0.5)[0]  # no prior for two options
    assert calibrated["refund"]["noul"] == pytest.approx(expected, abs=1e-6)
    levels = list(plain["urgency"]["probabilities"].values())
    assert list(calibrated["urgency"]["probabilities"].values()) == pytest.approx(
        list(tempered(levels, 3.0)), abs=1e-6
    )


def test_a_calibration_for_another_prompt_version_is_refused_at_start(
    tiny_model_dir: Path,
) -> None:
    stale = Calibration(
        prompt_version="semif-direct-options/0",
        option_order="canonical",
        temperatures={"choice": 1.5},
        tasks_sha256="b" * 64,
    )
    write_manifest(tiny_model_dir, stale)
    with pytest.raises(CalibrationMismatchError) as raised:
        load_service(Settings(model_dir=tiny_model_dir, threads=1))
    message = str(raised.value)
    assert "'semif-direct-options/0'" in message
    assert repr(PROMPT_VERSION) in message
    assert "semif-calibrate" in message


def test_likelihood_gets_its_normalizations_temperature_and_no_prior(
    answers: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    plain, calibrated = answers[0]["likelihood mean"], answers[1]["likelihood mean"]
    expected = tempered(plain["probabilities"], 2.5)
    assert calibrated["probabilities"] == pytest.approx(list(expected), abs=1e-6)
    assert calibrated["option_logits"] == pytest.approx(plain["option_logits"], abs=1e-6)
    assert calibrated["calibration"]["applied"] is True
    assert calibrated["calibration"]["temperature"] == 2.5
    assert calibrated["calibration"]["position_prior"] is False
    systemone = answers[0]["systemone pmi"]["refund"]["noul"]
    expected_noul = tempered([systemone, 1 - systemone], 0.4)[0]
    assert answers[1]["systemone pmi"]["refund"]["noul"] == pytest.approx(expected_noul, abs=1e-6)


def test_a_likelihood_calibration_for_another_listing_is_refused_at_start(
    tiny_model_dir: Path,
) -> None:
    write_manifest(tiny_model_dir, CALIBRATION)  # its likelihood section: the default prompt
    with pytest.raises(CalibrationMismatchError) as raised:
        load_service(Settings(model_dir=tiny_model_dir, threads=1, likelihood_prompt="listed"))
    message = str(raised.value)
    assert "likelihood calibration" in message
    assert repr(LIKELIHOOD_PROMPT_VERSIONS["listed"]) in message
    assert repr(LIKELIHOOD_PROMPT_VERSIONS["unlisted"]) in message


TEMPLATE_PRIOR = {"account_access": 0.2, "billing": 0.7, "sales": 0.1}


def template_calibration() -> Calibration:
    """CALIBRATION with a template prior for `decision()`'s template, fitted in canonical."""
    fitted = parse_decision(decision(), "decision")
    prior = TemplatePrior(tuple(TEMPLATE_PRIOR), tuple(TEMPLATE_PRIOR.values()), inputs=25)
    return replace(
        CALIBRATION,
        template_priors=TemplatePriors("canonical", "c" * 64, {template_key(fitted): prior}),
    )


PERMUTED = (
    ("sales", "Sales and product evaluation."),
    ("account_access", "Account access and authentication support."),
    ("billing", "Billing and payment support."),
)
# The template's decision in canonical and as_given, the same options listed otherwise
# (another template), another question (another template), and read by likelihood.
TEMPLATE_BODIES: dict[str, dict[str, Any]] = {
    "canonical": {"decision": decision(), "option_order": "canonical"},
    "as_given": {"decision": decision(), "option_order": "as_given"},
    "permuted": {"decision": decision(options=PERMUTED), "option_order": "canonical"},
    "question": {"decision": decision(question="Who answers?"), "option_order": "canonical"},
    "likelihood": {"decision": decision(), "readout": "likelihood", "normalization": "mean"},
}


def test_a_template_prior_is_divided_out_by_option_id_of_its_own_template_only(
    tiny_model_dir: Path,
) -> None:
    """prob ∝ (p / prior(id)) ** (1 / T), in place of the position prior, only for the
    template's key and options, in the mode the priors were fitted in; reported."""
    settings = Settings(model_dir=tiny_model_dir, threads=2, prefix_reuse=False)
    with serving(settings) as client:
        plain = {name: post(client, body)["result"] for name, body in TEMPLATE_BODIES.items()}
    write_manifest(tiny_model_dir, template_calibration())
    with serving(settings) as client:
        served = {name: post(client, body)["result"] for name, body in TEMPLATE_BODIES.items()}
    canonical = served["canonical"]
    expected = tempered(plain["canonical"]["probabilities"], 2.0, list(TEMPLATE_PRIOR.values()))
    assert canonical["probabilities"] == pytest.approx(list(expected), abs=1e-6)
    assert canonical["calibration"]["template_prior"] is True
    assert canonical["calibration"]["position_prior"] is False
    # Another mode (uncalibrated, as CALIBRATION is canonical), another readout: no prior.
    for name in ("as_given", "likelihood"):
        assert served[name]["calibration"]["template_prior"] is False
    assert served["as_given"]["probabilities"] == pytest.approx(
        plain["as_given"]["probabilities"], abs=1e-6
    )
    for name in ("permuted", "question"):  # another template: the position prior instead
        options = parse_decision(TEMPLATE_BODIES[name]["decision"], "decision").options
        prior_by_id = to_caller(PRIOR, canonical_order(options))
        expected = tempered(plain[name]["probabilities"], 2.0, prior_by_id)
        assert served[name]["probabilities"] == pytest.approx(list(expected), abs=1e-6)
        assert served[name]["calibration"]["template_prior"] is False
        assert served[name]["calibration"]["position_prior"] is True
