"""Streamed answers end to end: `stream_decide` and `stream_chat` over a URL (httpx, a
chunked body) and through InvokeEndpointWithResponseStream (the real boto3 client, its
event stream framed as SageMaker frames it and parsed by botocore's own EventStream), the
retries before the first byte and none after it, every way a stream breaks, `semif
--stream`, and the real server's chat stream."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from adapter.app import create_app
from adapter.settings import Settings
from client.cli import main
from client.decision_client import (
    BusyError,
    DecisionClient,
    EndpointError,
    HttpTransport,
    RetryPolicy,
    SageMakerTransport,
    StreamError,
)
from tests.support.event_stream import (
    Streamed,
    decision_result,
    json_lines,
    payload_parts,
    pieces,
    sse,
    stream_exception,
    stream_server,
)
from tests.support.live_server import live_server
from tests.support.scripted_endpoint import Answer, busy, model_error
from tests.support.serving import decision

FAST = RetryPolicy(max_attempts=4, base_delay_s=0.001, max_delay_s=0.002)
JSONL = "application/jsonlines"


CLOSING = {"done": True, "model": {"file": "tiny.gguf"}, "timing": {}, "request_id": "r1"}
FIRST, SECOND = (
    {"index": 1, "result": decision_result("second é")},
    {"index": 0, "result": decision_result("first")},
)
DECISIONS = json_lines(FIRST, SECOND, CLOSING)
ASKED = [decision("first"), decision("second é")]


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    choices = [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": choices}


CHAT = sse(chunk({"role": "assistant"}), chunk({"content": "Sal"}), chunk({"content": "ut 🙂"}))
CHAT_END = sse(chunk({}, "stop"), "[DONE]")


@pytest.fixture(autouse=True)
def dummy_aws(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SageMaker path runs through endpoint_url on loopback; boto3 still signs."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_PROFILE", raising=False)


def by_url(url: str) -> DecisionClient:
    return DecisionClient(HttpTransport(url), retry=FAST, sleep=lambda s: None)


def by_endpoint(url: str) -> DecisionClient:
    transport = SageMakerTransport("semif", region="us-east-1", endpoint_url=url)
    return DecisionClient(transport, retry=FAST, sleep=lambda s: None)


def read(stream: Any) -> list[Any]:
    return [(item.index, item.result.id) for item in stream]


ARRIVED = [(1, "second é"), (0, "first")]


# -- over a URL ---------------------------------------------------------------------------


def test_decisions_stream_over_a_url_in_the_order_they_finish() -> None:
    with stream_server(Streamed(pieces(DECISIONS, 5), JSONL)) as server:
        stream = by_url(server.url).stream_decide(ASKED, readout="likelihood")
        assert read(stream) == ARRIVED
    assert stream.summary is not None
    assert stream.summary.request_id == "r1"
    ((path, headers, body),) = server.requests
    assert (path, headers["accept"], headers["content-type"]) == (
        "/invocations",
        JSONL,
        "application/json",
    )
    sent = json.loads(body)
    assert list(sent) == ["decisions", "readout"]  # state first, then the reading
    assert [item["id"] for item in sent["decisions"]] == ["first", "second é"]


def test_a_busy_answer_before_the_first_byte_is_retried_with_its_token() -> None:
    with stream_server(busy(429, retry_token="place-1"), Streamed([DECISIONS], JSONL)) as server:
        assert read(by_url(server.url).stream_decide(ASKED)) == ARRIVED
    tokens = [
        headers.get("x-amzn-sagemaker-custom-attributes") for _, headers, _ in server.requests
    ]
    assert tokens == [None, "semif-retry-token=place-1"]


def test_nothing_is_retried_after_the_first_byte() -> None:
    """A busy error line part-way is raised as the busy error it is, and not retried: the
    decision before it was handed over already, and a retry would hand it over again."""
    late = {"error": "deadline passed", "status": 429, "request_id": "r1", "retryable": True}
    with stream_server(Streamed([json_lines(FIRST, late)], JSONL)) as server:
        stream = by_url(server.url).stream_decide(ASKED)
        assert next(stream).index == 1
        with pytest.raises(BusyError) as raised:
            next(stream)
    assert (raised.value.status, raised.value.message) == (429, "deadline passed")
    assert len(server.requests) == 1


def test_an_error_line_part_way_is_the_mapped_error() -> None:
    failed = {"error": "decision.state: too long", "status": 400, "field": "decision.state"}
    with (
        stream_server(Streamed([json_lines(FIRST, failed)], JSONL)) as server,
        pytest.raises(EndpointError) as raised,
    ):
        read(by_url(server.url).stream_decide(ASKED))
    assert raised.type is EndpointError
    assert (raised.value.status, raised.value.body["field"]) == (400, "decision.state")


def test_a_connection_lost_part_way_is_a_stream_error() -> None:
    with (
        stream_server(Streamed([json_lines(FIRST)[:20]], JSONL, abort=True)) as server,
        pytest.raises(StreamError) as raised,
    ):
        read(by_url(server.url).stream_decide(ASKED))
    assert raised.value.code == "StreamBroken"
    assert raised.value.status == 0


def test_an_endpoint_that_answers_whole_is_not_read_as_a_stream() -> None:
    whole = Answer(200, {"results": [decision_result("first"), decision_result("second é")]})
    with (
        stream_server(whole) as server,
        pytest.raises(EndpointError, match="answered application/json, not the "),
    ):
        by_url(server.url).stream_decide(ASKED)


def test_chat_streams_over_a_url() -> None:
    with stream_server(Streamed(pieces(CHAT + CHAT_END, 3), "text/event-stream")) as server:
        stream = by_url(server.url).stream_chat([{"role": "user", "content": "Hi"}], max_tokens=9)
        assert list(stream) == ["Sal", "ut 🙂"]
    assert stream.finish_reason == "stop"
    ((_, headers, body),) = server.requests
    assert headers["accept"] == "text/event-stream"
    assert json.loads(body) == {
        "messages": [{"role": "user", "content": "Hi"}],
        "temperature": 0.0,
        "max_tokens": 9,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


# -- through InvokeEndpointWithResponseStream ----------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_payload_parts_cut_anywhere_read_as_one_answer(seed: int) -> None:
    """PayloadParts cut at random (through lines, JSON strings and the bytes of a
    character), their frames written in pieces that cut through frames too."""
    rng = random.Random(seed)
    cuts = rng.sample(range(1, len(DECISIONS)), rng.randint(1, 12))
    framed = payload_parts(DECISIONS, cuts)
    with stream_server(Streamed(pieces(framed, rng.randint(1, 64)), JSONL)) as server:
        stream = by_endpoint(server.url).stream_decide(ASKED)
        assert read(stream) == ARRIVED
    assert stream.summary is not None
    ((path, headers, _),) = server.requests
    assert path == "/endpoints/semif/invocations-response-stream"
    assert (headers["x-amzn-sagemaker-accept"], headers["content-type"]) == (
        JSONL,
        "application/json",
    )


def test_a_character_split_between_two_payload_parts() -> None:
    at = DECISIONS.index("é".encode()) + 1  # between the two bytes of é
    with stream_server(Streamed([payload_parts(DECISIONS, [at])], JSONL)) as server:
        assert read(by_endpoint(server.url).stream_decide(ASKED)) == ARRIVED


def test_chat_streams_through_the_endpoint() -> None:
    framed = payload_parts(CHAT + CHAT_END, range(0, len(CHAT), 7))
    with stream_server(Streamed([framed], "text/event-stream")) as server:
        stream = by_endpoint(server.url).stream_chat([{"role": "user", "content": "Hi"}])
        assert "".join(stream) == "Salut 🙂"
    assert stream.finish_reason == "stop"


@pytest.mark.parametrize(
    ("event", "code", "message"),
    [
        (
            stream_exception(
                "ModelStreamError", Message="took too long", ErrorCode="ModelInvocationTimeExceeded"
            ),
            "ModelStreamError",
            "ModelStreamError: took too long",
        ),
        (
            stream_exception("InternalStreamFailure", Message="try again"),
            "InternalStreamFailure",
            "InternalStreamFailure: try again",
        ),
    ],
)
def test_sagemakers_stream_errors_are_raised_by_name(event: bytes, code: str, message: str) -> None:
    framed = payload_parts(json_lines(FIRST), [10]) + event
    with stream_server(Streamed([framed], JSONL)) as server:
        stream = by_endpoint(server.url).stream_decide(ASKED)
        assert next(stream).index == 1  # what came before the break was handed over
        with pytest.raises(StreamError) as raised:
            next(stream)
    assert (raised.value.code, raised.value.message, raised.value.status) == (code, message, 0)
    assert len(server.requests) == 1  # and nothing is retried


def test_an_error_line_inside_the_payload_is_the_mapped_error() -> None:
    failed = {"error": "busy", "status": 503, "retryable": False, "request_id": "r1"}
    framed = payload_parts(json_lines(FIRST, failed), [30, 90])
    with stream_server(Streamed([framed], JSONL)) as server, pytest.raises(EndpointError) as raised:
        read(by_endpoint(server.url).stream_decide(ASKED))
    assert raised.type is EndpointError  # not retryable, so not busy
    assert (raised.value.status, raised.value.message) == (503, "busy")


def test_a_stream_cut_short_through_the_endpoint() -> None:
    with (
        stream_server(Streamed([payload_parts(json_lines(FIRST), [5])], JSONL)) as server,
        pytest.raises(StreamError, match="after 1 of 2 decisions") as raised,
    ):
        read(by_endpoint(server.url).stream_decide(ASKED))
    assert raised.value.code == "StreamCut"


def test_a_connection_lost_mid_frame_through_the_endpoint() -> None:
    framed = payload_parts(json_lines(FIRST), [])
    with (
        stream_server(Streamed([framed[:-6]], JSONL, abort=True)) as server,
        pytest.raises(StreamError) as raised,
    ):
        read(by_endpoint(server.url).stream_decide(ASKED))
    assert raised.value.code == "StreamBroken"
    assert "the event stream broke part-way" in raised.value.message


def test_a_containers_busy_answer_before_the_stream_is_retried() -> None:
    """The container's 429 arrives as a ModelError before any event: retried, its token
    sent back in CustomAttributes, as for InvokeEndpoint."""
    refused = model_error(busy(429, retry_token="place-2"))
    with stream_server(refused, Streamed([payload_parts(DECISIONS, [])], JSONL)) as server:
        assert read(by_endpoint(server.url).stream_decide(ASKED)) == ARRIVED
    tokens = [
        headers.get("x-amzn-sagemaker-custom-attributes") for _, headers, _ in server.requests
    ]
    assert tokens == [None, "semif-retry-token=place-2"]


def test_a_container_error_before_the_stream_keeps_its_status() -> None:
    refused = model_error(Answer(400, {"error": "decision.id: is required"}))
    with stream_server(refused) as server, pytest.raises(EndpointError) as raised:
        by_endpoint(server.url).stream_decide(ASKED)
    assert (raised.value.status, raised.value.message) == (400, "decision.id: is required")
    assert len(server.requests) == 1


# -- semif --stream ------------------------------------------------------------------------


def test_semif_decide_stream_prints_each_decision_as_it_arrives(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    request = tmp_path / "decisions.json"
    request.write_text(json.dumps({"decisions": ASKED}))
    with stream_server(Streamed([DECISIONS], JSONL)) as server:
        assert main(["decide", str(request), "--url", server.url, "--stream"]) == 0
        table = capsys.readouterr().out.splitlines()
        assert main(["decide", str(request), "--url", server.url, "--stream", "--json"]) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row.split()[0] for row in table] == ["second", "first"]
    assert lines == [FIRST, SECOND, CLOSING]


def test_semif_chat_stream_prints_the_text_and_reports_a_break(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with stream_server(Streamed([CHAT + CHAT_END], "text/event-stream")) as server:
        assert main(["chat", "Hi", "--url", server.url, "--stream"]) == 0
        assert capsys.readouterr().out == "Salut 🙂\n"
    with stream_server(Streamed([payload_parts(CHAT, [9])], "text/event-stream")) as server:
        argv = ["chat", "Hi", "--endpoint-name", "semif", "--region", "us-east-1"]
        assert main([*argv, "--endpoint-url", server.url, "--stream"]) == 1
        out, err = capsys.readouterr()
    assert out == "Salut 🙂"  # printed as it came, before the break
    assert err == "semif: StreamCut: the chat stream ended before its [DONE] event\n"


# -- the real server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def url(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = tmp_path_factory.mktemp("stream-model")
    shutil.copy(tiny_gguf, model_dir / tiny_gguf.name)
    app = create_app(Settings(model_dir=model_dir, max_tokens=1024, threads=1))
    with live_server(app) as base:
        yield base


def test_the_servers_chat_stream_is_its_whole_answer_in_pieces(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    client = DecisionClient.for_url(url, retry=FAST)
    messages = [{"role": "user", "content": "Say hello."}]
    whole = client.chat(messages, max_tokens=12)
    stream = client.stream_chat(messages, max_tokens=12)
    assert "".join(stream) == whole.content
    assert stream.finish_reason == whole.finish_reason
    assert stream.usage is not None
    assert stream.usage.completion_tokens == whole.completion_tokens
    assert stream.model == "tiny.gguf"
    assert main(["chat", "Say hello.", "--max-tokens", "12", "--url", url, "--stream"]) == 0
    assert capsys.readouterr().out == whole.content + "\n"


def test_the_servers_decision_stream_matches_its_whole_answer(url: str) -> None:
    client = DecisionClient.for_url(url, retry=FAST)
    asked = [decision("a"), decision("b", question="Is it urgent?")]
    whole = {result.id: result.probabilities for result in client.decide_many(asked)}
    stream = client.stream_decide(asked)
    arrived = {item.result.id: item.result.probabilities for item in stream}
    assert arrived == whole
    assert stream.summary is not None
    assert stream.summary.model["file"] == "tiny.gguf"


def test_the_servers_streams_through_boto3_as_sagemaker_frames_them(url: str) -> None:
    """The real server's `/endpoints/{name}/invocations-response-stream` frames its answer as
    InvokeEndpointWithResponseStream does (adapter.event_frames): boto3's own client and
    botocore's EventStream parser read both streams, with the answers the server gives
    whole; an error before the stream is SageMaker's ModelError, with the container's
    status."""
    client = by_endpoint(url)
    asked = [decision("a"), decision("b", question="Is it urgent?")]
    whole = {result.id: result.probabilities for result in client.decide_many(asked)}
    stream = client.stream_decide(asked)
    assert {item.result.id: item.result.probabilities for item in stream} == whole
    assert stream.summary is not None
    messages = [{"role": "user", "content": "Say hello."}]
    chat = client.stream_chat(messages, max_tokens=12)
    assert "".join(chat) == client.chat(messages, max_tokens=12).content
    with pytest.raises(EndpointError) as refused:
        list(client.stream_decide([decision("a"), decision("a")]))
    assert refused.value.status == 400
