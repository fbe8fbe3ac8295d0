"""The System One wire format on the tiny real model: shapes, translation, errors, auth,
and the letter-digit labels past 52 options scored exactly."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from starlette.testclient import TestClient

from adapter import settings as settings_module
from adapter.labels import LabelError, LabelSet
from adapter.prompts import PAIR_LABELS, SINGLE_LABELS, answer_labels, render_decision
from adapter.readout import log_probabilities
from adapter.runtime import LoadedModel
from adapter.schema import Decision, Option
from adapter.settings import Settings, load_settings
from adapter.systemone import confidence
from tests.support.live_server import runtime_of
from tests.support.models import open_test_model, service_of
from tests.support.serving import serving

HEADERS = {"content-type": "application/json"}
STATE = {"ticket": 48213, "text": "I was charged twice for my March invoice."}


def questions(choices: int = 3) -> dict[str, Any]:
    return {
        "refund": {
            "type": "noul",
            "instructions": "Does the customer ask for a refund?",
            "criteria": {"true": "A refund is requested.", "false": "No refund is requested."},
        },
        "queue": {
            "type": "choice",
            "instructions": "Which queue should handle this ticket?",
            "criteria": {
                f"q{i}": (None if i % 2 else f"Queue number {i}.") for i in range(choices)
            },
        },
        "urgency": {
            "type": "score",
            "instructions": "How urgent is this ticket?",
            "criteria": ["Not urgent.", "Somewhat urgent.", "Very urgent."],
        },
    }


def post(client: TestClient, body: Any, path: str = "/v1/systemone", **headers: str) -> Any:
    return client.post(path, content=json.dumps(body), headers={**HEADERS, **headers})


@pytest.fixture
def client(tiny_model_dir: Path) -> Iterator[TestClient]:
    with serving(Settings(model_dir=tiny_model_dir, max_tokens=4096, threads=1)) as served:
        yield served


def test_answers_have_exactly_the_format_shape(client: TestClient) -> None:
    response = post(client, {"model": "any", "state": STATE, "questions": questions()})
    assert response.status_code == 200
    body = response.json()
    assert set(body) == {"model", "answers", "usage"}
    assert body["model"] == "tiny.gguf"
    assert list(body["answers"]) == ["refund", "queue", "urgency"]
    noul, choice, score = body["answers"].values()
    assert set(noul) == {"type", "noul"}
    assert noul["type"] == "noul"
    assert 0.0 < noul["noul"] < 1.0
    assert set(choice) == {"type", "choice", "probabilities", "confidence"}
    assert list(choice["probabilities"]) == ["q0", "q1", "q2"]
    probabilities = choice["probabilities"]
    assert sum(probabilities.values()) == pytest.approx(1.0, abs=1e-9)
    assert choice["choice"] == max(probabilities, key=probabilities.__getitem__)
    assert choice["confidence"] == pytest.approx(confidence(list(probabilities.values())))
    assert set(score) == {"type", "score", "legend", "probabilities", "confidence"}
    assert score["legend"] == {"0": "Not urgent.", "1": "Somewhat urgent.", "2": "Very urgent."}
    levels = score["probabilities"]
    assert list(levels) == ["0", "1", "2"]
    assert score["score"] == pytest.approx(sum(int(k) * p for k, p in levels.items()))
    assert body["usage"]["output_tokens"] == 0


def test_invocations_body_with_questions_is_system_one(client: TestClient) -> None:
    body = {"state": STATE, "questions": questions()}
    direct = post(client, body).json()
    invoked = post(client, body, "/invocations")
    assert invoked.status_code == 200
    answers = invoked.json()["answers"]
    assert answers.keys() == direct["answers"].keys()
    for key, answer in answers.items():
        assert answer.get("noul") == pytest.approx(direct["answers"][key].get("noul"))
        assert answer.get("probabilities", {}) == pytest.approx(
            direct["answers"][key].get("probabilities", {}), abs=1e-6
        )


def test_usage_counts_the_shared_state_once_in_batched_passes(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = runtime_of(client.app).service
    assert service is not None
    calls: list[int] = []
    real_score = service.engine.score

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(len(args[0]))
        return real_score(*args, **kwargs)

    monkeypatch.setattr(service.engine, "score", counting)
    each = [
        post(client, {"state": STATE, "questions": {key: question}}).json()["usage"]
        for key, question in questions().items()
    ]
    together = post(client, {"state": STATE, "questions": questions()}).json()["usage"]
    # The questions of one request share one pass: their state costs its rows once.
    assert calls == [1, 1, 1, 3]
    state_tokens = len(service.engine.vocab.tokenize(json.dumps(STATE)))
    separate = sum(usage["input_tokens"] for usage in each)
    assert together["input_tokens"] <= separate - 2 * state_tokens


def test_question_keys_are_never_shown_to_the_model(client: TestClient) -> None:
    original = post(client, {"state": STATE, "questions": questions()}).json()["answers"]
    renamed = {f"other_name_{key}": value for key, value in questions().items()}
    answers = post(client, {"state": STATE, "questions": renamed}).json()["answers"]
    for key, answer in original.items():
        again = answers[f"other_name_{key}"]
        assert again.get("noul") == pytest.approx(answer.get("noul"), abs=1e-6)
        assert again.get("score") == pytest.approx(answer.get("score"), abs=1e-6)


def test_choice_is_the_decision_api_on_the_same_options(client: TestClient) -> None:
    """A null description means the key itself: the prompt equals the decision's."""
    choice = {"type": "choice", "instructions": "Which queue?", "criteria": {"a": None, "b": "B."}}
    system_one = post(client, {"state": "Text.", "questions": {"x": choice}}).json()
    decision = {
        "id": "x",
        "state": "Text.",
        "question": "Which queue?",
        "options": [{"id": "a", "description": "a"}, {"id": "b", "description": "B."}],
    }
    result = post(client, {"decision": decision}, "/invocations").json()["result"]
    probabilities = system_one["answers"]["x"]["probabilities"]
    assert [probabilities["a"], probabilities["b"]] == pytest.approx(
        result["probabilities"], abs=1e-6
    )


def test_noul_without_criteria_asks_yes_or_no(client: TestClient) -> None:
    question = {"type": "noul", "instructions": "Is it about billing?"}
    plain = post(client, {"state": "Text.", "questions": {"n": question}}).json()
    explicit = {**question, "criteria": {"true": "Yes", "false": "No"}}
    same = post(client, {"state": "Text.", "questions": {"n": explicit}}).json()
    assert plain["answers"]["n"]["noul"] == pytest.approx(same["answers"]["n"]["noul"], abs=1e-6)


def test_models_lists_the_served_model(client: TestClient) -> None:
    response = client.get("/v1/models")
    assert response.status_code == 200
    assert [model["id"] for model in response.json()["data"]] == ["tiny.gguf"]


def test_confidence_is_one_less_the_normalized_entropy() -> None:
    """Certain is 1, uniform is 0; an even split over 2 of 4 options carries 1 of the 2 bits
    a choice of 4 can, so 0.5; it does not depend on the options' order and grows as the
    distribution sharpens."""
    assert confidence([1.0, 0.0, 0.0]) == 1.0
    assert confidence([0.25] * 4) == pytest.approx(0.0)
    assert confidence([0.5, 0.5, 0.0, 0.0]) == pytest.approx(0.5)
    assert confidence([0.0, 0.5, 0.0, 0.5]) == pytest.approx(0.5)
    assert confidence([0.5, 0.3, 0.2]) < confidence([0.7, 0.2, 0.1]) < confidence([0.9, 0.05, 0.05])


# -- errors -------------------------------------------------------------------------------


def _with(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    """A valid request with the value at `path` replaced (or removed when value is ...)."""
    body: dict[str, Any] = {"state": STATE, "questions": questions()}
    target = body
    for key in path[:-1]:
        target = target[key]
    if value is ...:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return body


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("state",), ..., "state"),
        (("state",), 42, "state"),
        (("questions",), ["refund"], "questions"),
        (("model",), 3, "model"),
        (("extra",), True, "body.extra"),
        (("questions", "refund", "type"), "maybe", "questions.refund.type"),
        (("questions", "refund", "instructions"), ..., "questions.refund.instructions"),
        (("questions", "refund", "instructions"), ["x"], "questions.refund.instructions"),
        (("questions", "refund", "criteria"), {"yes": "Y"}, "questions.refund.criteria.yes"),
        (("questions", "queue", "criteria"), ["a", "b"], "questions.queue.criteria"),
        (("questions", "queue", "criteria"), {"a": 1, "b": None}, "questions.queue.criteria.a"),
        (("questions", "urgency", "criteria"), ..., "questions.urgency.criteria"),
        (("questions", "urgency", "criteria"), {"0": "low"}, "questions.urgency.criteria"),
        (("questions", "urgency", "criteria"), ["low", 2], "questions.urgency.criteria[1]"),
        (("readout",), 1, "readout"),
        (("normalization",), ["sum"], "normalization"),
    ],
)
def test_schema_failures_are_422_naming_the_field(
    client: TestClient, path: tuple[str, ...], value: Any, field: str
) -> None:
    response = post(client, _with(path, value))
    assert response.status_code == 422
    assert response.json()["field"] == field
    assert response.json()["error"].startswith(f"{field}: ")


@pytest.mark.parametrize(
    ("path", "value", "field", "rule"),
    [
        (("state",), "  ", "state", "must not be empty"),
        (("state",), {}, "state", "must not be empty"),
        (("questions",), {}, "questions", "has 0 entries; allowed 1..64"),
        (("questions", "refund", "instructions"), "", "questions.refund.instructions", "empty"),
        (("questions", "queue", "criteria"), {"a": None}, "questions.queue.criteria", "1..."),
        (
            ("questions", "queue", "criteria"),
            {f"o{i}": None for i in range(256)},
            "questions.queue.criteria",
            "has 256 entries; allowed 2..255",
        ),
        (("questions", "urgency", "criteria"), ["only"], "questions.urgency.criteria", "2..10"),
        (("questions", "urgency", "criteria"), ["x"] * 11, "questions.urgency.criteria", "2..10"),
        (("questions", "urgency", "criteria"), ["low", " "], "questions.urgency.criteria[1]", ""),
        (("readout",), "logits", "readout", "is not one of letters, likelihood"),
    ],
)
def test_rule_violations_are_400_naming_the_field(
    client: TestClient, path: tuple[str, ...], value: Any, field: str, rule: str
) -> None:
    response = post(client, _with(path, value))
    assert response.status_code == 400
    assert response.json()["field"] == field
    assert rule.rstrip(".") in response.json()["error"]


def test_duplicate_keys_are_a_400(client: TestClient) -> None:
    raw = (
        b'{"state": "s", "questions": {"q": {"type": "choice", "instructions": "i",'
        b' "criteria": {"a": null, "b": null, "a": "again"}}}}'
    )
    response = client.post("/v1/systemone", content=raw, headers=HEADERS)
    assert response.status_code == 400
    assert 'duplicate key "a"' in response.json()["error"]


def test_prompt_over_the_token_limit_is_a_400_naming_the_question(tiny_model_dir: Path) -> None:
    with serving(Settings(model_dir=tiny_model_dir, max_tokens=256, threads=1)) as small:
        response = post(small, {"state": "word " * 100, "questions": questions()})
    assert response.status_code == 400
    assert response.json()["field"] == "questions.refund"
    assert "(SEMIF_MAX_TOKENS)" in response.json()["error"]


def test_api_key_guards_the_v1_routes_and_inside_sagemaker_only_those(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(settings_module, "SAGEMAKER_MODEL_DIR", tiny_model_dir)
    settings = Settings(
        model_dir=tiny_model_dir, threads=1, api_key="s3cret", allow_unverified_model=True
    )
    assert settings.in_sagemaker
    assert not settings.guard_invocations
    body = {"state": STATE, "questions": questions()}
    with serving(settings) as guarded:
        missing = post(guarded, body)
        wrong = post(guarded, body, authorization="Bearer nope")
        accented = guarded.post(
            "/v1/systemone",
            content=json.dumps(body),
            headers={b"content-type": b"application/json", b"authorization": b"Bearer s\xe9cret"},
        )
        right = post(guarded, body, authorization="Bearer s3cret")
        models = guarded.get("/v1/models")
        # SageMaker authenticates /invocations with IAM; the container cannot see a key.
        invoked = post(guarded, body, "/invocations")
        ping = guarded.get("/ping")
    assert (missing.status_code, wrong.status_code, right.status_code) == (401, 401, 200)
    assert accented.status_code == 401  # a non-ASCII key is a wrong key, not a crash
    assert missing.headers["www-authenticate"] == "Bearer"
    assert "SEMIF_API_KEY" in missing.json()["error"]
    assert models.status_code == 401
    assert invoked.status_code == 200
    assert ping.status_code == 200


def test_api_key_setting_is_read_and_never_printed() -> None:
    assert load_settings({}).api_key is None
    settings = load_settings({"SEMIF_API_KEY": " s3cret "})
    assert settings.api_key == "s3cret"
    assert "s3cret" not in repr(settings)


def test_label_problem_of_the_model_is_a_400(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = runtime_of(client.app).service
    assert service is not None

    class Refusing(LabelSet):
        def token_ids(self, labels: Any) -> Any:
            raise LabelError("this model cannot use the answer labels A0..Z9: (reason)")

    monkeypatch.setattr(service, "labels", Refusing(service.labels.tokens, {}))
    response = post(client, {"state": STATE, "questions": questions(choices=60)})
    assert response.status_code == 400
    assert response.json()["field"] == "questions.refund"
    assert "A0..Z9" in response.json()["error"]


# -- labels past 52 options ---------------------------------------------------------------


def test_labels_scale_from_letters_to_letter_digit_pairs() -> None:
    assert answer_labels(16) == tuple("ABCDEFGHIJKLMNOP")
    assert answer_labels(52)[25:27] == ("Z", "a")
    assert answer_labels(53)[:3] == ("A0", "A1", "A2")
    assert answer_labels(255)[-1] == "Z4"
    assert len(set(answer_labels(255))) == 255


def test_every_label_is_checked_at_load(tiny_gguf: Path) -> None:
    model = open_test_model(tiny_gguf, max_branches=27, threads=1)
    try:
        singles = model.labels.token_ids(SINGLE_LABELS)
        pairs = model.labels.token_ids(PAIR_LABELS)
        assert all(len(tokens) == 1 for tokens in singles)
        assert all(len(tokens) == 2 for tokens in pairs)
        assert [
            model.engine.vocab.piece(a) + model.engine.vocab.piece(b) for a, b in pairs
        ] == list(PAIR_LABELS)
    finally:
        model.engine.close()


def test_pair_labels_are_exact_in_one_batched_pass(tiny_gguf: Path) -> None:
    """P(label) = P(letter) * P(digit | letter), read from the same batched decode as the
    prompt, equals that product computed by decoding each prompt and continuation alone.

    The two differ only by llama.cpp's batch-shape numerics: about 0.03 nats on average for
    the first letter alone at 2000-token suffixes, where no continuation is involved. A
    label mix-up or a continuation attending to the wrong branch is off by nats (see the
    spread), and the continuations leave the prompt's own logits untouched.
    """
    model = open_test_model(tiny_gguf, max_branches=30, threads=1)
    engine = model.engine
    try:
        service = service_of(model, max_tokens=4096)
        decisions = [
            Decision("wide", "Shared evidence.", "Which code?", _options(255)),
            Decision("mid", "Shared evidence.", "Which other code?", _options(60)),
            Decision("small", "Shared evidence.", "Which queue?", _options(3)),
        ]
        batch = service.score(decisions, ["wide", "mid", "small"])
        # Over several passes: 30 sequences and ~4,600 rows, at most 1,024 rows a pass.
        assert batch.timing.passes > 1
        for decision, readout in zip(decisions, batch.readouts, strict=True):
            joint = _reference_log_probabilities(model, decision)
            weights = np.exp(joint - joint.max())
            assert readout.probabilities == pytest.approx(weights / weights.sum(), abs=0.01)
            assert sum(readout.probabilities) == pytest.approx(1.0)
            assert 0.0 < readout.allowed_token_mass <= 1.0
            if len(decision.options) > len(SINGLE_LABELS):
                errors = np.abs(np.array(readout.option_logits) - joint)
                assert errors.mean() < 0.1
                assert errors.max() < 0.5  # measured 0.23; two swapped labels differ by nats
                assert joint.max() - joint.min() > 5.0
    finally:
        engine.close()


def test_continuations_leave_the_prompt_logits_untouched(tiny_gguf: Path) -> None:
    model = open_test_model(tiny_gguf, max_branches=30, threads=1)
    engine = model.engine
    try:
        decisions = [
            Decision("a", "Shared evidence.", "Which code?", _options(80)),
            Decision("b", "Shared evidence.", "Which queue?", _options(3)),
        ]
        prompts = [engine.vocab.tokenize(render_decision(model.template, d)) for d in decisions]
        pairs = model.labels.token_ids(answer_labels(80))
        letters = [sorted({pair[0] for pair in pairs}), []]
        engine.reset()
        plain, _ = engine.score(prompts)
        engine.reset()
        extended, _ = engine.score(prompts, letters)
        for without, with_letters in zip(plain, extended, strict=True):
            assert np.abs(without.logits - with_letters.logits).max() < 1e-5
        assert sorted(extended[0].next_logits) == letters[0]
        assert extended[1].next_logits == {}
    finally:
        engine.close()


def _options(count: int) -> tuple[Option, ...]:
    return tuple(Option(f"o{i}", f"code {i}") for i in range(count))


def _reference_log_probabilities(model: LoadedModel, decision: Decision) -> np.ndarray:
    """log P(label) of each label from separate single-prompt decodes (prefix reuse makes
    each continuation cost two tokens: the prompt's last and the letter)."""
    engine = model.engine
    prompt = engine.vocab.tokenize(render_decision(model.template, decision))
    engine.reset()
    (alone,), _ = engine.score([prompt])
    first = log_probabilities(alone.logits)
    label_tokens = model.labels.token_ids(answer_labels(len(decision.options)))
    second = {}
    for letter in {tokens[0] for tokens in label_tokens if len(tokens) == 2}:
        (after,), _ = engine.score([[*prompt, letter]])
        second[letter] = log_probabilities(after.logits)
    return np.array(
        [
            first[tokens[0]] + (second[tokens[0]][tokens[1]] if len(tokens) == 2 else 0.0)
            for tokens in label_tokens
        ]
    )
