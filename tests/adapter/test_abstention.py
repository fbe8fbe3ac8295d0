"""Abstention and the reading policy on the real tiny model: a result below a threshold says
so and keeps its distribution; bad thresholds and orders are 400s naming the field; System
One keeps its exact wire format."""

from __future__ import annotations

import json
from typing import Any

import pytest
from starlette.testclient import TestClient

from tests.support.serving import decision

HEADERS = {"content-type": "application/json"}


def post(client: TestClient, body: Any, path: str = "/invocations") -> Any:
    return client.post(path, content=json.dumps(body), headers=HEADERS)


def result_of(client: TestClient, **policy: Any) -> dict[str, Any]:
    response = post(client, {"decision": decision(), **policy})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()["result"]
    return result


def test_answered_results_say_so(tiny_client: TestClient) -> None:
    result = result_of(tiny_client, min_confidence=0.0, min_allowed_token_mass=0.0)
    assert (result["abstained"], result["abstain_reason"]) == (False, None)
    assert result["option_order"] == "canonical"  # the server's default
    assert result["calibration"] is None  # the tiny model has no manifest


def test_low_confidence_abstains_and_keeps_the_distribution(tiny_client: TestClient) -> None:
    plain = result_of(tiny_client)
    top = max(plain["probabilities"])
    below = result_of(tiny_client, min_confidence=min(1.0, top + 0.01))
    assert (below["abstained"], below["abstain_reason"]) == (True, "min_confidence")
    assert below["probabilities"] == pytest.approx(plain["probabilities"], abs=1e-6)
    assert below["option_ids"] == plain["option_ids"]
    at = result_of(tiny_client, min_confidence=top - 1e-9)
    assert at["abstained"] is False


def test_low_letter_mass_abstains_first(tiny_client: TestClient) -> None:
    # The tiny model's letter mass is about 0.06: the threshold below which its answers
    # mean little is crossed before the confidence one is looked at.
    result = result_of(tiny_client, min_confidence=1.0, min_allowed_token_mass=0.5)
    assert result["allowed_token_mass"] < 0.5
    assert (result["abstained"], result["abstain_reason"]) == (True, "min_allowed_token_mass")


def test_thresholds_apply_to_every_shared_result(tiny_client: TestClient) -> None:
    body = {
        "decisions": [decision("a"), decision("b", question="Is it urgent?")],
        "min_confidence": 1.0,
        "option_order": "debiased",
    }
    response = post(tiny_client, body)
    assert response.status_code == 200
    results = response.json()["results"]
    assert [r["abstain_reason"] for r in results] == ["min_confidence"] * 2
    assert [r["option_order"] for r in results] == ["debiased"] * 2
    assert [r["timing"]["prompts"] for r in results] == [3, 3]


@pytest.mark.parametrize(
    ("policy", "field", "rule"),
    [
        ({"min_confidence": 1.5}, "min_confidence", "must be a number from 0 to 1"),
        ({"min_confidence": -0.1}, "min_confidence", "must be a number from 0 to 1"),
        ({"min_confidence": "0.5"}, "min_confidence", "must be a number from 0 to 1"),
        ({"min_allowed_token_mass": True}, "min_allowed_token_mass", "from 0 to 1"),
        ({"option_order": "sorted"}, "option_order", "is not one of as_given, canonical"),
        ({"option_order": 1}, "option_order", "must be a string"),
        ({"min_confidense": 0.5}, "body.min_confidense", "unknown field"),
    ],
)
def test_bad_policy_is_a_400_naming_the_field(
    tiny_client: TestClient, policy: dict[str, Any], field: str, rule: str
) -> None:
    response = post(tiny_client, {"decision": decision(), **policy})
    assert response.status_code == 400
    assert response.json()["field"] == field
    assert rule in response.json()["error"]


def test_systemone_takes_an_option_order_and_keeps_its_wire_format(
    tiny_client: TestClient,
) -> None:
    questions = {
        "refund": {"type": "noul", "instructions": "Is a refund asked for?"},
        "queue": {
            "type": "choice",
            "instructions": "Which queue?",
            "criteria": {"billing": "Billing.", "shipping": None, "sales": "Sales."},
        },
    }
    body = {"state": "Charged twice.", "questions": questions, "option_order": "debiased"}
    response = post(tiny_client, body, "/v1/systemone")
    assert response.status_code == 200
    answers = response.json()["answers"]
    assert set(answers["refund"]) == {"type", "noul"}
    assert set(answers["queue"]) == {"type", "choice", "probabilities", "confidence"}
    bad = post(tiny_client, {**body, "option_order": "shuffled"}, "/v1/systemone")
    assert (bad.status_code, bad.json()["field"]) == (400, "option_order")
    # Abstention is a decision API field: System One refuses it like any unknown field.
    unknown = post(tiny_client, {**body, "min_confidence": 0.5}, "/v1/systemone")
    assert (unknown.status_code, unknown.json()["field"]) == (422, "body.min_confidence")
