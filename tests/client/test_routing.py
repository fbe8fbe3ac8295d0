"""What the client does for SageMaker's prefix-aware routing: bodies whose leading bytes are
their state, whatever else the request says, and the `PrefixAwareId` routing hint, checked on
the bytes boto3 really sends (botocore's Stubber) and on the wire to a URL."""

from __future__ import annotations

import hashlib
import io
import json
import random
import string
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.stub import ANY, Stubber
from starlette.testclient import TestClient

from adapter.settings import Settings
from client.cli import main
from client.decision_client import JSON, DecisionClient, SageMakerTransport, state_first
from stacks.config import ROUTING_PREFIX_BYTES
from tests.support.scripted_endpoint import OK, scripted_server
from tests.support.serving import serving

RESULT = {"result": {"id": "x"}}


def _stubbed(expected: dict[str, Any]) -> tuple[Any, Stubber, list[bytes]]:
    """A real sagemaker-runtime client whose calls are checked against `expected` and whose
    request bodies are kept, as serialized for the wire."""
    runtime = boto3.client(
        "sagemaker-runtime",
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",  # dummy credentials: stubbed, nothing is sent
    )
    sent: list[bytes] = []
    # The Body parameter is the HTTP payload as is (a blob), as the client encoded it.
    runtime.meta.events.register(
        "before-parameter-build.sagemaker-runtime.InvokeEndpoint",
        lambda params, **_: sent.append(params["Body"]),
    )
    stubber = Stubber(runtime)
    for _ in range(40):
        body = io.BytesIO(json.dumps(RESULT).encode())
        stubber.add_response("invoke_endpoint", {"Body": body}, expected)
    return runtime, stubber, sent


def _words(rng: random.Random, count: int) -> str:
    return " ".join(
        "".join(rng.choices(string.ascii_letters, k=rng.randint(1, 9))) for _ in range(count)
    )


def _decision(rng: random.Random, state: Any) -> dict[str, Any]:
    """A decision about `state` with random id, question, options and key order."""
    fields = {
        "id": _words(rng, 1),
        "question": _words(rng, rng.randint(1, 12)),
        "options": [
            {"id": _words(rng, 1), "description": _words(rng, 5)} for _ in range(rng.randint(2, 6))
        ],
        "state": state,
    }
    keys = list(fields)
    rng.shuffle(keys)
    return {key: fields[key] for key in keys}


@pytest.mark.parametrize("seed", range(5))
def test_bodies_about_one_state_share_their_leading_bytes(seed: int) -> None:
    """Up to the end of the state, every body about it is the same bytes, whatever the
    decision id, question, options and the caller's key order (single, shared, System One)."""
    rng = random.Random(seed)
    state: Any = (
        _words(rng, 200) if seed % 2 else {"ticket": _words(rng, 80), "plan": _words(rng, 3)}
    )
    runtime, stubber, sent = _stubbed(
        {"EndpointName": "semif", "ContentType": "application/json", "Accept": ANY, "Body": ANY}
    )
    client = DecisionClient(SageMakerTransport("semif", runtime_client=runtime))
    with stubber:
        for _ in range(6):
            client.invoke({"decision": _decision(rng, state)})
        for _ in range(3):
            shared = [_decision(rng, state) for _ in range(rng.randint(1, 4))]
            client.invoke({"option_order": "canonical", "decisions": shared})
    encoded = json.dumps(state).encode()
    single = [body for body in sent if body.startswith(b'{"decision": {"state": ' + encoded)]
    many = [body for body in sent if body.startswith(b'{"decisions": [{"state": ' + encoded)]
    assert (len(single), len(many)) == (6, 3)


def test_system_one_bodies_start_with_their_state() -> None:
    runtime, stubber, sent = _stubbed(
        {"EndpointName": "semif", "ContentType": "application/json", "Accept": ANY, "Body": ANY}
    )
    client = DecisionClient(SageMakerTransport("semif", runtime_client=runtime))
    with stubber:
        client.invoke({"model": "m", "questions": {"q": {"type": "noul"}}, "state": "S" * 2000})
    assert sent[0].startswith(b'{"state": "' + b"S" * 2000 + b'", "model": "m"')


def test_state_first_keeps_everything_else() -> None:
    body = {"policy": {"min_confidence": 0.5}, "decisions": [{"id": "a", "state": "s"}]}
    ordered = state_first(body)
    assert ordered == body
    assert list(ordered) == ["decisions", "policy"]
    assert list(ordered["decisions"][0]) == ["state", "id"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    assert list(state_first(chat)) == ["messages", "max_tokens"]


def test_the_prefix_aware_id_goes_with_every_call() -> None:
    runtime, stubber, _ = _stubbed(
        {
            "EndpointName": "semif",
            "ContentType": "application/json",
            "Accept": ANY,
            "Body": ANY,
            "PrefixAwareId": "support-router",
        }
    )
    transport = SageMakerTransport(
        "semif", runtime_client=runtime, prefix_aware_id="support-router"
    )
    with stubber:
        DecisionClient(transport).invoke({"decision": {"state": "s"}})
    with scripted_server(OK) as server:
        DecisionClient.for_url(server.url, prefix_aware_id="support-router").invoke({})
    assert server.prefix_ids == ["support-router"]


def test_the_boto3_floor_has_prefix_aware_id() -> None:
    """pyproject's client floor (boto3 1.43.68, botocore >= 1.43.68: the first release whose
    sagemaker-runtime model has PrefixAwareId) is what the lock installs at least, and the
    installed model has the parameter the client sends."""
    import tomllib
    from importlib.metadata import version

    import botocore.session

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    floors = [r for r in project["project"]["optional-dependencies"]["client"] if "boto3" in r]
    assert floors == ["boto3>=1.43.68"]

    def release(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split(".")[:3])

    assert release(version("boto3")) >= release("1.43.68")
    assert release(version("botocore")) >= release("1.43.68")
    model = botocore.session.get_session().get_service_model("sagemaker-runtime")
    members = model.operation_model("InvokeEndpoint").input_shape.members
    assert members["PrefixAwareId"].serialization["name"] == "X-Amzn-SageMaker-Prefix-Aware-Id"


@pytest.mark.parametrize("bad", ["", " leading-space", "x" * 65, "tab\there", "é"])
def test_a_prefix_aware_id_sagemaker_would_refuse_is_refused_here(bad: str) -> None:
    with pytest.raises(ValueError, match="prefix_aware_id"):
        DecisionClient.for_url("http://127.0.0.1:9", prefix_aware_id=bad)
    with pytest.raises(SystemExit):
        main(["decide", "-", "--url", "http://127.0.0.1:9", "--prefix-aware-id", bad])


class Router:
    """Test code only: two local servers behind a router that picks one per request, by a
    hash of the body's first PrefixLength bytes (as SageMaker's prefix-aware routing keys
    on them) or in turn (round robin, what spreads one state over every instance)."""

    def __init__(self, servers: list[TestClient], *, by_prefix: bool) -> None:
        self.servers = servers
        self.by_prefix = by_prefix
        self.turn = 0

    def post(self, body: bytes, retry_token: str | None = None, content_type: str = JSON) -> Any:
        assert content_type == JSON
        if self.by_prefix:
            digest = hashlib.sha256(body[:ROUTING_PREFIX_BYTES]).digest()
            index = digest[0] % len(self.servers)
        else:
            index, self.turn = self.turn % len(self.servers), self.turn + 1
        response = self.servers[index].post(
            "/invocations", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == 200, response.text
        return response.json()

    def wait_until_ready(self, timeout_s: float, progress: Any = None) -> dict[str, Any]:
        return {}

    def describe(self) -> str:
        return "router"

    def close(self) -> None:
        """Nothing to close: the servers belong to the test."""


def reuse_ratio(
    servers: list[TestClient], *, by_prefix: bool, states: int, questions: int
) -> float:
    """Reused over input tokens of `states` x `questions` decisions in a shuffled order."""
    rng = random.Random(11)
    texts = [f"Account {n}: " + _words(rng, 220) for n in range(states)]
    asked = [(state, q) for state in texts for q in range(questions)]
    rng.shuffle(asked)
    client = DecisionClient(Router(servers, by_prefix=by_prefix))
    reused = total = 0
    for state, question in asked:
        decision = {
            "id": f"q{question}",
            "question": f"Question {question}: which queue fits best?",
            "options": [
                {"id": "a", "description": "Billing."},
                {"id": "b", "description": "Access."},
            ],
            "state": state,
        }
        result = client.invoke({"decision": decision})["result"]
        reused += result["timing"]["reused_tokens"]
        total += result["input_tokens"]
    return reused / total


def test_routing_by_prefix_keeps_each_state_on_one_server(tiny_model_dir: Path) -> None:
    """Two servers, 6 states of ~1.3 KB, 6 questions each in a shuffled order: routed by the
    body's first 1,024 bytes each state is decoded on one server only; in turn, on both.
    The ratios go to docs/benchmark-history.md ("Prefix-aware routing")."""
    settings = Settings(model_dir=tiny_model_dir, max_tokens=4096, threads=1)
    with serving(settings) as first, serving(settings) as second:
        by_prefix = reuse_ratio([first, second], by_prefix=True, states=6, questions=6)
    with serving(settings) as first, serving(settings) as second:
        in_turn = reuse_ratio([first, second], by_prefix=False, states=6, questions=6)
    print(f"reused/input tokens: by prefix {by_prefix:.3f}, round robin {in_turn:.3f}")
    assert by_prefix > in_turn + 0.05
