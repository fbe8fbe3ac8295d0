"""The decision endpoint's alarms against the adapter they watch: the PromQL queries the
stacks synthesize (cdk_constructs/endpoint_operations.py), evaluated on the real server's
`/metrics`, and the statuses SageMaker's 5XX alarm counts.

Three servers on the tiny model: a healthy one under overload, whose refusals are 429s that
no alarm reads; one whose passes take several times longer, which the ScoringSpeed query
finds; and one whose logits turn non-finite after it loaded, which answers 5XX (the 5XX
rate rolls the deployment back) and then 503 `unhealthy` (the Unavailable query pages).

PromQL is evaluated for the shapes these queries have: `sum [by (...)] (rate(m{...}[w]))`
terms divided and compared with a number, the rate taken between two scrapes. One process
is one instance, so `by (instance)` groups nothing.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from adapter.app import create_app
from adapter.settings import Settings
from cdk_constructs.endpoint_operations import (
    ENDPOINT_LABEL,
    scoring_speed_query,
    unavailable_query,
)
from tests.support.live_server import live_server, runtime_of
from tests.support.serving import decision

ENDPOINT = "semif-test-decision"
Scrape = dict[tuple[str, frozenset[tuple[str, str]]], float]
_RATE = re.compile(r"sum(?: by \([^)]*\))? \(rate\((?P<name>\w+)\{(?P<labels>[^}]*)\}\[\w+\]\)\)")
_MATCHER = re.compile(r'"?(?P<key>[^",=]+)"?="(?P<value>[^"]*)"')


def scrape(url: str) -> Scrape:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def evaluate(query: str, before: Scrape, after: Scrape, seconds: float) -> bool:
    """Whether `query` (`A / B > t` or `A / B < t`) returns a series: breaching."""
    terms, operator, threshold = re.fullmatch(r"(.*) ([<>]) ([\d.e-]+)", query).groups()  # type: ignore[union-attr]
    numerator, denominator = (
        _rate(match, before, after, seconds) for match in _RATE.finditer(terms)
    )
    if denominator == 0:
        return False  # no traffic: no series
    ratio = numerator / denominator
    return ratio > float(threshold) if operator == ">" else ratio < float(threshold)


def _rate(match: re.Match[str], before: Scrape, after: Scrape, seconds: float) -> float:
    """The summed rate of one counter's series that match the term's labels (the endpoint
    label is SageMaker's: the container's own series do not carry it)."""
    wanted = {
        m["key"]: m["value"]
        for m in _MATCHER.finditer(match["labels"])
        if m["key"] != ENDPOINT_LABEL
    }

    def total(scraped: Scrape) -> float:
        return sum(
            value
            for (name, labels), value in scraped.items()
            if name == match["name"] and wanted.items() <= dict(labels).items()
        )

    return (total(after) - total(before)) / seconds


@contextmanager
def measured(url: str) -> Iterator[dict[str, Any]]:
    """Scrape before and after the block; the result holds both and the seconds between."""
    window: dict[str, Any] = {"before": scrape(url), "started": time.monotonic()}
    yield window
    window["after"] = scrape(url)
    window["seconds"] = time.monotonic() - window["started"]


def breaches(query: str, window: dict[str, Any]) -> bool:
    return evaluate(query, window["before"], window["after"], window["seconds"])


def decide(url: str, count: int, *, clients: int = 1) -> list[int]:
    """`count` decisions about distinct states from `clients` threads; their statuses."""
    statuses: list[int] = []
    lock = threading.Lock()

    def run(offset: int) -> None:
        with httpx.Client(timeout=60) as http:
            for index in range(offset, count, clients):
                body = {"decision": decision(f"d{index}", f"Ticket {index}: it is late.")}
                status = http.post(f"{url}/invocations", json=body).status_code
                with lock:
                    statuses.append(status)

    threads = [threading.Thread(target=run, args=(offset,)) for offset in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return statuses


def seconds_per_row(window: dict[str, Any]) -> float:
    query = scoring_speed_query(ENDPOINT, 0.0)
    terms = query.rsplit(" > ", 1)[0]
    numerator, denominator = (
        _rate(match, window["before"], window["after"], window["seconds"])
        for match in _RATE.finditer(terms)
    )
    return numerator / denominator


def test_overload_trips_nothing_and_a_slower_model_trips_scoring_speed(
    tiny_model_dir: Path,
) -> None:
    """16 clients against a queue of 2: many 429s, no 5XX, the Unavailable query quiet, the
    speed query at the healthy pace; then every pass takes 0.2 s longer inside the engine
    (many times the tiny model's own time) and the speed query, at three times the healthy
    reading, fires."""
    settings = Settings(
        model_dir=tiny_model_dir, max_tokens=1024, threads=2, max_queue=2, queue_timeout_seconds=1
    )
    app = create_app(settings)
    with live_server(app) as url:
        decide(url, 4)  # the first passes measure the speed
        with measured(url) as healthy:
            statuses = decide(url, 96, clients=16)
        assert 429 in statuses
        assert all(status < 500 for status in statuses)
        assert not breaches(unavailable_query(ENDPOINT, 1.0), healthy)
        limit_ms = 3 * seconds_per_row(healthy) * 1000
        assert not breaches(scoring_speed_query(ENDPOINT, limit_ms), healthy)

        engine = runtime_of(app).service.engine  # type: ignore[union-attr]
        real_run = engine._plan_and_run

        def slow(*args: Any, **kwargs: Any) -> Any:  # inside the engine's own pass timing
            time.sleep(0.2)
            return real_run(*args, **kwargs)

        engine._plan_and_run = slow  # type: ignore[method-assign]
        with measured(url) as slowed:
            decide(url, 12)
    assert seconds_per_row(slowed) > 3 * seconds_per_row(healthy)
    assert breaches(scoring_speed_query(ENDPOINT, limit_ms), slowed)


def test_non_finite_logits_are_5xx_and_page_as_unavailable(tiny_model_dir: Path) -> None:
    """Logits that turn NaN after the load (a fault in the weights' memory, a bad kernel):
    the call is a 500 and the instance reports unhealthy, so what follows is 503
    `unhealthy`: SageMaker counts both in Invocation5XXErrors (the rollback alarm) and the
    Unavailable query (503 share) fires."""
    settings = Settings(model_dir=tiny_model_dir, max_tokens=1024, threads=2)
    app = create_app(settings)
    with live_server(app) as url:
        decide(url, 2)
        engine = runtime_of(app).service.engine  # type: ignore[union-attr]
        real_score = engine.score

        def poisoned(*args: Any, **kwargs: Any) -> Any:
            scores, timing = real_score(*args, **kwargs)
            for score in scores:
                score.logits[...] = np.nan
            return scores, timing

        engine.score = poisoned  # type: ignore[method-assign]
        with measured(url) as broken:
            statuses = decide(url, 6)
    assert statuses[0] == 500
    assert set(statuses[1:]) == {503}
    assert breaches(unavailable_query(ENDPOINT, 25.0), broken)


@pytest.mark.parametrize(
    "query", [scoring_speed_query(ENDPOINT, 10.0), unavailable_query(ENDPOINT, 1.0)]
)
def test_the_evaluator_reads_both_terms_of_each_query(query: str) -> None:
    """The evaluator above sees two rate terms in each query it is given (the shape could
    drift from what it parses, and a query it misread would pass every test)."""
    assert len(list(_RATE.finditer(query))) == 2
