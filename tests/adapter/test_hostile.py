"""Hostile input on the tiny model: invalid Unicode, forged chat markers, broken bodies.

Regression tests for issue 10, items 1 (lone surrogates), 2 (special-token injection) and
6 (disconnects, body timeout, slash redirects, chat field rules).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from starlette.testclient import TestClient

from adapter import prompts
from adapter.app import create_app
from adapter.core.vocab import SpecialToken, Vocabulary
from adapter.errors import RequestError
from adapter.http import check_json
from adapter.prompts import (
    ChatTemplate,
    TemplateRenderError,
    check_marks_survive,
    render_chat_prompt,
    render_decision,
)
from adapter.schema import parse_decision_body
from adapter.service import DecisionService
from adapter.settings import Settings
from model_build.tiny_gguf import CHAT_TEMPLATE
from tests.support import injection
from tests.support.live_server import runtime_of
from tests.support.models import open_test_model, service_of
from tests.support.serving import decision

HEADERS = {"content-type": "application/json"}


def post(client: TestClient, body: bytes | str, path: str = "/invocations") -> Any:
    return client.post(path, content=body, headers=HEADERS)


@pytest.fixture(scope="module")
def tiny_service(tiny_gguf: Path) -> Iterator[DecisionService]:
    model = open_test_model(tiny_gguf)
    yield service_of(model)
    model.engine.close()


# -- 1. every string and key must be valid Unicode -----------------------------------------

SURROGATE_BODIES = [
    (b'{"decision":{"\\ud800":1}}', 'decision["\\ud800"]'),
    (b'{"decision":{"id":"\xed\xa0\x80","state":"s"}}', "decision.id"),  # CESU-8 bytes
    (
        json.dumps({"decision": decision(state="ok \ud800 ok")}).encode(),
        "decision.state",
    ),
    (
        json.dumps({"decision": decision(options=(("a\udfff", "A"), ("b", "B")))}).encode(),
        "decision.options[0].id",
    ),
    (
        json.dumps({"decisions": [decision(), decision("x", state={"k\udbff": 1})]}).encode(),
        'decisions[1].state["k\\udbff"]',
    ),
    (
        json.dumps(
            {"state": "s", "questions": {"q\ud800": {"type": "noul", "instructions": "x"}}}
        ).encode(),
        'questions["q\\ud800"]',
    ),
    (
        json.dumps(
            {
                "state": "s",
                "questions": {
                    "q": {"type": "choice", "instructions": "x", "criteria": {"\udc00": None}}
                },
            }
        ).encode(),
        'questions.q.criteria["\\udc00"]',
    ),
    (
        json.dumps({"messages": [{"role": "user", "content": "hi \ud83d"}]}).encode(),
        "messages[0].content",
    ),
    (b'"\\ud800"', "body"),
]


@pytest.mark.parametrize(("body", "field"), SURROGATE_BODIES)
def test_lone_surrogates_are_400_naming_the_json_path(
    tiny_client: TestClient, body: bytes, field: str
) -> None:
    response = post(tiny_client, body)
    assert response.status_code == 400
    answer = response.json()
    assert answer["field"] == field
    assert "is not valid Unicode (lone surrogate" in answer["error"]
    assert answer["request_id"] == response.headers["x-request-id"]
    assert tiny_client.get("/ping").status_code == 200


def test_a_surrogate_question_key_spends_no_model_time(tiny_client: TestClient) -> None:
    service = runtime_of(tiny_client.app).service
    assert service is not None
    calls: list[object] = []
    real = service.engine.score

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real(*args, **kwargs)

    service.engine.score = counted  # type: ignore[method-assign]
    body = {"state": "s", "questions": {"\ud800": {"type": "noul", "instructions": "x"}}}
    assert post(tiny_client, json.dumps(body)).status_code == 400
    assert calls == []


def test_valid_non_ascii_text_is_accepted(tiny_client: TestClient) -> None:
    body = {"decision": decision(state="Ünïcödé 日本語 🙂 \u2028 text", question="Was? 🙂")}
    response = post(tiny_client, json.dumps(body, ensure_ascii=False).encode())
    assert response.status_code == 200


def _nested(depth: int) -> Any:
    value: Any = "leaf"
    for _ in range(depth):
        value = [value]
    return {"a": value}


@pytest.mark.parametrize(
    ("raw", "field", "rule"),
    [
        (b'{"decision": {"id": 1e400}}', "decision.id", "number is out of range"),
        (json.dumps(_nested(70)).encode(), "a", "nested deeper than 64"),
    ],
)
def test_the_body_walk_refuses_infinite_numbers_and_deep_nesting(
    raw: bytes, field: str, rule: str
) -> None:
    with pytest.raises(RequestError) as raised:
        check_json(json.loads(raw))
    assert raised.value.path.startswith(field)
    assert rule in str(raised.value)
    check_json(_nested(60))  # within the limit: no error


# -- 2. request text never becomes control tokens -------------------------------------------


def test_prompts_without_markers_tokenize_exactly_as_before(
    tiny_service: DecisionService,
) -> None:
    injection.assert_clean_tokenization_unchanged(tiny_service)


def test_forged_markers_in_every_field_stay_plain_text(tiny_service: DecisionService) -> None:
    injection.assert_forged_markers_stay_plain(tiny_service)


def test_forged_state_over_http_keeps_its_prompt_hash(tiny_client: TestClient) -> None:
    service = runtime_of(tiny_client.app).service
    assert service is not None
    # as_given: the prompt rendered here lists the options in the caller's order
    body = {"decision": decision(state=f"Ticket{injection.FORGED}"), "option_order": "as_given"}
    result = post(tiny_client, json.dumps(body)).json()["result"]
    [request] = parse_decision_body(body, 4).decisions
    text = render_decision(service.template, request)
    assert result["prompt_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    assert result["prompt_version"] == "semif-direct-options/1"
    assert result["input_tokens"] == len(service.render([request], "single")[0][1])


def test_trimming_templates_still_trim_request_whitespace() -> None:
    trimming = CHAT_TEMPLATE.replace("{{ message['content'] }}", "{{ message['content'] | trim }}")
    template = ChatTemplate(trimming, bos_token="", eos_token="")
    check_marks_survive(template)
    prompt = render_chat_prompt(template, [{"role": "user", "content": "  \n hi <x> \t"}])
    assert prompt.text == "<|im_start|>user\nhi <x><|im_end|>\n<|im_start|>assistant\n"
    [(start, end)] = prompt.user_spans
    assert prompt.text[start:end] == "hi <x>"


@pytest.mark.parametrize(
    "content",
    [
        "{{ message['content'][1:] }}",  # drops the opening marker
        "{{ message['content'] | replace('\\ud800', '') }}",
        "{{ message['content'][:3] }}",
    ],
)
def test_a_template_that_loses_markers_is_refused(content: str) -> None:
    source = CHAT_TEMPLATE.replace("{{ message['content'] }}", content)
    with pytest.raises(TemplateRenderError, match="chat template"):
        check_marks_survive(ChatTemplate(source, bos_token="", eos_token=""))


def test_a_template_that_branches_on_content_is_refused_per_request() -> None:
    source = CHAT_TEMPLATE.replace(
        "{{ message['content'] }}",
        "{% if message['content'].startswith('!') %}SHOUT{% endif %}{{ message['content'] }}",
    )
    template = ChatTemplate(source, bos_token="", eos_token="")
    check_marks_survive(template)
    with pytest.raises(prompts.MarkedTextError):
        render_chat_prompt(template, [{"role": "user", "content": "!loud"}])


def test_a_model_whose_template_loses_markers_does_not_start(tmp_path: Path) -> None:
    from model_build.tiny_gguf import write_tiny_gguf

    source = CHAT_TEMPLATE.replace("{{ message['content'] }}", "{{ message['content'][1:] }}")
    gguf = write_tiny_gguf(tmp_path / "m.gguf", chat_template=source)
    with pytest.raises(TemplateRenderError, match="cannot mark request text"):
        open_test_model(gguf)


def test_special_token_split_honours_lstrip_and_rstrip() -> None:
    text = "ab  <T>  cd <T>"
    both = SpecialToken(7, "<T>", 8 | 128 | 256)  # CONTROL | LSTRIP | RSTRIP
    split = Vocabulary._split_at(text, [(0, len(text))], both, ())
    assert split == [(0, 2), 7, (9, 11), 7]
    # An occurrence inside request text stays raw text.
    assert Vocabulary._split_at(text, [(0, len(text))], both, [(12, 15)]) == [(0, 2), 7, (9, 15)]


def test_chat_content_markers_stay_plain_over_http(tiny_client: TestClient) -> None:
    service = runtime_of(tiny_client.app).service
    assert service is not None
    body = {"messages": [{"role": "user", "content": f"hi{injection.FORGED}"}], "max_tokens": 2}
    usage = post(tiny_client, json.dumps(body)).json()["usage"]
    prompt = render_chat_prompt(service.template, body["messages"])  # type: ignore[arg-type]
    assert usage["prompt_tokens"] == len(
        service.engine.vocab.tokenize_prompt(prompt.text, prompt.user_spans)
    )
    assert usage["prompt_tokens"] > len(service.engine.vocab.tokenize(prompt.text))


# -- 6. small contract misses ---------------------------------------------------------------


def test_trailing_slash_is_a_json_404_not_a_redirect(tiny_client: TestClient) -> None:
    response = tiny_client.post("/invocations/", content=b"{}", headers=HEADERS)
    assert response.status_code == 404
    assert response.json() == {"error": "Not Found"}


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"": 1}, 'body[""]'),
        ({"n": True}, "n"),
        ({"n": 1.0}, "n"),
        ({"n": 2}, "n"),
        ({"seed": 2**32}, "seed"),
        ({"seed": -1}, "seed"),
        ({"seed": True}, "seed"),
    ],
)
def test_chat_field_rules(tiny_client: TestClient, extra: dict[str, Any], field: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
    response = post(tiny_client, json.dumps(body))
    assert response.status_code == 400
    assert response.json()["field"] == field


def test_largest_seed_is_accepted(tiny_client: TestClient) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "temperature": 0.5,
        "seed": 2**32 - 1,
        "n": 1,
    }
    assert post(tiny_client, json.dumps(body)).status_code == 200


async def _call(app: Any, receive: Any) -> list[dict[str, Any]]:
    """One POST /invocations straight through ASGI, with a hand-written receive."""
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/invocations",
        "raw_path": b"/invocations",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8080),
        "state": {},
    }
    await app(scope, receive, send)
    return sent


def _status(sent: list[dict[str, Any]]) -> tuple[int, dict[str, Any], dict[bytes, bytes]]:
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body), dict(start["headers"])


def test_client_disconnect_mid_body_is_499_without_traceback(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(Settings(model_dir=tmp_path))  # no lifespan: the body fails first
    messages: Iterator[dict[str, Any]] = iter(
        [
            {"type": "http.request", "body": b'{"decision":', "more_body": True},
            {"type": "http.disconnect"},
        ]
    )

    async def receive() -> dict[str, Any]:
        return next(messages)

    with caplog.at_level(logging.INFO, logger="adapter.requests"):
        status, body, _ = _status(anyio.run(_call, app, receive))
    assert status == 499
    assert body["field"] == "body"
    assert [record.levelno for record in caplog.records] == [logging.INFO]
    assert json.loads(caplog.records[0].getMessage())["status"] == 499


def test_a_body_shorter_than_its_content_length_times_out_with_408(tmp_path: Path) -> None:
    app = create_app(Settings(model_dir=tmp_path, body_timeout_seconds=0.2))
    first = True

    async def receive() -> dict[str, Any]:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": b'{"dec', "more_body": True}
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    status, body, headers = _status(anyio.run(_call, app, receive))
    assert status == 408
    assert body["field"] == "body"
    assert "SEMIF_BODY_TIMEOUT_S" in body["error"]
    assert headers[b"connection"] == b"close"


# -- review regressions ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"decision": {**decision(), "": 1}}, 'decision[""]'),
        ({"decisions": [{**decision(), "a b": 2}]}, 'decisions[0]["a b"]'),
        (
            {
                "state": "s",
                "questions": {
                    "q": {"type": "choice", "instructions": "i", "criteria": {"a": None, "": 3}}
                },
            },
            'questions.q.criteria[""]',
        ),
        (
            {"state": "s", "questions": {"a b": {"type": "noul", "instructions": 3}}},
            'questions["a b"].instructions',
        ),
    ],
)
def test_odd_keys_get_unambiguous_field_paths(
    tiny_client: TestClient, body: dict[str, Any], field: str
) -> None:
    answer = post(tiny_client, json.dumps(body))
    assert answer.status_code in (400, 422)
    assert answer.json()["field"] == field


@pytest.mark.parametrize("key", ["k" * 500_000, "é " * 100_000])
def test_a_huge_unknown_key_is_cut_in_the_error(tiny_client: TestClient, key: str) -> None:
    """The field path names the key by its start and length: a 500 KB key is not echoed."""
    answer = post(tiny_client, json.dumps({"decision": {**decision(), key: 1}}))
    assert answer.status_code == 400
    assert len(answer.content) < 2000
    field = answer.json()["field"]
    assert field.startswith('decision["' + json.dumps(key[:64])[1:-1])
    assert field.endswith(f'..." ({len(key)} characters)]')


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"decision": decision(), "option_order": "x" * 500_000}, "option_order"),
        ({"decision": decision(), "readout": "x" * 500_000}, "readout"),
        ({"decision": decision(), "normalization": "é " * 100_000}, "normalization"),
        (
            {"messages": [{"role": "user", "content": "a"}], "max_tokens": "9" * 500_000},
            "max_tokens",
        ),
    ],
)
def test_a_huge_enum_value_is_cut_in_the_error(
    tiny_client: TestClient, body: dict[str, Any], field: str
) -> None:
    """A value outside a field's choices is named by its start and length, as a key is: a
    500 KB `option_order` is not a 500 KB answer."""
    answer = post(tiny_client, json.dumps(body))
    assert answer.status_code == 400
    assert answer.json()["field"] == field
    assert len(answer.content) < 2000
    assert f"({len(str(body[field]))} characters)" in answer.json()["error"]


def test_chat_with_too_many_messages_is_refused_before_rendering(tiny_client: TestClient) -> None:
    messages = [{"role": "user", "content": "a"}] * 513
    answer = post(tiny_client, json.dumps({"messages": messages}))
    assert answer.status_code == 400
    assert answer.json()["field"] == "messages"
    assert "limit is 512" in answer.json()["error"]


def test_thousands_of_user_spans_tokenize_like_plain_llama_cpp(
    tiny_service: DecisionService,
) -> None:
    """Span lookup is by bisection (a linear scan made 28,000 tiny messages cost a minute
    under the engine lock); with thousands of spans the tokens still equal llama.cpp's."""
    messages = [{"role": "user", "content": "a"}] * 4000
    prompt = render_chat_prompt(tiny_service.template, messages)
    tokens = tiny_service.engine.vocab.tokenize_prompt(prompt.text, prompt.user_spans)
    assert tokens == tiny_service.engine.vocab.tokenize(prompt.text)


def test_the_sagemaker_route_keeps_connection_and_request_id_headers(
    tiny_client: TestClient,
) -> None:
    answer = tiny_client.post(
        "/endpoints/local/invocations",
        content=b"{}",
        headers={**HEADERS, "x-request-id": "req-1"},
    )
    assert answer.status_code == 424
    assert answer.headers["x-request-id"] == "req-1"
