"""The calibration in force, on the real tiny model: each kind's temperature and the position
prior are applied where the calibration was fitted, reported per result, and a calibration
fitted under another prompt version is refused at start."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from adapter.calibration import CalibrationMismatchError
from adapter.ordering import canonical_order, to_caller
from adapter.prompts import PROMPT_VERSION
from adapter.runtime import load_service
from adapter.schema import parse_decision
from adapter.settings import Settings
from model_build.calibration import Calibration
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
    return {
        mode: post(client, {"decision": decision(), "option_order": mode})["result"]
        for mode in ("canonical", "as_given")
    } | {
        "systemone": post(
            client, {"state": "Charged twice.", "questions": QUESTIONS}, "/v1/systemone"
        )["answers"]
    }


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
    }


def test_another_order_than_the_fitted_one_is_served_uncalibrated(
    answers: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    plain, calibrated = answers[0]["as_given"], answers[1]["as_given"]
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
