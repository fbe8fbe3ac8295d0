"""Multi-label questions (adapter.multi_label): each option judged on its own, on real
llama.cpp. Adding or removing an option moves no other option's probability by a bit (llama,
qwen35 and gemma3 memory), each option's log-odds equal a separate forward of its prompt
alone, and the answer's fields through the decision API, System One, JSON Lines and the
client."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from adapter.decisions import decide
from adapter.errors import RequestError
from adapter.multi_label import answer_fields, confidence
from adapter.ordering import Variants
from adapter.prompts import APPLIES_LABELS, PROMPT_VERSION, render_multi_label_prompt
from adapter.readout import applies_probabilities
from adapter.schema import (
    MAX_MULTI_LABEL_OPTIONS,
    Decision,
    Option,
    Policy,
    parse_decision_body,
)
from adapter.service import DecisionService
from client.answers import DecisionResult, MultiAnswer, SystemOneAnswers
from client.cli import format_decision, format_systemone
from model_build.calibration import Calibration
from model_build.conformal import ConformalScores, ConformalSection, applies_score
from tests.support.models import open_test_model, service_of
from tests.support.serving import post_ok

STATE = "Order 1182 arrived with a cracked screen and a missing charger; the customer is angry."
QUESTION = "Which of these issues does the case show?"
TAGS = (
    ("damaged", "The item arrived damaged."),
    ("missing", "Part of the order is missing."),
    ("late", "The delivery was late."),
    ("angry", "The customer is upset."),
    ("fraud", "The order looks fraudulent."),
)
HEADERS = {"content-type": "application/json"}


def _decision(tags: tuple[tuple[str, str], ...] = TAGS, decision_id: str = "d") -> Decision:
    options = tuple(Option(key, text) for key, text in tags)
    return Decision(decision_id, STATE, QUESTION, options, "multi_label")


def _read(service: DecisionService, decisions: list[Decision]) -> list[dict[str, float]]:
    """Each multi-label decision's probability and log-odds per option id, scored together
    (with a choice question about another state in the same batch)."""
    other = Decision("o", "A different case.", "Route it?", (Option("a", "A."), Option("b", "B.")))
    variants = [Variants.of(d, d.kind, "canonical", None) for d in [*decisions, other]]
    readings, _ = service.read_variants(variants, [d.id for d in [*decisions, other]])
    return [
        {
            f"{key}:{field}": value
            for key, p, logit in zip(d.option_ids, r.probabilities, r.option_logits, strict=True)
            for field, value in (("p", p), ("logit", logit))
        }
        for d, r in zip(decisions, readings[: len(decisions)], strict=True)
    ]


def test_adding_or_removing_an_option_moves_no_other_option_by_a_bit(
    tiny_any_gguf: Path,
) -> None:
    """On every memory kind: the five tags alone, then three of them beside another
    question, then the five plus a sixth on a cache the others warmed: every shared option's
    probability and log-odds are bit-identical."""
    service = service_of(open_test_model(tiny_any_gguf))
    try:
        (whole,) = _read(service, [_decision()])
        (fewer,) = _read(service, [_decision(TAGS[1:4])])
        extra = (*TAGS, ("refund", "The customer asks for a refund."))
        (more,) = _read(service, [_decision(extra)])
        assert fewer == {key: whole[key] for key in fewer}
        assert {key: more[key] for key in whole} == whole
        # Distinct options, distinct prompts: the tiny model's answers differ.
        assert len({whole[f"{key}:logit"] for key, _ in TAGS}) == len(TAGS)
    finally:
        service.close(10)


def test_each_options_log_odds_equal_a_separate_forward(tiny_any_gguf: Path) -> None:
    """Each option's log-odds are what its prompt decoded alone on an empty cache gives (A's
    logit less B's), so the shared state and the neighbours are pure savings."""
    service = service_of(open_test_model(tiny_any_gguf))
    fresh = service_of(open_test_model(tiny_any_gguf))
    try:
        decision = _decision()
        (read,) = _read(service, [decision])
        yes, no = (service.labels.tokens[label][0] for label in APPLIES_LABELS)
        for option in decision.options:
            prompt = render_multi_label_prompt(service.template, decision, option)
            fresh.engine.reset()
            (alone,), _ = fresh.engine.score([service.tokenize_prompt(prompt, "d")])
            logits = alone.logits.astype(np.float64)
            assert read[f"{option.id}:logit"] == float(logits[yes]) - float(logits[no])
    finally:
        service.close(10)
        fresh.close(10)


def test_the_answer_fields_follow_the_probabilities() -> None:
    options = (Option("a", "A.", threshold=0.9), Option("b", "B."), Option("c", "C."))
    decision = Decision("d", "s", "q", options, "multi_label")
    fields = answer_fields(decision, [0.8, 0.5, 0.1])
    assert fields["thresholds"] == [0.9, 0.5, 0.5]
    assert fields["applies"] == ["b"]  # a is under its own threshold; b sits on it
    assert fields["none_probability"] == pytest.approx(0.2 * 0.5 * 0.9)
    assert confidence([0.8, 0.5, 0.1]) == 0.5
    assert confidence([0.99, 0.02]) == 0.98


def test_applies_probabilities_are_the_logistic_of_the_scaled_log_odds() -> None:
    got = applies_probabilities([0.0, 2.0, -2.0, 800.0, -800.0], temperature=2.0)
    assert list(got[:3]) == pytest.approx([0.5, 1 / (1 + math.exp(-1)), 1 / (1 + math.exp(1))])
    assert got[3] == 1.0
    assert 0.0 <= got[4] < 1e-170


def _body(**decision: Any) -> dict[str, Any]:
    options = [{"id": key, "description": text} for key, text in TAGS]
    base = {"id": "d", "state": STATE, "question": QUESTION, "options": options}
    return {"decision": base | decision}


def test_the_schema_refuses_what_a_multi_label_question_cannot_be() -> None:
    thresholded = [{"id": "a", "description": "A.", "threshold": 0.7}]
    parsed = parse_decision_body(_body(kind="multi_label", options=thresholded), 4)
    assert parsed.decisions[0].options[0].threshold == 0.7  # one option is a question too
    refusals = {
        "decision.kind": _body(kind="multi"),
        # A choice takes no threshold.
        "decision.options[0].threshold": _body(options=[*thresholded, {"id": "b"}]),
    }
    for field, body in refusals.items():
        with pytest.raises(RequestError) as refused:
            parse_decision_body(body, 4)
        assert refused.value.path == field
    high = [{"id": "a", "description": "A.", "threshold": 1.5}]
    with pytest.raises(RequestError, match=r"options\[0\].threshold: must be a number from 0"):
        parse_decision_body(_body(kind="multi_label", options=high), 4)
    many = [{"id": str(i), "description": "x"} for i in range(MAX_MULTI_LABEL_OPTIONS + 1)]
    with pytest.raises(RequestError, match=r"decision.options: has 256 options; allowed 1..255"):
        parse_decision_body(_body(kind="multi_label", options=many), 4)


def _calibration() -> Calibration:
    held = ConformalScores({"lac": (0.1, 0.2, 0.3, 0.4), "aps": (0.6, 0.7, 0.8, 0.9)})
    return Calibration(
        prompt_version=PROMPT_VERSION,
        option_order="debiased",  # a multi-label question's options are each read alone
        temperatures={"multi_label": 2.0},
        tasks_sha256="0" * 64,
        conformal={"letters": ConformalSection(PROMPT_VERSION, "debiased", {"multi_label": held})},
    )


def test_a_multi_label_decision_through_the_api_and_the_client(
    tiny_module_client: TestClient,
) -> None:
    client = tiny_module_client
    options: list[dict[str, Any]] = [{"id": key, "description": text} for key, text in TAGS]
    options[0]["threshold"] = 0.0  # always applies
    body = _body(kind="multi_label", options=options)
    body["readout"] = "likelihood"  # a multi-label question is read by letters regardless
    body["min_confidence"] = 1.0
    result = post_ok(client, body)["result"]
    probabilities = result["probabilities"]
    assert result["kind"] == "multi_label"
    assert result["readout"] == "letters"
    assert result["option_order"] == "as_given"
    assert result["readout_detail"].startswith("each option asked alone")
    assert result["timing"]["prompts"] == 1
    assert result["input_tokens"] > 0
    assert not math.isclose(sum(probabilities), 1.0)  # each option's own, not a distribution
    assert result["thresholds"] == [0.0, 0.5, 0.5, 0.5, 0.5]
    expected = [
        key
        for (key, _), p, t in zip(TAGS, probabilities, result["thresholds"], strict=True)
        if p >= t
    ]
    assert result["applies"] == expected
    assert "damaged" in expected
    assert result["none_probability"] == pytest.approx(math.prod(1 - p for p in probabilities))
    assert result["abstained"]
    assert result["abstain_reason"] == "min_confidence"
    shown = DecisionResult.from_json(result)
    assert (shown.kind, shown.applies) == ("multi_label", expected)
    assert shown.none_probability == result["none_probability"]
    assert "none=" in format_decision(shown)
    assert "{damaged" in format_decision(shown)
    # Order: the caller's, and a permutation permutes the answer bit for bit.
    reversed_body = _body(kind="multi_label", options=options[::-1])
    again = post_ok(client, reversed_body)["result"]
    assert again["probabilities"] == probabilities[::-1]


def test_multi_questions_sets_and_clones_in_system_one_and_in_json_lines(
    tiny_module_client: TestClient,
) -> None:
    client = tiny_module_client
    keys = {key: text for key, text in TAGS}
    request: dict[str, Any] = {
        "state": STATE,
        "questions": {
            "issues": {"type": "multi", "instructions": QUESTION, "criteria": keys},
            "strict": {
                "type": "multi",
                "instructions": QUESTION,
                "criteria": {"damaged": None},
                "threshold": 1.0,
            },
            "route": {"type": "choice", "instructions": "Route?", "criteria": {"a": "A", "b": "B"}},
        },
    }
    body = post_ok(client, request, "/v1/systemone")
    issues = body["answers"]["issues"]
    assert issues["type"] == "multi"
    assert set(issues["probabilities"]) == set(keys)
    assert issues["multi"] == [k for k, p in issues["probabilities"].items() if p >= 0.5]
    assert body["answers"]["strict"]["multi"] == []  # nothing reaches a threshold of 1
    parsed = SystemOneAnswers.from_json(body)
    assert isinstance(parsed["issues"], MultiAnswer)
    assert "multi" in format_systemone(parsed)
    # JSON Lines: each line answered as alone, clones and a refused coverage included.
    decision_body = _body(kind="multi_label")
    clones = [{"id": "a", "description": "Refund it."}, {"id": "b", "description": "Refund it."}]
    cloned = _body(options=[*clones, {"id": "c", "description": "Close it."}])
    cloned["readout"] = "likelihood"
    covered = {**_body(), "coverage": 0.9}  # the tiny model's manifest has no calibration
    bodies = [decision_body, request, cloned, covered]
    lines = "\n".join(json.dumps(body) for body in bodies).encode()
    response = client.post(
        "/invocations", content=lines, headers={"content-type": "application/jsonlines"}
    )
    assert response.status_code == 200, response.text
    first, second, third, fourth = (json.loads(line) for line in response.text.splitlines())
    alone = post_ok(client, decision_body)["result"]
    assert first["result"]["probabilities"] == alone["probabilities"]
    assert second["answers"]["issues"]["probabilities"] == issues["probabilities"]
    assert third["result"]["option_clones"] == [["a", "b"]]
    assert third["result"]["probabilities"] == post_ok(client, cloned)["result"]["probabilities"]
    assert (fourth["status"], fourth["field"]) == (400, "coverage")
    bad = {**request, "questions": {"x": {**request["questions"]["issues"], "threshold": 2}}}
    refused = client.post("/v1/systemone", content=json.dumps(bad), headers=HEADERS)
    assert refused.status_code == 400
    assert "questions.x.threshold" in refused.text


def test_sets_per_option_from_the_multi_label_section(tiny_gguf: Path) -> None:
    """With a `multi_label` conformal section the set is the options whose "applies" is
    within the threshold; the calibration's temperature divides each option's log-odds;
    without a section, a 400 naming coverage."""
    service = service_of(open_test_model(tiny_gguf))
    service.calibration = _calibration()
    try:
        decision = _decision()
        policy = Policy(coverage=0.6)
        (result,) = decide(service, [decision], "single", policy)["results"]
        limit = 0.3  # of 4 held-out scores, the ceil(5 * 0.6) = 3rd smallest
        inside = [
            key
            for key, p in zip(decision.option_ids, result["probabilities"], strict=True)
            if applies_score("lac", p) <= limit
        ]
        assert result["prediction_set"] == inside
        assert result["set_size"] == len(inside)
        assert result["abstain_reason"] is None  # a multi-label set may hold any number
        assert result["calibration"]["temperature"] == 2.0
        logits = np.asarray(result["option_logits"])
        assert result["probabilities"] == list(applies_probabilities(logits, temperature=2.0))
        service.calibration = None
        with pytest.raises(RequestError, match="no conformal section"):
            decide(service, [decision], "single", policy)
    finally:
        service.close(10)
