"""The likelihood readout (adapter.likelihood): its arithmetic alone, then on real llama.cpp
against brute force (both prompt listings, options scored by description or by label),
through the decision and System One APIs."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from adapter.errors import RequestError
from adapter.likelihood import Listing, ReadoutChoice, option_tokens, read_likelihood
from adapter.ordering import Variants, arrange, canonical_order
from adapter.prompts import (
    ChatTemplate,
    RenderedPrompt,
    answer_text,
    likelihood_messages,
    render_likelihood_prompt,
    render_neutral_prompt,
    with_answer,
)
from adapter.readout import NonFiniteLogitsError, log_probabilities
from adapter.schema import Decision, Option, parse_decision_body
from adapter.service import DecisionService
from adapter.settings import Settings, SettingsError, load_settings
from model_build.tiny_gguf import CHAT_TEMPLATE
from tests.support.models import open_test_model, service_of
from tests.support.serving import post_ok, serving

HEADERS = {"content-type": "application/json"}
OPTIONS = (
    ("refund", "Refund the order in full."),
    ("replace", "Send a replacement item by express courier."),
    ("repair", "Repair"),
    ("escalate", "Escalate to a human agent in the claims team, who calls back today."),
    ("close", "Close the case."),
)
STATE = "Order 1182 arrived with a cracked screen; the customer wants it fixed quickly."
QUESTION = "What should support do?"


# -- the arithmetic ---------------------------------------------------------------------


def test_the_three_normalizations_match_hand_computed_values() -> None:
    logprobs = [[-1.0, -2.0], [-0.5], [-0.25, -0.25, -1.5]]
    joint = [-3.0, -0.5, -2.0]
    neutral = [-4.0, -0.25, -1.0]
    expected = {
        "sum": joint,
        "mean": [-1.5, -0.5, -2.0 / 3],
        "pmi": [1.0, -0.25, -1.0],
    }
    for normalization, scores in expected.items():
        choice = ReadoutChoice("likelihood", normalization)  # type: ignore[arg-type]
        readout = read_likelihood(logprobs, choice, neutral=neutral, top_token_id=7)
        assert readout.option_logits == pytest.approx(scores)
        total = sum(math.exp(score) for score in scores)
        assert readout.probabilities == pytest.approx([math.exp(s) / total for s in scores])
        assert readout.allowed_token_mass == pytest.approx(sum(math.exp(j) for j in joint))
        assert readout.top_token_id == 7


def test_non_finite_log_probabilities_are_refused() -> None:
    with pytest.raises(NonFiniteLogitsError):
        read_likelihood([[-1.0], [float("nan")]], ReadoutChoice("likelihood"), top_token_id=0)


def test_an_option_that_merges_with_the_prompt_is_refused_by_name() -> None:
    assert option_tokens([1, 2, 3, 4], [1, 2], "decision.options", "a") == [3, 4]
    with pytest.raises(RequestError, match='option "b" cannot be scored'):
        option_tokens([1, 9, 4], [1, 2], "decision.options", "b")
    with pytest.raises(RequestError, match="or is empty"):
        option_tokens([1, 2], [1, 2], "decision.options", "c")


def _body(options: int, **policy: Any) -> dict[str, Any]:
    listed = [{"id": f"o{i}", "description": f"Option {i}."} for i in range(options)]
    return {"decision": {"id": "d", "state": "s", "question": "q", "options": listed}, **policy}


def test_the_policy_names_readout_and_normalization_and_lifts_the_letter_cap() -> None:
    request = parse_decision_body(_body(40, readout="likelihood", normalization="pmi"), 4)
    assert request.policy.readout_choice(ReadoutChoice()) == ReadoutChoice("likelihood", "pmi")
    assert len(request.decisions[0].options) == 40
    assert len(parse_decision_body(_body(40), 4, "likelihood").decisions[0].options) == 40
    with pytest.raises(RequestError, match=r"decision.options: has 17 options; allowed 2..16"):
        parse_decision_body(_body(17), 4)
    with pytest.raises(RequestError, match=r"allowed 2..1024"):
        parse_decision_body(_body(1025, readout="likelihood"), 4)
    with pytest.raises(RequestError, match='readout: "logits" is not one of letters, likelihood'):
        parse_decision_body(_body(3, readout="logits"), 4)
    with pytest.raises(RequestError, match=r'normalization: "max" is not one of sum, mean, pmi'):
        parse_decision_body(_body(3, normalization="max"), 4)
    with pytest.raises(RequestError, match=r"normalization: must be a string"):
        parse_decision_body(_body(3, normalization=3), 4)


def test_the_server_default_readout_is_a_setting() -> None:
    settings = load_settings({"SEMIF_READOUT": "likelihood", "SEMIF_NORMALIZATION": "mean"})
    assert settings.readout_choice == ReadoutChoice("likelihood", "mean")
    assert load_settings({}).readout_choice == ReadoutChoice("letters", "mean")
    assert load_settings({}).likelihood_prompt == "unlisted"
    listed = load_settings({"SEMIF_LIKELIHOOD_PROMPT": "listed"})
    assert listed.likelihood_prompt == "listed"
    with pytest.raises(SettingsError, match="SEMIF_LIKELIHOOD_PROMPT"):
        load_settings({"SEMIF_LIKELIHOOD_PROMPT": "hidden"})


def test_the_prompt_lists_each_options_answer_text_or_no_options() -> None:
    labelled = Decision(
        "d", STATE, QUESTION, (Option("a", "Refund the order.", "refund"), Option("b", "Wait."))
    )
    listed = likelihood_messages(labelled, "listed")[1]["content"]
    assert "Options:\n- refund: Refund the order.\n- Wait.\n" in listed
    assert [answer_text(option) for option in labelled.options] == ["refund", "Wait."]
    unlisted = likelihood_messages(labelled, "unlisted")[1]["content"]
    assert STATE in unlisted
    assert QUESTION in unlisted
    for listed_only in ("Options", "Refund", "Wait"):
        assert listed_only not in unlisted


def test_a_label_is_checked_like_the_other_fields() -> None:
    body = _body(2)
    body["decision"]["options"][0]["label"] = "x" * 257
    with pytest.raises(RequestError, match=r"decision.options\[0\].label: is 257 characters"):
        parse_decision_body(body, 4)
    body["decision"]["options"][0]["label"] = 7
    with pytest.raises(RequestError, match=r"decision.options\[0\].label: must be a string"):
        parse_decision_body(body, 4)
    body["decision"]["options"][0]["label"] = "first"
    assert parse_decision_body(body, 4).decisions[0].options[0].label == "first"


# -- against brute force on real llama.cpp ---------------------------------------------------


def _decision(options: tuple[tuple[str, str], ...] = OPTIONS) -> Decision:
    return Decision("d", STATE, QUESTION, tuple(Option(i, text) for i, text in options))


def _brute_force(
    service: DecisionService,
    fresh: DecisionService,
    arranged: Decision,
    listing: Listing,
    prompt: RenderedPrompt | None = None,
) -> list[float]:
    """Each option's joint log-probability, one token at a time: the prompt (the
    question's, else `prompt`) plus the option's first j tokens decoded alone on an empty
    cache, the last row's logits read."""
    prompt = prompt or render_likelihood_prompt(service.template, arranged, listing)
    tokens = service.tokenize_prompt(prompt, "decision")
    joint = []
    for option in arranged.options:
        branch = service.tokenize_prompt(with_answer(prompt, answer_text(option)), "decision")
        answer = [*branch[len(tokens) :], service.engine.vocab.end_of_turn]
        total = 0.0
        for j, token in enumerate(answer):
            fresh.engine.reset()
            (alone,), _ = fresh.engine.score([[*tokens, *answer[:j]]])
            total += float(log_probabilities(alone.logits)[token])
        joint.append(total)
    return joint


@pytest.mark.parametrize("listing", ["listed", "unlisted"])
def test_each_options_log_probability_equals_a_separate_forward(
    tiny_any_gguf: Path, listing: Listing
) -> None:
    """Exact on the exact path, on both memory kinds and both listings: the branches
    (decoded together, the prompt once, on a cache warmed by other questions) give every
    option, scored by its description or its label, the joint log-probability that
    decoding each prefix alone gives."""
    service = service_of(open_test_model(tiny_any_gguf))
    fresh = service_of(open_test_model(tiny_any_gguf))
    service.listing = listing
    try:
        sums = ReadoutChoice("likelihood", "sum")
        other = _decision((("a", "Another answer."), ("b", "Yet another one, longer.")))
        service.score([other], ["warm"], readouts=[sums])
        decision = _decision()
        labelled = (Option("refund", OPTIONS[0][1], "refund now"), *decision.options[1:])
        decision = Decision("d", STATE, QUESTION, labelled)
        arranged = arrange(decision, canonical_order(decision.options))
        batch = service.score([arranged, other], ["d", "o"], readouts=[sums, sums])
        assert batch.readouts[0].option_logits == _brute_force(service, fresh, arranged, listing)
    finally:
        service.close(10)
        fresh.close(10)


# Options that share prefixes at several depths, one ending where others go on: the tree
# (adapter.option_tree) carries one-token edges, grows edges out of edges, and reads that
# option's end of turn after the branch point.
TREE_OPTIONS = (
    ("a", "Billing: refund the order"),
    ("b", "Billing: refund the order in full"),
    ("c", "Billing: refund the shipping"),
    ("d", "Billing: invoice"),
    ("e", "Billing"),
    ("f", "Shipping: resend"),
    ("g", "Shipping: resend it by courier"),
)


@pytest.mark.parametrize("normalization", ["sum", "pmi"])
def test_an_option_tree_reads_what_each_branch_alone_reads(
    tiny_any_gguf: Path, normalization: str
) -> None:
    """Options sharing prefixes are decoded as a tree, each shared prefix once, on every
    memory kind; every option's joint log-probability is bit for bit what decoding each of
    its prefixes alone gives (pmi: its neutral branches form a tree of their own)."""
    service = service_of(open_test_model(tiny_any_gguf))
    fresh = service_of(open_test_model(tiny_any_gguf))
    try:
        decision = _decision(TREE_OPTIONS)
        arranged = arrange(decision, canonical_order(decision.options))
        choice = ReadoutChoice("likelihood", normalization)  # type: ignore[arg-type]
        batch = service.score([arranged], ["d"], readouts=[choice])
        joint = _brute_force(service, fresh, arranged, "unlisted")
        if normalization == "pmi":
            neutral = render_neutral_prompt(service.template, "unlisted")
            prior = _brute_force(service, fresh, arranged, "unlisted", neutral)
            joint = [
                float(np.float64(j) - np.float64(n)) for j, n in zip(joint, prior, strict=True)
            ]
        assert batch.readouts[0].option_logits == joint
    finally:
        service.close(10)
        fresh.close(10)


def test_unlisted_and_labelled_options_stay_bit_identical_under_permutation(
    tiny_gguf: Path,
) -> None:
    service = service_of(open_test_model(tiny_gguf))
    assert service.listing == "unlisted"  # the default
    mean = ReadoutChoice("likelihood", "mean")
    options = [Option(key, text, key.upper()) for key, text in OPTIONS]
    try:
        answers = []
        for seed in range(3):
            random.Random(seed).shuffle(options)
            decision = Decision("d", STATE, QUESTION, tuple(options))
            (reading,), _ = service.read_variants(
                [Variants.of(decision, "choice", "canonical", None, mean)], ["d"]
            )
            answers.append(dict(zip(decision.option_ids, reading.probabilities, strict=True)))
        assert answers[0] == answers[1] == answers[2]
        assert service.likelihood_prompt_version == "semif-option-likelihood-unlisted/1"
    finally:
        service.close(10)


def _ask(options: list[tuple[str, str]], **policy: Any) -> dict[str, Any]:
    listed = [{"id": key, "description": text} for key, text in options]
    decision = {"id": "d", "state": STATE, "question": QUESTION, "options": listed}
    return {"decision": decision, "readout": "likelihood", **policy}


@pytest.mark.parametrize("normalization", ["sum", "mean", "pmi"])
def test_permuting_options_gives_bit_identical_probabilities(
    client: TestClient, normalization: str
) -> None:
    rng = random.Random(normalization)
    options = list(OPTIONS)
    first = post_ok(client, _ask(options, normalization=normalization))["result"]
    assert (first["readout"], first["normalization"]) == ("likelihood", normalization)
    assert first["option_order"] == "canonical"
    assert first["prompt_version"] == "semif-option-likelihood-unlisted/1"
    assert sum(first["probabilities"]) == pytest.approx(1.0)
    expected = dict(zip(first["option_ids"], first["probabilities"], strict=True))
    for _ in range(3):
        rng.shuffle(options)
        result = post_ok(client, _ask(options, normalization=normalization))["result"]
        assert dict(zip(result["option_ids"], result["probabilities"], strict=True)) == expected


@pytest.fixture(scope="module")
def client(tiny_module_client: TestClient) -> TestClient:
    return tiny_module_client


def test_pmi_divides_out_the_neutral_prompt_once_then_remembers_it(client: TestClient) -> None:
    options = [("x", "A brand new option nobody asked before."), ("y", "And its sibling.")]
    first = post_ok(client, _ask(options, normalization="pmi"))["result"]
    again = post_ok(client, _ask(options, normalization="pmi"))["result"]
    assert again["probabilities"] == first["probabilities"]
    # the second time only the prompt's branches are sent: the neutral ones are remembered
    assert again["input_tokens"] < first["input_tokens"]
    sums = post_ok(client, _ask(options, normalization="sum"))["result"]["option_logits"]
    assert first["option_logits"] != sums


def test_pmi_with_some_neutral_scores_remembered_equals_a_cold_service(tiny_gguf: Path) -> None:
    """The remembered neutral scores and the fresh ones are put back in the right places:
    a service that knows two of three options' neutral scores answers exactly as one that
    knows none."""
    warm = service_of(open_test_model(tiny_gguf))
    cold = service_of(open_test_model(tiny_gguf))
    pmi = ReadoutChoice("likelihood", "pmi")
    three = arrange(_decision(OPTIONS[:3]), canonical_order(_decision(OPTIONS[:3]).options))
    try:
        warm.score([_decision(OPTIONS[1:3])], ["d"], readouts=[pmi])
        known = warm.score([three], ["d"], readouts=[pmi]).readouts[0]
        fresh = cold.score([three], ["d"], readouts=[pmi]).readouts[0]
        assert known.option_logits == fresh.option_logits
        assert len(warm._branches._neutral_scores) == 3
    finally:
        warm.close(10)
        cold.close(10)


def test_shared_state_and_system_one_read_by_likelihood_match_each_alone(
    client: TestClient,
) -> None:
    alone = post_ok(client, _ask(list(OPTIONS)))["result"]
    other = [{"id": "yes", "description": "Yes."}, {"id": "no", "description": "No, never."}]
    shared = post_ok(
        client,
        {
            "decisions": [
                {**_ask(list(OPTIONS))["decision"], "id": "first"},
                {"id": "second", "state": STATE, "question": "Is it urgent?", "options": other},
            ],
            "readout": "likelihood",
        },
    )
    assert shared["results"][0]["probabilities"] == alone["probabilities"]
    criteria = {key: text for key, text in OPTIONS}
    answers = post_ok(
        client,
        {
            "state": STATE,
            "questions": {
                "action": {"type": "choice", "instructions": QUESTION, "criteria": criteria},
                "urgent": {"type": "noul", "instructions": "Is it urgent?"},
                "level": {"type": "score", "instructions": "How bad?", "criteria": ["0", "1"]},
            },
            "readout": "likelihood",
        },
        "/v1/systemone",
    )["answers"]
    assert answers["action"]["probabilities"] == dict(
        zip(alone["option_ids"], alone["probabilities"], strict=True)
    )
    assert 0.0 < answers["urgent"]["noul"] < 1.0
    assert answers["level"]["type"] == "score"  # read by letters, as levels are positions


def test_many_multi_token_options_ride_one_request(client: TestClient) -> None:
    options = [(f"o{i}", f"Opt {i}, say.") for i in range(40)]
    result = post_ok(client, _ask(options))["result"]
    assert len(result["probabilities"]) == 40
    assert sum(result["probabilities"]) == pytest.approx(1.0)


def test_the_request_token_budget_charges_every_branch(tiny_model_dir: Path) -> None:
    """Each branch is charged (its rows and its stream's copy): 80 options fit the prompt
    limit one by one, not the request budget all together."""
    options = [(f"o{i}", f"Opt {i}.") for i in range(80)]
    settings = Settings(model_dir=tiny_model_dir, max_tokens=700, max_request_tokens=400)
    with serving(settings) as limited:
        response = limited.post("/invocations", content=json.dumps(_ask(options)), headers=HEADERS)
        assert response.status_code == 400, response.text
        assert "SEMIF_MAX_REQUEST_TOKENS" in response.json()["error"]
        assert (
            limited.post(
                "/invocations", content=json.dumps(_ask(options[:3])), headers=HEADERS
            ).status_code
            == 200
        )


def test_an_option_the_tokenizer_merges_into_the_prompt_is_refused(tiny_gguf: Path) -> None:
    """A template whose prompt ends in a space: the tiny tokenizer merges " t" into one
    token, so an option starting with "t" would be scored on tokens the model never reads
    after this prompt. Refused with a 400 naming the option; the others are fine."""
    model = open_test_model(tiny_gguf)
    service = service_of(model)
    service.template = ChatTemplate(CHAT_TEMPLATE.replace("assistant\n", "assistant "), "", "")
    try:
        choice = ReadoutChoice("likelihood")
        fine = _decision((("a", "Accept."), ("b", "Block.")))
        assert len(service.score([fine], ["decision"], readouts=[choice]).readouts) == 1
        merged = _decision((("a", "Accept."), ("t", "take it")))
        with pytest.raises(RequestError, match=r'decision\.options: option "t" cannot be scored'):
            service.score([merged], ["decision"], readouts=[choice])
    finally:
        service.close(10)


def test_labels_change_what_likelihood_scores_and_nothing_the_letters_read(
    client: TestClient,
) -> None:
    plain = _ask(list(OPTIONS))
    labelled = json.loads(json.dumps(plain))
    for option in labelled["decision"]["options"]:
        option["label"] = option["id"]
    by_text = post_ok(client, plain)["result"]
    by_label = post_ok(client, labelled)["result"]
    # the default prompt does not list the options: the same prompt, other branches
    assert by_label["prompt_sha256"] == by_text["prompt_sha256"]
    assert by_label["option_logits"] != by_text["option_logits"]
    letters = [
        post_ok(client, {**body, "readout": "letters"})["result"] for body in (plain, labelled)
    ]
    assert letters[0]["prompt_sha256"] == letters[1]["prompt_sha256"]
    assert letters[0]["probabilities"] == letters[1]["probabilities"]


@pytest.mark.parametrize("normalization", ["sum", "mean", "pmi"])
def test_clones_split_one_answers_probability_and_move_no_other_option(
    client: TestClient, normalization: str
) -> None:
    """Two options with the same answer text are one answer: equal scores, its probability
    split evenly between them, every other option's probability and the answer mass
    bit-identical to the question without the clone (the unlisted prompt does not show the
    options, so the clone changes nothing the model reads)."""
    alone = _ask([("a", "Refund it."), ("c", "Keep it."), ("d", "Escalate it.")])
    cloned = _ask(
        [("a", "Refund it."), ("b", "Pay it back."), ("c", "Keep it."), ("d", "Escalate it.")]
    )
    cloned["decision"]["options"][1]["label"] = "Refund it."
    one = post_ok(client, {**alone, "normalization": normalization})["result"]
    two = post_ok(client, {**cloned, "normalization": normalization})["result"]
    p1 = dict(zip(one["option_ids"], one["probabilities"], strict=True))
    p2 = dict(zip(two["option_ids"], two["probabilities"], strict=True))
    assert p2["a"] == p2["b"]
    assert p2["a"] + p2["b"] == p1["a"]
    assert (p2["c"], p2["d"]) == (p1["c"], p1["d"])
    assert two["option_logits"][0] == two["option_logits"][1]
    assert two["allowed_token_mass"] == one["allowed_token_mass"]
    assert two["option_clones"] == [["a", "b"]]
    assert "option_clones" not in one
