"""GET /metrics (adapter/metrics.py) on the real server and the tiny model: what a mix of
requests counts, parsed back with prometheus_client's own parser; labels that stay a small
fixed set whatever ids, states and paths callers send; the route answering while the worker
is busy; and who may read it."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from starlette.testclient import TestClient

from adapter.errors import UnavailableCause
from adapter.metrics import APIS
from adapter.runtime import Runtime
from adapter.settings import Settings
from tests.support.serving import decision, serving

HEADERS = {"content-type": "application/json"}


def samples(client: TestClient, **headers: str) -> list[Sample]:
    response = client.get("/metrics", headers=headers)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return [
        sample
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    ]


def value(found: list[Sample], name: str, **labels: str) -> float:
    matching = [s.value for s in found if s.name == name and s.labels == labels]
    assert len(matching) == 1, (name, labels, [s for s in found if s.name == name])
    return float(matching[0])


def runtime_of(client: TestClient) -> Runtime:
    runtime = client.app.state.runtime  # type: ignore[attr-defined]
    assert isinstance(runtime, Runtime)
    return runtime


@pytest.fixture
def client(tiny_model_dir: Path) -> Iterator[TestClient]:
    with serving(Settings(model_dir=tiny_model_dir, max_tokens=1024, threads=2)) as served:
        yield served


def test_a_mix_of_requests_is_counted(client: TestClient) -> None:
    single = client.post("/invocations", json={"decision": decision()})
    shared = client.post(
        "/invocations",
        json={"decisions": [decision("a"), decision("b", question="Is it urgent?")]},
    )
    systemone = client.post(
        "/invocations",
        json={"state": "s", "questions": {"q": {"type": "noul", "instructions": "Yes?"}}},
    )
    invalid = client.post("/invocations", json={"decision": {**decision(), "options": []}})
    not_json = client.post("/invocations", content=b"x", headers={"content-type": "text/plain"})
    chat = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    statuses = [r.status_code for r in (single, shared, systemone, invalid, not_json, chat)]
    assert statuses == [200, 200, 200, 400, 415, 200]
    found = samples(client)
    assert value(found, "semif_requests_total", api="decision", status="200") == 2
    assert value(found, "semif_requests_total", api="decision", status="400") == 1
    assert value(found, "semif_requests_total", api="systemone", status="200") == 1
    assert value(found, "semif_requests_total", api="chat", status="200") == 1
    assert value(found, "semif_requests_total", api="unknown", status="415") == 1
    assert value(found, "semif_request_duration_seconds_count", api="decision") == 3
    # Questions by kind and order mode: 1 + 2 choice decisions, one yes/no.
    assert value(found, "semif_questions_total", kind="choice", option_order="canonical") == 3
    assert value(found, "semif_questions_total", kind="noul", option_order="canonical") == 1
    assert value(found, "semif_allowed_token_mass_count", kind="choice") == 3
    assert value(found, "semif_abstentions_total") == 0
    # Passes and the tokens they evaluated: one more request adds what its timing says.
    passes = value(found, "semif_pass_duration_seconds_count")
    assert passes >= 3
    assert value(found, "semif_pass_requests_count") == passes
    before = {
        source: value(found, "semif_prompt_tokens_total", source=source)
        for source in ("evaluated", "reused")
    }
    again = client.post(
        "/invocations",
        json={"decisions": [decision("a"), decision("c", question="Who should call back?")]},
    )
    timing = again.json()["timing"]
    after = samples(client)
    for source in ("evaluated", "reused"):
        added = value(after, "semif_prompt_tokens_total", source=source) - before[source]
        assert added == timing[f"{source}_tokens"]
    assert timing["reused_tokens"] > 0  # the state was resident from the first shared call
    assert value(found, "semif_queue_wait_seconds_count") == 3  # the scoring calls
    completion = chat.json()["usage"]["completion_tokens"]
    assert value(found, "semif_chat_tokens_total", kind="completion") == completion
    assert value(found, "semif_model_load_seconds") > 0
    assert value(found, "semif_queue_depth") == 0
    assert value(found, "semif_in_flight_requests") == 0


def test_labels_stay_a_fixed_set_whatever_callers_send(client: TestClient) -> None:
    """Ids, states, option ids, request ids and SageMaker endpoint names never become label
    values: the series stay few however many distinct requests arrive."""
    rng = random.Random(7)
    for index in range(30):
        ident = f"id-{rng.getrandbits(64):x}"
        body: Any = {"decision": decision(ident, state=f"state {ident}")}
        if index % 3 == 1:
            body = {"decision": {**decision(ident), "options": [{"id": ident}]}}  # a 400
        path = f"/endpoints/{ident}/invocations" if index % 2 else "/invocations"
        client.post(path, json=body, headers={"x-request-id": ident})
    found = samples(client)
    causes: set[str] = set(UnavailableCause.__args__)  # type: ignore[attr-defined]
    allowed = {
        "api": set(APIS),
        "status": {"200", "400", "401", "408", "413", "415", "422", "424", "499", "500", "503"},
        "cause": causes,
        "kind": {"choice", "noul", "score", "prompt", "completion"},
        "option_order": {"canonical", "as_given", "debiased"},
        "source": {"evaluated", "reused", "pad"},
        "le": {s.labels["le"] for s in found if "le" in s.labels},  # bucket bounds: fixed
    }
    for sample in found:
        for label, given in sample.labels.items():
            assert given in allowed[label], (sample.name, label, given)
    series = {(s.name, tuple(sorted(s.labels.items()))) for s in found}
    assert len(series) < 200


def test_the_route_answers_while_the_worker_is_busy(client: TestClient) -> None:
    runtime = runtime_of(client)
    service = runtime.service
    assert service is not None
    gate, entered = threading.Event(), threading.Event()
    real_score = service.engine.score

    def held(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        gate.wait(10)
        return real_score(*args, **kwargs)

    service.engine.score = held  # type: ignore[method-assign]
    worker = threading.Thread(
        target=lambda: client.post("/invocations", json={"decision": decision()})
    )
    worker.start()
    try:
        assert entered.wait(10)
        found = samples(client)  # the pass is held: the scrape must not wait for it
        assert value(found, "semif_in_flight_requests") == 1
    finally:
        gate.set()
        worker.join(10)
    assert value(samples(client), "semif_in_flight_requests") == 0


@pytest.mark.parametrize("in_sagemaker", [False, True], ids=["outside", "inside"])
def test_outside_sagemaker_the_key_guards_it_inside_it_is_open(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, in_sagemaker: bool
) -> None:
    """SageMaker scrapes /metrics without credentials (its IAM guards the endpoint); a
    local server with SEMIF_API_KEY guards it like /invocations."""
    settings = Settings(
        model_dir=tiny_model_dir, threads=1, api_key="k" * 32, allow_unverified_model=True
    )
    monkeypatch.setattr(Settings, "in_sagemaker", property(lambda self: in_sagemaker))
    with serving(settings) as served:
        anonymous = served.get("/metrics")
        keyed = served.get("/metrics", headers={"authorization": "Bearer " + "k" * 32})
    assert anonymous.status_code == (200 if in_sagemaker else 401)
    assert keyed.status_code == 200


def test_a_variant_labels_every_series(tiny_model_dir: Path) -> None:
    """With SEMIF_VARIANT set every series carries it, so the primary's alarms can leave a
    shadow candidate's instances out; without it the series are as recorded."""
    settings = Settings(model_dir=tiny_model_dir, max_tokens=1024, threads=2, variant="Candidate")
    with serving(settings) as served:
        answered = served.post("/invocations", json={"decision": decision()}, headers=HEADERS)
        assert answered.status_code == 200
        found = samples(served)
    assert {sample.labels.get("variant") for sample in found} == {"Candidate"}
    assert value(found, "semif_requests_total", api="decision", status="200", variant="Candidate")
