"""Conformal prediction sets through the decision API, on real llama.cpp (the tiny model):
the fields, the caller's order, permutation invariance, and the refusals that keep a set
from promising what no calibration backs."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from adapter.calibration import CalibrationMismatchError, check_calibration
from adapter.decisions import decide
from adapter.errors import RequestError
from adapter.prompts import LIKELIHOOD_PROMPT_VERSIONS, PROMPT_VERSION
from adapter.schema import Decision, Option, Policy, parse_decision_body
from adapter.service import DecisionService
from adapter.systemone import answer, parse_systemone
from model_build.calibration import Calibration
from model_build.conformal import ConformalScores, ConformalSection
from tests.support.models import open_test_model

OPTIONS = (
    ("refund", "Refund the order in full."),
    ("replace", "Send a replacement."),
    ("repair", "Repair the screen."),
    ("escalate", "Escalate to a human agent."),
)
TWO_OPTIONS = {
    "id": "d",
    "state": "s",
    "question": "q",
    "options": [{"id": "a", "description": "A."}, {"id": "b", "description": "B."}],
}
# Held-out scores that make a 0.5-coverage set small and a 0.9 one every option (too few).
HELD = ConformalScores({"lac": (0.5, 0.6, 0.7, 0.8), "aps": (0.5, 0.6, 0.7, 0.8)})


def _calibration(order: str = "canonical") -> Calibration:
    sections = {
        "letters": ConformalSection(PROMPT_VERSION, order, {"choice": HELD}),
        "likelihood:mean": ConformalSection(
            LIKELIHOOD_PROMPT_VERSIONS["unlisted"], "canonical", {"choice": HELD}
        ),
    }
    return Calibration(
        prompt_version=PROMPT_VERSION,
        option_order="canonical",
        temperatures={},
        tasks_sha256="0" * 64,
        conformal=sections,
    )


@pytest.fixture(scope="module")
def service(tiny_gguf: Any) -> Iterator[DecisionService]:
    model = open_test_model(tiny_gguf)
    served = DecisionService(
        engine=model.engine,
        template=model.template,
        labels=model.labels,
        max_tokens=1024,
        model={},
        calibration=_calibration(),
    )
    yield served
    served.close(10)


def _decision(options: tuple[tuple[str, str], ...] = OPTIONS) -> Decision:
    return Decision(
        "d", "Order 1182 arrived cracked.", "What now?", tuple(Option(*o) for o in options)
    )


@pytest.mark.parametrize(("readout", "normalization"), [("letters", None), ("likelihood", "mean")])
@pytest.mark.parametrize("method", ["lac", "aps"])
def test_a_set_comes_in_the_callers_order_and_ignores_the_options_order(
    service: DecisionService, readout: Any, normalization: Any, method: Any
) -> None:
    policy = Policy(
        readout=readout, normalization=normalization, coverage=0.5, coverage_method=method
    )
    options = list(OPTIONS)
    sets = []
    for seed in range(3):
        random.Random(seed).shuffle(options)
        (result,) = decide(service, [_decision(tuple(options))], "single", policy)["results"]
        ids = result["option_ids"]
        assert result["prediction_set"] == [i for i in ids if i in result["prediction_set"]]
        assert result["set_size"] == len(result["prediction_set"])
        assert (result["coverage"], result["coverage_method"]) == (0.5, method)
        assert result["conformal"]["calibration_questions"] == 4
        assert result["abstained"] is (result["set_size"] != 1)
        if result["abstained"]:
            assert result["abstain_reason"] == "prediction_set"
        sets.append(set(result["prediction_set"]))
    assert sets[0] == sets[1] == sets[2]


def test_a_coverage_the_calibration_cannot_back_is_every_option_and_says_so(
    service: DecisionService,
) -> None:
    (result,) = decide(service, [_decision()], "single", Policy(coverage=0.9))["results"]
    assert result["prediction_set"] == [o for o, _ in OPTIONS]
    assert result["conformal"] == {
        "calibration_questions": 4,
        "complete": True,
        "needed_questions": 9,
    }
    assert result["abstain_reason"] == "prediction_set"


def test_without_a_section_coverage_is_a_400_naming_what_is_missing(
    service: DecisionService,
) -> None:
    with pytest.raises(
        RequestError, match=r"coverage: .*no conformal section for readout likelihood:sum"
    ):
        decide(
            service,
            [_decision()],
            "single",
            Policy(readout="likelihood", normalization="sum", coverage=0.8),
        )
    with pytest.raises(
        RequestError, match=r"fitted in option order canonical; .* read in as_given"
    ):
        decide(service, [_decision()], "single", Policy(option_order="as_given", coverage=0.8))
    # Without coverage, nothing changes: no set fields.
    (plain,) = decide(service, [_decision()], "single")["results"]
    assert "prediction_set" not in plain


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ({"coverage": 1}, r"coverage: must be a number between 0 and 1, both excluded"),
        ({"coverage": 0}, r"coverage: must be a number between 0 and 1"),
        ({"coverage": "0.9"}, r"coverage: must be a number from 0 to 1"),
        ({"coverage": 0.9, "coverage_method": "raps"}, r'coverage_method: "raps" is not one of'),
    ],
)
def test_a_bad_coverage_is_refused_by_field(policy: dict[str, Any], message: str) -> None:
    body = {"decision": TWO_OPTIONS, **policy}
    with pytest.raises(RequestError, match=message):
        parse_decision_body(body, 4)


def test_a_section_fitted_for_other_prompts_is_refused_at_start() -> None:
    stale = dataclasses.replace(
        _calibration(),
        conformal={
            "letters": ConformalSection("semif-direct-options/0", "canonical", {"choice": HELD})
        },
    )
    with pytest.raises(CalibrationMismatchError, match="letters conformal calibration"):
        check_calibration(stale, "unlisted")
    check_calibration(_calibration(), "unlisted")  # the current versions pass


def test_the_server_answers_a_coverage_it_cannot_back_with_a_400(
    tiny_client: TestClient,
) -> None:
    """Served without a calibration: the refusal's HTTP answer names the field."""
    body = {"decision": TWO_OPTIONS, "coverage": 0.8}
    response = tiny_client.post(
        "/invocations", content=json.dumps(body), headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert "coverage" in response.text


def test_system_one_answers_carry_sets_of_option_keys(service: DecisionService) -> None:
    """The calibration holds scores for choice questions only: a choice question gets its
    set, a yes/no question is refused by name before anything is scored."""
    choice = {
        "type": "choice",
        "instructions": "What now?",
        "criteria": dict.fromkeys(("a", "b", "c")),
    }
    body = {"state": "Order 1182 arrived cracked.", "questions": {"next": choice}, "coverage": 0.5}
    response = answer(service, parse_systemone(body, 8)).response
    shaped = response["answers"]["next"]
    assert shaped["type"] == "choice"
    assert set(shaped["prediction_set"]) <= {"a", "b", "c"}
    assert shaped["set_size"] == len(shaped["prediction_set"])
    assert shaped["coverage"] == 0.5
    noul = {"type": "noul", "instructions": "Is it urgent?", "criteria": None}
    asked = {**body, "questions": {"urgent": noul}}
    with pytest.raises(RequestError, match=r"no conformal section for readout letters and noul"):
        answer(service, parse_systemone(asked, 8))
    without = {key: value for key, value in body.items() if key != "coverage"}
    plain = answer(service, parse_systemone(without, 8)).response
    assert "prediction_set" not in plain["answers"]["next"]
