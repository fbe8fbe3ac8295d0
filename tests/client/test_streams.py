"""The pure reading of a streamed answer (client.streams): lines reassembled from chunks cut
anywhere, Server-Sent Events, and the chat and decision readers with their error cases.

Every stream here is split at every byte boundary (one cut and two cuts) and at random
(hypothesis), and must read as it does whole: the transports' chunk boundaries (httpx's
reads, SageMaker's PayloadParts) mean nothing."""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from client.errors import BusyError, EndpointError, StreamError
from client.streams import ChatStream, ChatUsage, DecisionStream, lines, sse_data
from tests.support.event_stream import decision_result, json_lines, sse

# Lines with every line end, characters of 2, 3 and 4 UTF-8 bytes, and a last line
# without its line end.
TEXT = "first é\r\nsecond ✓\rthird 🙂\n\nfourth\r\n\r\nlast 🙂é"
RAW = TEXT.encode()


def chunkings(data: bytes) -> Iterator[list[bytes]]:
    """`data` whole, cut once at every byte boundary, and cut twice at every pair."""
    yield [data]
    for a in range(1, len(data)):
        yield [data[:a], data[a:]]
        for b in range(a + 1, len(data)):
            yield [data[:a], data[a:b], data[b:]]


def cut(data: bytes, offsets: list[int]) -> list[bytes]:
    edges = [0, *sorted({o % (len(data) + 1) for o in offsets}), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


def test_lines_read_the_same_however_the_bytes_are_cut() -> None:
    expected = re.split(r"\r\n|\r|\n", TEXT)
    assert expected[-1] == "last 🙂é"
    assert "" in expected  # blank lines are kept
    for chunks in chunkings(RAW):
        assert list(lines(chunks)) == expected, chunks


def test_a_cr_at_a_chunk_end_waits_for_its_lf() -> None:
    assert list(lines([b"a\r", b"\nb\r", b"", b"\n"])) == ["a", "b"]
    assert list(lines([b"a\r", b"b"])) == ["a", "b"]
    assert list(lines([b"a\r"])) == ["a"]


def test_a_line_that_is_not_utf8_is_an_error() -> None:
    with pytest.raises(EndpointError, match="not UTF-8"):
        list(lines([b"ok\n", b"\xff\xfe\n"]))


def test_sse_data_follows_the_event_stream_rules() -> None:
    stream = (
        ": a comment\n"
        "event: message\n"
        "id: 7\n"
        "data: one\n"
        "data:two\n"
        "\n"
        "data\n"
        "\n"
        "retry: 10\n"
        "\n"
        "data: never dispatched"
    )
    assert list(sse_data(lines([stream.encode()]))) == ["one\ntwo", ""]


# -- chat ---------------------------------------------------------------------------------


def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "tiny.gguf",
        "choices": [choice],
        **extra,
    }


USAGE = {"prompt_tokens": 21, "completion_tokens": 3, "total_tokens": 24}
CHAT = sse(
    chunk({"role": "assistant", "content": ""}),
    chunk({"content": "Bon"}),
    chunk({"content": "jour é"}),
    chunk({"content": "🙂"}),
    chunk({}, "stop"),
    {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [], "usage": USAGE},
    "[DONE]",
).replace(b"\n", b"\r\n")  # CRLF line ends, as some servers write them


class Closed:
    """The `close` a reader is given, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def read_chat(chunks: list[bytes]) -> tuple[list[str], ChatStream]:
    stream = ChatStream(chunks, Closed())
    return list(stream), stream


def test_a_chat_stream_reads_the_same_however_it_is_cut() -> None:
    for chunks in chunkings(CHAT[:400]):  # every cut of the first events (the rest: below)
        assert list(sse_data(lines(chunks))) == list(sse_data(lines([CHAT[:400]])))
    texts, stream = read_chat([CHAT])
    assert texts == ["Bon", "jour é", "🙂"]
    assert (stream.finish_reason, stream.usage) == ("stop", ChatUsage(21, 3))
    assert (stream.id, stream.model) == ("chatcmpl-1", "tiny.gguf")


@given(st.lists(st.integers(min_value=0), max_size=40))
def test_a_chat_stream_reads_the_same_cut_at_random(offsets: list[int]) -> None:
    texts, stream = read_chat(cut(CHAT, offsets))
    assert "".join(texts) == "Bonjour é🙂"
    assert stream.usage == ChatUsage(21, 3)


def test_llama_servers_stream_reads_too() -> None:
    """llama-server: the role chunk's content is null, and the last chunk carries the
    finish reason, the usage and its timings together."""
    body = sse(
        chunk({"role": "assistant", "content": None}),
        chunk({"content": "Hi"}),
        chunk({}, "length", usage=USAGE, timings={"predicted_n": 3}),
        "[DONE]",
    )
    texts, stream = read_chat([body])
    assert texts == ["Hi"]
    assert (stream.finish_reason, stream.usage) == ("length", ChatUsage(21, 3))


def test_an_error_event_is_the_error_its_answer_would_be() -> None:
    error = {"message": "generation failed", "type": "server_error", "code": 500}
    stream = ChatStream([sse(chunk({"content": "Hi"}), {"error": error}, "[DONE]")], Closed())
    assert next(stream) == "Hi"
    with pytest.raises(EndpointError) as raised:
        next(stream)
    assert (raised.value.status, raised.value.message) == (500, "generation failed")
    assert raised.value.body["type"] == "server_error"
    busy = {"message": "busy", "code": 429, "retryable": True, "retry_token": "t0k"}
    with pytest.raises(BusyError) as refused:
        read_chat([sse({"error": busy}, "[DONE]")])
    assert refused.value.retry_token == "t0k"


def test_a_chat_stream_without_done_was_cut() -> None:
    body = sse(chunk({"content": "Hi"}), chunk({}, "stop"))
    with pytest.raises(StreamError) as raised:
        read_chat([body])
    assert raised.value.code == "StreamCut"
    assert raised.value.message == "StreamCut: the chat stream ended before its [DONE] event"
    with pytest.raises(EndpointError, match="without a finish reason"):
        read_chat([sse(chunk({"content": "Hi"}), "[DONE]")])


# -- decisions ----------------------------------------------------------------------------


CLOSING = {
    "done": True,
    "model": {"file": "tiny.gguf"},
    "timing": {"passes": 1},
    "request_id": "r1",
}
DECISIONS = json_lines(
    {"index": 2, "result": decision_result("queue é")},
    {"index": 0, "result": decision_result("refund 🙂")},
    {"index": 1, "result": decision_result("urgent")},
    CLOSING,
)


def read_decisions(chunks: list[bytes], asked: int = 3) -> tuple[list[Any], DecisionStream]:
    stream = DecisionStream(chunks, Closed(), asked)
    return [(item.index, item.result.id) for item in stream], stream


ARRIVED = [(2, "queue é"), (0, "refund 🙂"), (1, "urgent")]


def test_a_decision_stream_reads_the_same_however_it_is_cut() -> None:
    for chunks in chunkings(DECISIONS[:260]):
        assert list(lines(chunks)) == list(lines([DECISIONS[:260]]))
    items, stream = read_decisions([DECISIONS.replace(b"\n", b"\r\n")])
    assert items == ARRIVED  # in the order they finished, each with its place
    assert stream.summary is not None
    assert (stream.summary.request_id, stream.summary.model) == ("r1", {"file": "tiny.gguf"})
    assert stream.summary.timing == {"passes": 1}


@given(st.lists(st.integers(min_value=0), max_size=40))
def test_a_decision_stream_reads_the_same_cut_at_random(offsets: list[int]) -> None:
    items, stream = read_decisions(cut(DECISIONS, offsets))
    assert items == ARRIVED
    assert stream.summary is not None


def test_the_summary_is_there_only_once_the_stream_has_closed() -> None:
    stream = DecisionStream([DECISIONS], Closed(), 3)
    next(stream)
    assert stream.summary is None
    list(stream)
    assert stream.summary is not None


def test_an_error_line_is_the_error_its_answer_would_be() -> None:
    failed = {"error": "decision.options: too many", "status": 400, "request_id": "r1"}
    body = json_lines({"index": 0, "result": decision_result("a")}, failed)
    stream = DecisionStream([body], Closed(), 2)
    assert next(stream).index == 0
    with pytest.raises(EndpointError) as raised:
        next(stream)
    assert raised.type is EndpointError
    assert (raised.value.status, raised.value.message) == (400, "decision.options: too many")
    assert raised.value.body["request_id"] == "r1"
    late = {"error": "deadline passed", "status": 429, "request_id": "r2", "retryable": True}
    with pytest.raises(BusyError):  # mapped as before the first byte; retrying is not its job
        read_decisions([json_lines(late)])


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (json_lines({"index": 0, "result": decision_result("a")}), "after 1 of 2 decisions"),
        (b"", "after 0 of 2 decisions"),
        (json_lines({"index": 0, "result": decision_result("a")}) + b'{"done": tr', "after 1 of 2"),
    ],
)
def test_a_decision_stream_without_its_closing_line_was_cut(body: bytes, says: str) -> None:
    with pytest.raises(StreamError, match=says) as raised:
        read_decisions([body], asked=2)
    assert raised.value.code == "StreamCut"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (json_lines(CLOSING), r"closed without the decisions at \[0, 1\]"),
        (json_lines({"index": 0, "result": decision_result("a")}) * 2, "unexpected line"),
        (json_lines({"index": 2, "result": decision_result("a")}), "unexpected line"),
        (json_lines({"index": True, "result": decision_result("a")}), "unexpected line"),
        (b"[1, 2]\n" + json_lines(CLOSING), "not a JSON object"),
        (b"{not json\n" + json_lines(CLOSING), "not a JSON object"),
    ],
)
def test_a_decision_stream_that_breaks_its_contract_is_an_error(body: bytes, says: str) -> None:
    with pytest.raises(EndpointError, match=says) as raised:
        read_decisions([body], asked=2)
    assert raised.value.status == 200


def test_the_connection_is_let_go_however_the_stream_ends() -> None:
    ended, failed, abandoned = Closed(), Closed(), Closed()
    list(DecisionStream([DECISIONS], ended, 3))
    with pytest.raises(EndpointError):
        list(DecisionStream([json_lines({"error": "x", "status": 500})], failed, 1))
    with DecisionStream([DECISIONS], abandoned, 3) as stream:
        next(stream)
        assert abandoned.calls == 0
    assert (ended.calls, failed.calls, abandoned.calls) == (1, 1, 1)
