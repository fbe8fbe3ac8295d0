"""Chat completions on the decision endpoint: the OpenAI shape, limits, sampling and stop
rules on the tiny model, and coherent text from the embedded SmolLM2."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from adapter.settings import Settings, SettingsError, load_settings
from tests.support.live_server import runtime_of
from tests.support.serving import decision, serving

HEADERS = {"content-type": "application/json"}
HELLO = [{"role": "user", "content": "Say hello."}]


def post(client: TestClient, body: Any, path: str = "/invocations") -> Any:
    return client.post(path, content=json.dumps(body), headers=HEADERS)


def chat(client: TestClient, **fields: Any) -> Any:
    return post(client, {"messages": HELLO, "temperature": 0, **fields})


@pytest.fixture
def client(tiny_model_dir: Path) -> Iterator[TestClient]:
    settings = Settings(model_dir=tiny_model_dir, max_tokens=1024, max_chat_tokens=32, threads=1)
    with serving(settings) as served:
        yield served


def test_chat_completion_shape(client: TestClient) -> None:
    response = chat(client, max_tokens=6)
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["id"] == f"chatcmpl-{response.headers['x-request-id']}"
    assert body["model"] == "tiny.gguf"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 1 <= usage["completion_tokens"] <= 6
    if usage["completion_tokens"] == 6:
        assert choice["finish_reason"] == "length"


def test_greedy_is_deterministic_and_the_v1_route_agrees(client: TestClient) -> None:
    first = chat(client, max_tokens=12).json()["choices"][0]["message"]["content"]
    again = chat(client, max_tokens=12).json()["choices"][0]["message"]["content"]
    routed = post(
        client, {"messages": HELLO, "temperature": 0, "max_tokens": 12}, "/v1/chat/completions"
    )
    assert first == again == routed.json()["choices"][0]["message"]["content"]


def test_sampling_with_a_seed_repeats(client: TestClient) -> None:
    fields = {"temperature": 1.0, "top_p": 0.9, "seed": 7, "max_tokens": 16}
    texts = {chat(client, **fields).json()["choices"][0]["message"]["content"] for _ in range(2)}
    assert len(texts) == 1


def test_stop_string_ends_the_text_before_it(client: TestClient) -> None:
    text = chat(client, max_tokens=32).json()["choices"][0]["message"]["content"]
    assert len(text) >= 6, text
    marker = text[3:5]
    stopped = chat(client, max_tokens=32, stop=[marker]).json()["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["message"]["content"] == text[: text.index(marker)]


def test_decisions_after_chat_are_unchanged(client: TestClient) -> None:
    """Chat writes its tokens into the reused prefix cache; decisions must not notice."""
    before = post(client, {"decision": decision()}).json()["result"]["probabilities"]
    chat(client, max_tokens=20)
    after = post(client, {"decision": decision()}).json()["result"]["probabilities"]
    assert after == before


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_tokens": 33}, "max_tokens: must be an integer from 1 to 32 (SEMIF_MAX_CHAT_TOKENS)"),
        ({"max_tokens": 0}, "max_tokens: must be an integer from 1 to 32"),
        ({"max_completion_tokens": 99}, "max_completion_tokens: must be an integer from 1 to 32"),
        ({"n": 2}, "n: only one choice"),
        ({"temperature": 3}, "temperature: must be a number from 0.0 to 2.0"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop: must be a string or up to 4 strings"),
        ({"tools": []}, "tools: unsupported field"),
        ({"messages": []}, "messages: must be a non-empty array"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role: must be one of"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content: must be a string"),
    ],
)
def test_invalid_chat_requests_are_400(
    client: TestClient, fields: dict[str, Any], message: str
) -> None:
    response = chat(client, **fields)
    assert response.status_code == 400
    assert response.json()["error"].startswith(message)


def test_text_parts_are_joined(client: TestClient) -> None:
    parts = [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello."}]
    joined = post(client, {"messages": [{"role": "user", "content": parts}], "temperature": 0})
    plain = chat(client)
    assert joined.json()["choices"] == plain.json()["choices"]


def test_prompt_over_the_token_limit_is_400(tiny_model_dir: Path) -> None:
    settings = Settings(model_dir=tiny_model_dir, max_tokens=64, max_chat_tokens=8, threads=1)
    with serving(settings) as small:
        response = chat(small, messages=[{"role": "user", "content": "word " * 50}])
    assert response.status_code == 400
    assert response.json()["error"].startswith("messages: prompt is ")
    assert "(SEMIF_MAX_TOKENS)" in response.json()["error"]


def test_chat_takes_a_queue_place(tiny_model_dir: Path) -> None:
    """A chat waits in the same bounded queue as scoring: with SEMIF_MAX_QUEUE=1 held full
    by a scoring request in its pass, a chat is refused with a 429, a streamed one too, as
    the same JSON answer (refused before its first byte: no stream)."""
    settings = Settings(
        model_dir=tiny_model_dir, max_tokens=1024, max_chat_tokens=32, threads=1, max_queue=1
    )
    with serving(settings) as served:
        service = runtime_of(served.app).service
        assert service is not None
        gate, entered = threading.Event(), threading.Event()
        real_score = service.engine.score

        def gated(*args: Any, **kwargs: Any) -> Any:
            entered.set()
            gate.wait(10)
            return real_score(*args, **kwargs)

        service.engine.score = gated  # type: ignore[method-assign]
        first: dict[str, Any] = {}
        worker = threading.Thread(
            target=lambda: first.update(response=post(served, {"decision": decision()}))
        )
        worker.start()
        try:
            assert entered.wait(10)
            busy = chat(served, max_tokens=4)
            busy_stream = chat(served, max_tokens=4, stream=True)
        finally:
            gate.set()
            worker.join(10)
        after = chat(served, max_tokens=4)
    assert busy.status_code == 429
    assert busy.json()["retryable"] is True
    assert "SEMIF_MAX_QUEUE=1" in busy.json()["error"]
    assert busy.headers["retry-after"] == str(busy.json()["retry_after_seconds"])
    assert busy_stream.status_code == 429
    assert busy_stream.headers["content-type"] == "application/json"
    assert busy_stream.json()["error"] == busy.json()["error"]
    assert first["response"].status_code == 200
    assert after.status_code == 200


def test_chat_token_limit_setting() -> None:
    assert load_settings({}).max_chat_tokens == 512
    assert load_settings({"SEMIF_MAX_TOKENS": "128"}).max_chat_tokens == 128
    assert load_settings({"SEMIF_MAX_CHAT_TOKENS": "64"}).max_chat_tokens == 64
    with pytest.raises(SettingsError, match=r"SEMIF_MAX_CHAT_TOKENS=300 .* allowed 1\.\.256"):
        load_settings({"SEMIF_MAX_TOKENS": "256", "SEMIF_MAX_CHAT_TOKENS": "300"})


@pytest.mark.slow
def test_smollm2_answers_with_coherent_text(smollm2_gguf: Path) -> None:
    settings = Settings(gguf_path=smollm2_gguf, max_tokens=1024, threads=1)
    question = [{"role": "user", "content": "What is 2 + 2?"}]
    with serving(settings) as served:
        body = post(served, {"messages": question, "temperature": 0, "max_tokens": 48}).json()
    (choice,) = body["choices"]
    text = choice["message"]["content"]
    assert choice["finish_reason"] == "stop"  # the model ended its answer (EOG), not the limit
    assert "4" in text
    words = text.split()
    assert len(words) >= 3
    assert all(word.isascii() for word in words)
    assert body["usage"]["completion_tokens"] < 48
