"""Does CloudWatch hold the decision endpoint's container series? `semif check`'s warning
that the endpoint's PromQL alarms may watch nothing.

SageMaker's detailed observability scrapes the adapter's `/metrics` and publishes the
series to CloudWatch as OpenTelemetry metrics, under names its conversion chooses (the
Prometheus counter `semif_requests_total` may arrive as `semif_requests`), labelled
`aws.sagemaker.endpoint.name`. The PromQL alarms name what the container exposes. A PromQL
alarm whose query matches no series never leaves OK, so after the check's own call the
series must show up within a few publish periods; if not, the check warns (never fails)
with the query and the alarms to look at.

botocore has no call that runs PromQL (CloudWatch's query definitions only store one).
CloudWatch's Prometheus-compatible GetSeries API does (`POST
https://monitoring.<region>.amazonaws.com/api/v1/series`, form fields `match[]`, `start`,
`end`, `limit`; IAM `cloudwatch:ListMetrics`); it is signed here with botocore's SigV4 for
the `monitoring` service. The deploy's own check (cdk_constructs/endpoint_probe/handler.py)
does the same with the standard library, as a Lambda asset must; the tests hold the two to
the same queries and words.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any
from urllib.parse import urlencode

# What the alarms query first; then the name the OTel conversion would give the counter.
SERIES = ("semif_requests_total", "semif_requests")
ENDPOINT_LABEL = "aws.sagemaker.endpoint.name"
LOOKBACK_S = 3600  # series published within the hour count (an update's earlier config too)
POLL_S = 20.0

Send = Callable[[str, Mapping[str, str], bytes], bytes]


def series_query(metric: str, endpoint_name: str) -> str:
    """The endpoint's series of `metric`, as the alarms select them (and Query Studio takes)."""
    return f'{metric}{{"{ENDPOINT_LABEL}"="{endpoint_name}"}}'


def series_form(query: str, start: float, end: float) -> bytes:
    """GetSeries' form body: the selector over [start, end] (epoch seconds), one series is
    enough to know."""
    fields = [("match[]", query), ("start", str(int(start))), ("end", str(int(end)))]
    return urlencode([*fields, ("limit", "1")]).encode()


def absent_warning(endpoint_name: str, alarms: Sequence[str], waited_s: float, found: str) -> str:
    """What to look at when the alarms' series did not show up."""
    query = series_query(SERIES[0], endpoint_name)
    named = ", ".join(alarms) if alarms else "none found"
    other = (
        f"; {found} is there, so the alarms' metric names are not what CloudWatch publishes"
        if found
        else ""
    )
    return (
        f"no {SERIES[0]} series for {endpoint_name} in CloudWatch {waited_s:.0f} s after its "
        f"first call{other}: its PromQL alarms ({named}) may watch nothing and stay OK. "
        f"Check in CloudWatch Query Studio (PromQL): {query}"
    )


def _httpx_send(url: str, headers: Mapping[str, str], body: bytes) -> bytes:
    import httpx

    answer = httpx.post(url, headers=dict(headers), content=body, timeout=10.0)
    answer.raise_for_status()
    return answer.content


class SeriesReader:
    """GetSeries through `send` (httpx by default), signed with the session's credentials."""

    def __init__(self, session: Any, region: str, send: Send = _httpx_send) -> None:
        self._credentials = session.get_credentials()
        self._url = session.client("cloudwatch", region_name=region).meta.endpoint_url
        self._region = region
        self._send = send

    def count(self, query: str, start: float, end: float) -> int:
        """How many series match `query` over [start, end]."""
        from botocore.auth import SigV4Auth
        from botocore.awsrequest import AWSRequest

        body = series_form(query, start, end)
        headers = {"Content-Type": "application/x-www-form-urlencoded"}
        request = AWSRequest("POST", f"{self._url}/api/v1/series", data=body, headers=headers)
        SigV4Auth(self._credentials, "monitoring", self._region).add_auth(request)
        answer = json.loads(self._send(request.url, dict(request.headers.items()), body))
        return len(answer.get("data") or [])


def promql_alarms(cloudwatch: Any, endpoint_name: str) -> list[str]:
    """The PromQL alarms whose query selects this endpoint's series (DescribeAlarms)."""
    selector = f'"{ENDPOINT_LABEL}"="{endpoint_name}"'
    names = []
    for page in cloudwatch.get_paginator("describe_alarms").paginate(AlarmTypes=["MetricAlarm"]):
        for alarm in page.get("MetricAlarms", []):
            criteria = (alarm.get("EvaluationCriteria") or {}).get("PromQLCriteria") or {}
            if selector in str(criteria.get("Query", "")):
                names.append(str(alarm["AlarmName"]))
    return sorted(names)


def watch_series(
    reader: SeriesReader,
    endpoint_name: str,
    first_call_at: float,
    wait_s: float,
    alarms: Sequence[str],
    *,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> str | None:
    """Poll until the alarms' series appear (None), or until `wait_s` after the first call
    has passed: then the warning (`absent_warning`). Never raises for an absent series."""
    while True:
        now = clock()
        if reader.count(series_query(SERIES[0], endpoint_name), now - LOOKBACK_S, now):
            return None
        if now - first_call_at >= wait_s:
            found = [
                name
                for name in SERIES[1:]
                if reader.count(series_query(name, endpoint_name), now - LOOKBACK_S, now)
            ]
            return absent_warning(endpoint_name, alarms, now - first_call_at, ", ".join(found))
        sleep(min(POLL_S, max(0.0, first_call_at + wait_s - now)))


def series_warning(
    session: Any,
    endpoint_name: str,
    first_call_at: float,
    wait_s: float,
    *,
    send: Send = _httpx_send,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> str | None:
    """None once the alarms' series are in CloudWatch; else the warning, also when they
    cannot be read (no permission, no PromQL in the region): the check never fails on it."""
    import httpx
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        region = session.region_name
        reader = SeriesReader(session, region, send)
        alarms = promql_alarms(session.client("cloudwatch", region_name=region), endpoint_name)
        return watch_series(
            reader, endpoint_name, first_call_at, wait_s, alarms, clock=clock, sleep=sleep
        )
    except (BotoCoreError, ClientError, httpx.HTTPError, ValueError) as error:
        query = series_query(SERIES[0], endpoint_name)
        return (
            f"could not read {endpoint_name}'s container series ({error}); check in "
            f"CloudWatch Query Studio (PromQL): {query}"
        )
