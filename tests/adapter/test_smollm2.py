"""Behaviour on a real instruction-tuned model (the embedded SmolLM2-135M).

The model is far too small for accurate decisions; these tests check what must hold for any
chat model: its letters pass the slot checks, it puts most next-token mass on the answer
letters, shared batches agree with single scoring, and reuse only changes the cost.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from adapter.decisions import decide
from adapter.labels import letter_mass_floor, probe_decision
from adapter.schema import parse_decision_body
from adapter.service import DecisionService
from tests.support import injection
from tests.support.models import open_test_model, service_of

pytestmark = pytest.mark.slow  # the embedded SmolLM2: real-model behaviour


def example(name: str) -> Any:
    return json.loads(resources.files("client.examples").joinpath(name).read_text())


@pytest.fixture(scope="module")
def service(smollm2_gguf: Path) -> Iterator[DecisionService]:
    model = open_test_model(smollm2_gguf)
    yield service_of(model, max_tokens=2048)
    model.engine.close()


def test_letters_are_single_tokens_of_the_real_tokenizer(service: DecisionService) -> None:
    slots = service.labels.letter_token_ids
    assert [service.engine.vocab.piece(token) for token in slots] == list("ABCDEFGHIJKLMNOP")


def test_model_answers_with_a_letter(service: DecisionService) -> None:
    decisions = parse_decision_body(example("decision.json"), 64).decisions
    result = decide(service, decisions, "single")["results"][0]
    assert result["allowed_token_mass"] > 0.5
    assert result["top_token"] in {"A", "B", "C"}


def test_shared_batch_agrees_with_single_scoring(service: DecisionService) -> None:
    decisions = parse_decision_body(example("shared-decisions.json"), 64).decisions
    shared = decide(service, decisions, "shared")
    timing = shared["timing"]
    assert timing["passes"] == 1
    # The shared system prompt and state are decoded once for every prompt.
    assert timing["input_tokens"] - timing["reused_tokens"] - timing["evaluated_tokens"] > 40
    for decision, batched in zip(decisions, shared["results"], strict=True):
        service.engine.reset()
        alone = decide(service, [decision], "single")["results"][0]
        assert batched["prompt_sha256"] == alone["prompt_sha256"]
        # Bit-identical: the exact layout (adapter/kv_layout.py) removes what batching
        # used to change (up to 0.06 here before it).
        assert batched["probabilities"] == alone["probabilities"]


def test_shared_batch_is_deterministic(service: DecisionService) -> None:
    decisions = parse_decision_body(example("shared-decisions.json"), 64).decisions
    service.engine.reset()
    first = decide(service, decisions, "shared")["results"]
    service.engine.reset()
    second = decide(service, decisions, "shared")["results"]
    for one, two in zip(first, second, strict=True):
        assert one["probabilities"] == two["probabilities"]


def test_new_question_about_same_state_reuses_the_state(service: DecisionService) -> None:
    decisions = parse_decision_body(example("shared-decisions.json"), 64).decisions
    service.engine.reset()
    decide(service, decisions[:1], "single")
    follow_up = decide(service, decisions[1:2], "single")
    timing = follow_up["timing"]
    assert timing["reused_tokens"] > 60  # system prompt + the state
    assert timing["evaluated_tokens"] < follow_up["results"][0]["input_tokens"] / 2


def test_prompts_without_markers_tokenize_exactly_as_before(service: DecisionService) -> None:
    """Issue 10 item 2: keeping request text plain changes no token of a clean prompt."""
    injection.assert_clean_tokenization_unchanged(service)


def test_forged_markers_in_every_field_stay_plain_text(service: DecisionService) -> None:
    injection.assert_forged_markers_stay_plain(service)


def test_the_probe_decision_finds_most_mass_on_the_letters(smollm2_gguf: Path) -> None:
    model = open_test_model(smollm2_gguf, stream_cells=1024, max_branches=1)
    try:
        mass = probe_decision(model.engine, model.template, model.labels)
        assert mass > 0.1  # measured 0.46; the floor is 3.3e-6
        assert mass > 1000 * letter_mass_floor(model.engine.vocab.n_vocab)
    finally:
        model.engine.close()
