"""System One on the embedded SmolLM2: a real tokenizer and a real chat template."""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from adapter.ordering import arrange, canonical_order, to_caller
from adapter.prompts import PAIR_LABELS, SINGLE_LABELS, answer_labels, render_decision
from adapter.readout import log_probabilities
from adapter.schema import Decision, Option
from adapter.settings import Settings
from client.decision_client import ChoiceAnswer, NoulAnswer, ScoreAnswer, SystemOneAnswers
from tests.support.live_server import runtime_of
from tests.support.serving import serving

pytestmark = pytest.mark.slow
HEADERS = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def client(smollm2_gguf: Path) -> Iterator[TestClient]:
    # Three questions per request, yet a 255-option question's 27 sequences must fit. On one
    # thread of a slow CPU that question takes about 45 s (2,200 rows), near the default 50 s
    # SEMIF_REQUEST_TIMEOUT_S that admission would refuse it for (a 400): give it room.
    settings = Settings(
        gguf_path=smollm2_gguf,
        max_tokens=2560,
        max_shared_decisions=3,
        threads=1,
        request_timeout_seconds=300.0,
    )
    with serving(settings) as served:
        yield served


def post(client: TestClient, body: Any) -> Any:
    return client.post("/v1/systemone", content=json.dumps(body), headers=HEADERS)


def test_example_round_trips_all_three_kinds(client: TestClient) -> None:
    text = resources.files("client.examples").joinpath("systemone.json").read_text()
    response = post(client, json.loads(text))
    assert response.status_code == 200
    answers = SystemOneAnswers.from_json(response.json())
    assert answers.model == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert isinstance(answers["refund"], NoulAnswer)
    assert 0.0 < answers["refund"].yes < 1.0
    queue = answers["queue"]
    assert isinstance(queue, ChoiceAnswer)
    assert list(queue.probabilities) == ["account_access", "billing", "sales"]
    assert sum(queue.probabilities.values()) == pytest.approx(1.0)
    urgency = answers["urgency"]
    assert isinstance(urgency, ScoreAnswer)
    assert 0.0 <= urgency.score <= 2.0
    assert list(urgency.legend) == ["0", "1", "2"]
    assert 0.0 <= queue.confidence <= 1.0
    assert 0.0 <= urgency.confidence <= 1.0
    assert answers.input_tokens > 100


def test_real_tokenizer_passes_every_label_check(client: TestClient) -> None:
    service = runtime_of(client.app).service
    assert service is not None
    engine = service.engine
    singles = service.labels.token_ids(SINGLE_LABELS)
    pairs = service.labels.token_ids(PAIR_LABELS)
    assert [engine.vocab.piece(tokens[0]) for tokens in singles] == list(SINGLE_LABELS)
    assert ["".join(engine.vocab.piece(token) for token in pair) for pair in pairs] == list(
        PAIR_LABELS
    )
    assert all(len(pair) == 2 for pair in pairs)


def test_255_options_are_scored_exactly(client: TestClient) -> None:
    criteria = {f"c{i}": None for i in range(255)}
    question = {"type": "choice", "instructions": "Which code fits?", "criteria": criteria}
    state = "The printer on floor 3 is jammed."
    response = post(client, {"state": state, "questions": {"code": question}})
    assert response.status_code == 200
    answer = response.json()["answers"]["code"]
    probabilities = answer["probabilities"]
    assert list(probabilities) == list(criteria)
    assert sum(probabilities.values()) == pytest.approx(1.0)
    assert answer["choice"] == max(probabilities, key=probabilities.__getitem__)

    # The same product P(letter) * P(digit | letter) from separate decodes; the prompt's
    # prefix is still cached, so each costs two tokens. Tolerance: batch-shape numerics.
    service = runtime_of(client.app).service
    assert service is not None
    engine = service.engine
    decision = Decision(
        "code", state, "Which code fits?", tuple(Option(key, key) for key in criteria)
    )
    order = canonical_order(decision.options)  # the server's default option order
    prompt = engine.vocab.tokenize(render_decision(service.template, arrange(decision, order)))
    (alone,), _ = engine.score([prompt])
    first = log_probabilities(alone.logits)
    pairs = service.labels.token_ids(answer_labels(255))
    second = {}
    for letter in {pair[0] for pair in pairs}:
        (after,), _ = engine.score([[*prompt, letter]])
        second[letter] = log_probabilities(after.logits)
    joint = [first[letter] + second[letter][digit] for letter, digit in pairs]
    weights = np.exp(np.array(joint) - max(joint))
    expected = to_caller(list(weights / weights.sum()), order)  # back to the request's order
    assert list(probabilities.values()) == pytest.approx(expected, abs=0.02)
