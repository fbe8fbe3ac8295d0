"""Streamed chat (`"stream": true`): OpenAI's chunk events whose contents join to the whole
answer bit for bit (greedy and seeded, stop strings held back until decided, UTF-8 held
until whole), errors before the first byte as JSON and after it as an error event, the
admission held until the stream ends, the token metrics, and a client that leaves
mid-stream freeing the scheduler at the next token, on a real uvicorn socket."""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from adapter.app import create_app
from adapter.core.failures import CapacityError
from adapter.core.generation import GenerationRun, Sampling, stop_prefix_length
from adapter.core.layout import Copy, StreamCache
from adapter.settings import Settings
from tests.adapter.test_metrics import samples, value
from tests.support.live_server import live_server, runtime_of

HELLO = [{"role": "user", "content": "Say hello."}]
ROUTES = ("/invocations", "/v1/chat/completions")


def whole(client: TestClient, path: str = "/invocations", **fields: Any) -> dict[str, Any]:
    response = client.post(path, json={"messages": HELLO, "temperature": 0, **fields})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def events(text: str) -> list[Any]:
    """The events of a stream, `[DONE]` as the string it is; every event one `data:` line
    followed by a blank line."""
    blocks = text.split("\n\n")
    assert blocks[-1] == "", "the stream ends with a whole event"
    found: list[Any] = []
    for block in blocks[:-1]:
        assert block.startswith("data: "), block
        assert "\n" not in block, block
        data = block.removeprefix("data: ")
        found.append(data if data == "[DONE]" else json.loads(data))
    return found


def streamed(client: TestClient, path: str = "/invocations", **fields: Any) -> list[Any]:
    body = {"messages": HELLO, "temperature": 0, "stream": True, **fields}
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert response.headers["cache-control"] == "no-cache"
    found = events(response.text)
    completion_id = f"chatcmpl-{response.headers['x-request-id']}"
    assert all(chunk["id"] == completion_id for chunk in found[:-1] if "error" not in chunk)
    return found


def content(chunks: Sequence[Any]) -> str:
    return "".join(
        choice["delta"].get("content", "") for chunk in chunks for choice in chunk["choices"]
    )


def test_a_stream_is_the_whole_answer_in_chunks(tiny_client: TestClient) -> None:
    """The tiny model's greedy text (byte tokens, several of them one character) streamed
    through both routes: the role first, then content, the finish reason, `[DONE]`; the
    contents joined are the whole answer's content exactly, as are the finish reason and,
    when asked, the usage."""
    for path in ROUTES:
        for max_tokens in (1, 7, 48):
            answer = whole(tiny_client, path, max_tokens=max_tokens)
            (choice,) = answer["choices"]
            got = streamed(
                tiny_client, path, max_tokens=max_tokens, stream_options={"include_usage": True}
            )
            assert got[-1] == "[DONE]"
            *chunks, usage = got[:-1]
            assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
            assert all(chunk["model"] == "tiny.gguf" and "usage" in chunk for chunk in chunks)
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            finish = choice["finish_reason"]
            assert chunks[-1]["choices"] == [
                {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}
            ]
            assert content(chunks) == choice["message"]["content"]
            assert all(chunk["choices"][0]["delta"] for chunk in chunks[:-1])  # no empty piece
            assert usage["choices"] == []
            assert usage["usage"] == answer["usage"]


def test_without_include_usage_no_chunk_names_usage(tiny_client: TestClient) -> None:
    got = streamed(tiny_client, max_tokens=5)
    assert got[-1] == "[DONE]"
    assert all("usage" not in chunk for chunk in got[:-1])
    assert content(got[:-1]) == whole(tiny_client, max_tokens=5)["choices"][0]["message"]["content"]


def test_stop_strings_are_held_back_until_decided(tiny_client: TestClient) -> None:
    """A stop string that is met ends the stream's text where the whole answer's ends; one
    that only begins to match (its last character never comes) is held back and then sent:
    either way the joined contents are the whole answer's, and no piece ever holds part of
    a stop string that is met."""
    text = whole(tiny_client, max_tokens=48)["choices"][0]["message"]["content"]
    assert len(text) >= 8, text
    met, teased = text[3:6], text[3:6] + "\u2603"
    for stop in ([met], [teased], [teased, met]):
        answer = whole(tiny_client, max_tokens=48, stop=stop)["choices"][0]
        chunks = streamed(tiny_client, max_tokens=48, stop=stop)[:-1]
        assert content(chunks) == answer["message"]["content"]
        assert chunks[-1]["choices"][0]["finish_reason"] == answer["finish_reason"]
    assert content(streamed(tiny_client, max_tokens=48, stop=[met])[:-1]) == text[: text.index(met)]


def test_a_seeded_sample_streams_as_it_answers(tiny_client: TestClient) -> None:
    fields: dict[str, Any] = {"temperature": 1.0, "top_p": 0.9, "seed": 11, "max_tokens": 24}
    answer = whole(tiny_client, **fields)["choices"][0]["message"]["content"]
    assert content(streamed(tiny_client, **fields)[:-1]) == answer


def test_chat_token_metrics_count_a_stream(tiny_client: TestClient) -> None:
    whole(tiny_client, max_tokens=2)  # the counters' labels exist from the first chat on
    before = samples(tiny_client)
    got = streamed(tiny_client, max_tokens=9, stream_options={"include_usage": True})
    usage = got[-2]["usage"]
    after = samples(tiny_client)
    for kind, key in (("prompt", "prompt_tokens"), ("completion", "completion_tokens")):
        added = value(after, "semif_chat_tokens_total", kind=kind) - value(
            before, "semif_chat_tokens_total", kind=kind
        )
        assert added == usage[key]
    assert value(after, "semif_requests_total", api="chat", status="200") == 1 + value(
        before, "semif_requests_total", api="chat", status="200"
    )


USAGE = {"include_usage": True}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"stream": "yes"}, "stream: must be true or false"),
        ({"stream_options": USAGE}, 'stream_options: is only allowed with "stream": true'),
        ({"stream": True, "stream_options": []}, "stream_options: must be an object"),
        (
            {"stream": True, "stream_options": {"include_usage": 1}},
            "stream_options.include_usage: must be true or false",
        ),
        (
            {"stream": True, "stream_options": {"obfuscate": True}},
            "stream_options.obfuscate: unsupported field",
        ),
        ({"stream": True, "max_tokens": 513}, "max_tokens: must be an integer from 1 to 512"),
    ],
)
def test_invalid_stream_requests_are_400_json(
    tiny_client: TestClient, fields: dict[str, Any], message: str
) -> None:
    response = tiny_client.post("/invocations", json={"messages": HELLO, **fields})
    assert response.status_code == 400
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"].startswith(message)


def test_a_failure_after_the_first_byte_ends_the_stream_with_an_error_event(
    tiny_client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    """The KV cache gives out at the fourth token: the 200 stream already sent its first
    pieces, so it ends with an error event (the 503's message, code and retry fields) and
    `[DONE]`, logged and counted as the 503 it is; the admission is given back and the next
    chat is answered."""
    runtime = runtime_of(tiny_client.app)
    service = runtime.service
    assert service is not None
    real_sample = service.engine.sample
    sampled = 0

    def failing(sampler: Any) -> int:
        nonlocal sampled
        sampled += 1
        if sampled == 4:
            raise CapacityError("no KV cache slot for the chat's next token")
        return real_sample(sampler)

    service.engine.sample = failing  # type: ignore[method-assign]
    expected = whole(tiny_client, max_tokens=3)["choices"][0]["message"]["content"]
    sampled = 0
    with caplog.at_level(logging.INFO, logger="adapter.requests"):
        caplog.clear()  # the whole answer's line, where an earlier test left INFO on
        got = streamed(tiny_client, max_tokens=20)
    *chunks, error, done = got
    assert done == "[DONE]"
    assert len(chunks) >= 2  # the role, then text: the head was sent before the failure
    assert expected.startswith(content(chunks))
    assert error["error"]["code"] == 503
    assert error["error"]["message"] == "no KV cache slot for the chat's next token"
    assert error["error"]["retryable"] is True
    assert error["error"]["retry_after_seconds"] == 1
    assert error["error"]["request_id"]
    (line,) = [json.loads(r.getMessage()) for r in caplog.records if r.name == "adapter.requests"]
    assert (line["status"], line["streamed"], line["unavailable"]) == (503, True, "capacity")
    assert value(samples(tiny_client), "semif_unavailable_total", cause="capacity") == 1
    assert runtime.in_flight == 0
    service.engine.sample = real_sample  # type: ignore[method-assign]
    assert streamed(tiny_client, max_tokens=3)[-1] == "[DONE]"


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    found = [s for family in text_string_to_metric_families(text) for s in family.samples]
    return value(found, name, **labels)


def test_a_client_that_leaves_mid_stream_frees_the_scheduler(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On a real socket: a tiny_client reads two chunks of a long generation and closes. The
    admission is held while it reads (not only until the first byte); once it has gone the
    scheduler drops the generation at its next token, the admission is given back, the
    next request is answered at once, and the log has a 499 and no 5xx."""
    settings = Settings(model_dir=tiny_model_dir, max_tokens=1024, max_chat_tokens=256, threads=1)
    app = create_app(settings)
    with caplog.at_level(logging.INFO, logger="adapter.requests"), live_server(app) as url:
        runtime = runtime_of(app)
        service = runtime.service
        assert service is not None
        real_sample = service.engine.sample
        sampled = 0

        def slow(sampler: Any) -> int:  # 256 tokens would take 5 s
            nonlocal sampled
            sampled += 1
            time.sleep(0.02)
            return real_sample(sampler)

        service.engine.sample = slow  # type: ignore[method-assign]
        body = {"messages": HELLO, "temperature": 0, "max_tokens": 256, "stream": True}
        with httpx.stream("POST", f"{url}/invocations", json=body, timeout=30) as response:
            assert response.status_code == 200
            assert response.headers["transfer-encoding"] == "chunked"
            assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
            read = 0
            for line in response.iter_lines():
                read += line.startswith("data: ")
                if read == 2:
                    break
            assert runtime.in_flight == 1  # held past the first byte
        left = time.monotonic()
        deadline = left + 5
        while runtime.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert runtime.in_flight == 0
        assert time.monotonic() - left < 1.0
        assert sampled < 128  # stopped well before its 256 tokens
        stopped_at = sampled
        started = time.monotonic()
        after = httpx.post(
            f"{url}/invocations",
            json={"messages": HELLO, "temperature": 0, "max_tokens": 4},
            timeout=30,
        )
        assert after.status_code == 200
        assert time.monotonic() - started < 2.0
        assert sampled == stopped_at + 4  # the dropped generation took no more tokens
        assert _metric(url, "semif_requests_total", api="chat", status="499") == 1
    statuses = [
        json.loads(record.getMessage())["status"]
        for record in caplog.records
        if record.name == "adapter.requests"
    ]
    assert sorted(statuses) == [200, 499]


# -- the generation's own holding, on scripted tokens ------------------------------------


class ScriptedHost:
    """A StreamHost whose samples are a script of token ids (decoding does nothing)."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.cache = StreamCache(2, 4096, exact=False)
        self.resets = 0
        self._tokens = iter(tokens)

    def take(self, copy: Copy) -> None:
        pass

    def decode_tokens(self, seq: int, tokens: Sequence[int], start: int) -> None:
        pass

    def sample(self, sampler: Any) -> int:
        return next(self._tokens)

    def empty(self, seq: int) -> None:
        pass

    def check_cancel(self) -> None:
        pass


class ScriptedPieces:
    """Token i is `pieces[i]`; token -1 ends the generation."""

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self.pieces = pieces

    def is_end(self, token: int) -> bool:
        return token < 0

    def piece_bytes(self, token: int, *, special: bool = False) -> bytes:
        return self.pieces[token]


ALPHABET = ["a", "b", " ", "é", "€", "😀", "ab", "\n"]


def test_stop_prefix_length() -> None:
    assert stop_prefix_length("hello wor", ["world"]) == 3
    assert stop_prefix_length("hello world", ["world"]) == 0  # whole: a stop, not a hold
    assert stop_prefix_length("abab", ["abac", "b"]) == 2
    assert stop_prefix_length("", ["x"]) == 0
    assert stop_prefix_length("xa", ["aaa", "ab"]) == 1


def test_pieces_are_whole_characters_and_never_part_of_a_stop_string() -> None:
    """Random UTF-8 text cut into random byte tokens (characters split across tokens), with
    random stop strings: after every step the text handed out is a prefix of the final text
    (so never half a character, never the start of a stop string that is then met), it
    lags what the bytes so far decode to by less than the longest stop string (nothing is
    held that cannot start one), and all of it joined is the final text."""
    rng = random.Random(40)
    for _ in range(400):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 24)))
        raw = text.encode()
        cuts = sorted(rng.sample(range(1, len(raw)), max(0, min(len(raw) - 1, rng.randint(0, 30)))))
        pieces = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
        source = text if rng.random() < 0.7 else "".join(rng.sample(ALPHABET, 6))
        stop = []
        for _ in range(rng.randint(0, 2)):
            start = rng.randrange(len(source) + 1)
            marker = source[start : start + rng.randint(1, 4)]
            if marker:
                stop.append(marker if rng.random() < 0.7 else marker + "\u2603")
        limit = rng.randint(1, len(pieces) + 1) if pieces else 1
        tokens = [*range(len(pieces)), -1]
        run = GenerationRun(
            ScriptedHost(tokens), ScriptedPieces(pieces), [1, 2, 3], limit, Sampling(), stop
        )
        sent, decoded = "", b""
        try:
            finished = False
            steps = 0
            while not finished:
                finished = run.step()
                sent += run.new_text()
                if steps < len(pieces):
                    decoded += pieces[steps]
                steps += 1
                if not finished:
                    whole_so_far = decoded.decode("utf-8", errors="ignore")
                    held = len(whole_so_far) - len(sent)
                    assert 0 <= held < max((len(m) for m in stop), default=1), (text, stop)
            final = run.result().text
        finally:
            run.close()
        assert sent == final, (text, pieces, stop)
        assert "\ufffd" not in final or limit < len(pieces)
