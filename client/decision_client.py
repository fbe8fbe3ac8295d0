"""A small client for application code: decisions, System One questions and chat.

One interface, two transports: a SageMaker endpoint through boto3's `sagemaker-runtime`
`invoke_endpoint`, or a local `serve` over HTTP. Everything goes through /invocations, so
the same calls work on both. A busy answer (a retryable 503, a 429, SageMaker throttling)
is retried: after the endpoint's own Retry-After when it gives one, else with capped
exponential backoff and full jitter, within a bounded number of attempts and a bounded total
time; other answers are never retried. A retry sends back the refusal's `retry_token`, the
caller's place in the endpoint's retry line, so it is served ahead of newcomers once its
turn comes. Errors keep the endpoint's message.

Only boto3 (SageMaker) or httpx (local URL) is needed: this module never imports llama.cpp.

    client = DecisionClient.for_endpoint("semif-decision", region="us-east-1")
    result = client.decide({"id": "route", "state": "...", "question": "...",
                            "options": [{"id": "a", "description": "..."}, ...]})
    print(result.choice, result.probability("a"))
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx

if TYPE_CHECKING:
    from client.batch_local import Summary

DEFAULT_TIMEOUT_S = 120.0
JSON = "application/json"
JSON_LINES = "application/jsonlines"  # one request per line (the endpoint's offline form)
_BUSY_AWS_ERRORS = ("ThrottlingException", "ServiceUnavailable", "ModelNotReadyException")
_RETRYABLE_STATUSES = (429, 503)
# SageMaker is not known to pass a container's headers on in a ModelError: a hint meant for
# SageMaker callers has to ride in the JSON body, under this name.
RETRY_AFTER_FIELD = "retry_after_seconds"
# A refusal's place in the endpoint's retry line: the body's `retry_token`, sent back as
# `semif-retry-token=<token>` in InvokeEndpoint's CustomAttributes, which SageMaker forwards
# as the header below (sent as such to a URL).
RETRY_TOKEN_FIELD = "retry_token"  # noqa: S105 - names, not secrets
RETRY_TOKEN_ATTRIBUTE = "semif-retry-token"  # noqa: S105
CUSTOM_ATTRIBUTES_HEADER = "x-amzn-sagemaker-custom-attributes"
_RETRY_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,64}")
# SageMaker's prefix-aware routing hint (InvokeEndpoint `PrefixAwareId`): 1-64 printable
# characters, not starting with a space.
PREFIX_AWARE_ID_HEADER = "x-amzn-sagemaker-prefix-aware-id"
_PREFIX_AWARE_ID = re.compile(r"[!-~][ -~]{0,63}")
# The keys that hold a state, put first in every body (`state_first`).
_STATE_KEYS = ("decision", "decisions", "state")
_DELTA_SECONDS = re.compile(r"[0-9]+")
_ENDPOINT_DONE = ("InService", "Failed", "OutOfService", "Deleting")


class EndpointError(Exception):
    """The endpoint answered with an error; `message` is its own explanation."""

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.body = body


class BusyError(EndpointError):
    """A retryable answer: 429, 503 unless the body says `"retryable": false`, SageMaker
    throttling. Raised by the client once the retry policy gives up (the last answer is its
    `__cause__`). `retry_after_s` is the endpoint's hint, None when it gave none;
    `retry_token` the place in its retry line to send back with the next attempt."""

    def __init__(
        self,
        status: int,
        message: str,
        body: Any = None,
        *,
        retry_after_s: float | None = None,
        retry_token: str | None = None,
    ) -> None:
        super().__init__(status, message, body)
        self.retry_after_s = retry_after_s
        self.retry_token = retry_token


class UnreachableError(EndpointError):
    """No HTTP answer at all (connection refused, timeout); status is 0."""


@dataclass(frozen=True)
class RetryPolicy:
    """When to retry a busy answer, bounded in attempts and in total time.

    The endpoint knows how long its queue is, so its Retry-After wins: the client waits that
    long plus uniform(0, retry_after_jitter_s), the jitter keeping clients told the same
    number from returning together. Without a hint it backs off exponentially with full
    jitter: before retry n (0-based) uniform(0, min(max_delay_s, base_delay_s * 2**n)).
    No sleep ends past `max_total_s` after the first attempt started, and a hint that does
    not fit in what is left ends the call at once (coming back early only adds load).

    The default budget is 30 s: retries start within 30 s, so a last try answered within
    another 30 s ends the call inside 60 s, SageMaker's limit for one invocation. The
    attempt limit is a backstop against tiny delays hammering a busy endpoint.
    """

    max_attempts: int = 30
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0
    max_total_s: float = 30.0
    retry_after_jitter_s: float = 0.5

    def __post_init__(self) -> None:
        delays = (self.base_delay_s, self.max_delay_s, self.max_total_s, self.retry_after_jitter_s)
        if self.max_attempts < 1 or min(delays) < 0:
            raise ValueError("max_attempts must be >= 1 and delays >= 0")

    def give_up_reason(
        self, attempts: int, elapsed_s: float, retry_after_s: float | None
    ) -> str | None:
        """Why no retry may follow `attempts` busy answers `elapsed_s` into the call; None
        while one may."""
        remaining = self.max_total_s - elapsed_s
        if attempts >= self.max_attempts:
            return f"the attempt limit is {self.max_attempts}"
        if remaining <= 0:
            return f"the {self.max_total_s:g} s retry budget is spent"
        if retry_after_s is not None and retry_after_s > remaining:
            return (
                f"the endpoint asked to retry after {retry_after_s:.1f} s, more than the "
                f"{remaining:.1f} s left of the {self.max_total_s:g} s retry budget"
            )
        return None

    def delay_s(
        self, retry: int, elapsed_s: float, retry_after_s: float | None, unit: float
    ) -> float:
        """The sleep before retry `retry` (0-based), for a uniform draw `unit` in [0, 1)."""
        if retry_after_s is None:
            wanted = unit * min(self.max_delay_s, self.base_delay_s * 2.0**retry)
        else:
            wanted = retry_after_s + unit * self.retry_after_jitter_s
        return max(0.0, min(wanted, self.max_total_s - elapsed_s))


def parse_retry_after(value: str, now: float) -> float | None:
    """A Retry-After value as seconds from `now` (epoch seconds): delta-seconds or an
    HTTP-date (RFC 9110 10.2.3; a date in the past is 0). None when it is neither, so a
    malformed hint falls back to backoff instead of failing the call."""
    text = value.strip()
    if _DELTA_SECONDS.fullmatch(text):
        return float(text)
    try:
        when = parsedate_to_datetime(text)
    except ValueError:
        return None
    if when.tzinfo is None:  # asctime and "-0000" dates carry no zone; HTTP-dates are GMT
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - now)


# -- typed results ------------------------------------------------------------------------


@dataclass(frozen=True)
class DecisionResult:
    """One decision's answer: probabilities over the options, in the request's order."""

    id: str
    option_ids: list[str]
    probabilities: list[float]
    allowed_token_mass: float
    input_tokens: int
    prompt_sha256: str
    raw: dict[str, Any] = field(repr=False)
    readout: str = "letters"  # or "likelihood" (then `raw["normalization"]` says which)

    @classmethod
    def from_json(cls, result: Mapping[str, Any]) -> DecisionResult:
        return cls(
            readout=str(result.get("readout", "letters")),
            id=result["id"],
            option_ids=list(result["option_ids"]),
            probabilities=[float(p) for p in result["probabilities"]],
            allowed_token_mass=float(result["allowed_token_mass"]),
            input_tokens=int(result["input_tokens"]),
            prompt_sha256=result["prompt_sha256"],
            raw=dict(result),
        )

    @property
    def choice(self) -> str:
        """The most probable option id (the first one on a tie)."""
        best = max(range(len(self.probabilities)), key=self.probabilities.__getitem__)
        return self.option_ids[best]

    def probability(self, option_id: str) -> float:
        return self.probabilities[self.option_ids.index(option_id)]


@dataclass(frozen=True)
class NoulAnswer:
    yes: float  # P(yes)


@dataclass(frozen=True)
class ChoiceAnswer:
    choice: str
    probabilities: dict[str, float]
    confidence: float


@dataclass(frozen=True)
class ScoreAnswer:
    score: float  # expected level, 0..N-1
    legend: dict[str, str]
    probabilities: dict[str, float]
    confidence: float


SystemOneAnswer = NoulAnswer | ChoiceAnswer | ScoreAnswer


def _system_one_answer(answer: Mapping[str, Any]) -> SystemOneAnswer:
    kind = answer["type"]
    if kind == "noul":
        return NoulAnswer(yes=float(answer["noul"]))
    probabilities = {key: float(p) for key, p in answer["probabilities"].items()}
    if kind == "choice":
        return ChoiceAnswer(answer["choice"], probabilities, float(answer["confidence"]))
    if kind == "score":
        return ScoreAnswer(
            float(answer["score"]),
            dict(answer["legend"]),
            probabilities,
            float(answer["confidence"]),
        )
    raise EndpointError(200, f"unknown System One answer type {kind!r}", answer)


@dataclass(frozen=True)
class SystemOneAnswers:
    """Answers keyed like the request's questions."""

    model: str
    answers: dict[str, SystemOneAnswer]
    input_tokens: int
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> SystemOneAnswers:
        return cls(
            model=body["model"],
            answers={key: _system_one_answer(value) for key, value in body["answers"].items()},
            input_tokens=int(body["usage"]["input_tokens"]),
            raw=dict(body),
        )

    def __getitem__(self, key: str) -> SystemOneAnswer:
        return self.answers[key]


@dataclass(frozen=True)
class ChatCompletion:
    id: str
    model: str
    content: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ChatCompletion:
        choice = body["choices"][0]
        return cls(
            id=body["id"],
            model=body["model"],
            content=choice["message"]["content"],
            finish_reason=choice["finish_reason"],
            prompt_tokens=int(body["usage"]["prompt_tokens"]),
            completion_tokens=int(body["usage"]["completion_tokens"]),
            raw=dict(body),
        )


# -- transports ---------------------------------------------------------------------------


class Transport(Protocol):
    """Posts one body to /invocations, with the retry token an earlier refusal gave (if
    any); returns the parsed 2xx answer (a JSON Lines answer as its list of objects) or
    raises."""

    def post(
        self, body: bytes, retry_token: str | None = None, content_type: str = JSON
    ) -> Any: ...

    def wait_until_ready(
        self, timeout_s: float, progress: Callable[[str], None] | None = None
    ) -> dict[str, Any]: ...

    def describe(self) -> str: ...

    def close(self) -> None: ...


def _retry_after_s(header: str | None, body: Any) -> float | None:
    """The endpoint's retry hint: a valid Retry-After header, else the body's
    `retry_after_seconds` (the only hint that survives SageMaker's ModelError)."""
    parsed = None if header is None else parse_retry_after(header, time.time())
    if parsed is not None:
        return parsed
    hint = body.get(RETRY_AFTER_FIELD) if isinstance(body, dict) else None
    if isinstance(hint, bool) or not isinstance(hint, int | float) or not hint >= 0:  # NaN too
        return None
    return float(hint)


def retry_token_of(body: Any) -> str | None:
    """The refusal's place in the retry line, when the body carries a well-formed one."""
    token = body.get(RETRY_TOKEN_FIELD) if isinstance(body, dict) else None
    return token if isinstance(token, str) and _RETRY_TOKEN.fullmatch(token) else None


def custom_attributes(retry_token: str) -> str:
    """The CustomAttributes (or header) value that hands a retry token back."""
    return f"{RETRY_TOKEN_ATTRIBUTE}={retry_token}"


def _error_from_answer(status: int, text: str, retry_after: str | None) -> EndpointError:
    """Keep the endpoint's own message: the `error` field of a JSON body, else the text.
    429 and 503 are busy unless the body says `"retryable": false` (an unhealthy model)."""
    try:
        body: Any = json.loads(text)
    except ValueError:
        body = text
    message = body.get("error") if isinstance(body, dict) else None
    message = message if isinstance(message, str) else text.strip() or f"HTTP {status}"
    refused = isinstance(body, dict) and body.get("retryable") is False
    if status in _RETRYABLE_STATUSES and not refused:
        return BusyError(
            status,
            message,
            body,
            retry_after_s=_retry_after_s(retry_after, body),
            retry_token=retry_token_of(body),
        )
    return EndpointError(status, message, body)


def check_prefix_aware_id(value: str | None) -> str | None:
    """A prefix-aware id as SageMaker takes it, else a ValueError saying why."""
    if value is not None and not _PREFIX_AWARE_ID.fullmatch(value):
        raise ValueError(
            f"prefix_aware_id {value!r}: 1 to 64 printable ASCII characters, not starting "
            "with a space"
        )
    return value


def state_first(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body with its state first: at the top, `decision`, `decisions` or `state`, and
    inside each decision its `state`; every other key keeps its place after them. Requests
    about one state then share their leading bytes up to the end of it, whatever their ids,
    questions and options, which is what SageMaker's prefix-aware routing keys on (it reads
    the first PrefixLength bytes of the body). The endpoint accepts any key order."""

    def ordered(item: Any, first: Sequence[str]) -> Any:
        if not isinstance(item, Mapping):
            return item
        keys = [key for key in first if key in item]
        return {key: item[key] for key in (*keys, *(k for k in item if k not in first))}

    top = ordered(body, _STATE_KEYS)
    if "decision" in top:
        top["decision"] = ordered(top["decision"], ("state",))
    if isinstance(top.get("decisions"), list):
        top["decisions"] = [ordered(item, ("state",)) for item in top["decisions"]]
    return dict(top)


def _parse_answer(text: str | bytes, content_type: str = JSON) -> Any:
    """The 2xx answer: one JSON value, or for a JSON Lines request the list of its lines."""
    try:
        if content_type == JSON_LINES:
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        return json.loads(text)
    except ValueError:
        raise EndpointError(200, "the endpoint answered with invalid JSON", text) from None


class HttpTransport:
    """A local (or any HTTP) `serve`: POST {base_url}/invocations."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,
        prefix_aware_id: str | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # A local serve started with SEMIF_API_KEY guards every route but /ping.
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        routing = check_prefix_aware_id(prefix_aware_id)
        if routing is not None:
            headers[PREFIX_AWARE_ID_HEADER] = routing
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers)

    def describe(self) -> str:
        return self.base_url

    def post(self, body: bytes, retry_token: str | None = None, content_type: str = JSON) -> Any:
        headers = {"content-type": content_type}
        if retry_token is not None:
            headers[CUSTOM_ATTRIBUTES_HEADER] = custom_attributes(retry_token)
        try:
            response = self._http.post("/invocations", content=body, headers=headers)
        except httpx.HTTPError as error:
            raise UnreachableError(0, f"cannot reach {self.base_url}: {error}") from None
        if response.status_code >= 300:
            raise _error_from_answer(
                response.status_code, response.text, response.headers.get("retry-after")
            )
        return _parse_answer(response.content, content_type)

    def wait_until_ready(
        self, timeout_s: float, progress: Callable[[str], None] | None = None
    ) -> dict[str, Any]:
        """Poll /ping until 200 and return its answer; stop at once if the server reports a
        failed model load."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while True:
            try:
                response = self._http.get("/ping", timeout=5)
                ping: dict[str, Any] = response.json()
                if response.status_code == 200:
                    return ping
                if ping.get("status") == "failed":
                    raise EndpointError(503, f"model load failed: {ping.get('error')}", ping)
                last = str(ping.get("status"))
            except (httpx.HTTPError, ValueError) as error:
                last = str(error) or type(error).__name__
            if progress is not None:
                progress(f"{self.base_url}: {last}")
            if time.monotonic() >= deadline:
                raise EndpointError(
                    0, f"{self.base_url}/ping not ready in {timeout_s:.0f} s: {last}"
                )
            time.sleep(0.25)

    def close(self) -> None:
        self._http.close()


class SageMakerTransport:
    """A SageMaker real-time endpoint through boto3 `sagemaker-runtime` `invoke_endpoint`.

    A container error arrives as botocore's ModelError (HTTP 424) carrying the container's
    status and body; it is mapped back to that status and message. The client created here
    (optionally for `endpoint_url`, e.g. a local serve) has botocore's own retries off, so
    the retry policy alone decides; a `runtime_client` passed in keeps its own.
    """

    def __init__(
        self,
        endpoint_name: str,
        *,
        region: str | None = None,
        runtime_client: Any = None,
        endpoint_url: str | None = None,
        control_client: Any = None,
        poll_s: float = 15.0,
        prefix_aware_id: str | None = None,
    ) -> None:
        if runtime_client is not None and endpoint_url is not None:
            raise ValueError("pass runtime_client or endpoint_url, not both")
        self.endpoint_name = endpoint_name
        self.prefix_aware_id = check_prefix_aware_id(prefix_aware_id)
        self.region = region
        self.poll_s = poll_s  # DescribeEndpoint interval while waiting
        self._runtime = runtime_client or _boto3_client("sagemaker-runtime", region, endpoint_url)
        self._control = control_client

    @property
    def runtime_client(self) -> Any:
        """The boto3 `sagemaker-runtime` client the calls go through."""
        return self._runtime

    def describe(self) -> str:
        return f"SageMaker endpoint {self.endpoint_name}"

    def close(self) -> None:
        """boto3 clients hold no resources that need closing."""

    def post(self, body: bytes, retry_token: str | None = None, content_type: str = JSON) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        extra = {} if retry_token is None else {"CustomAttributes": custom_attributes(retry_token)}
        if self.prefix_aware_id is not None:
            extra["PrefixAwareId"] = self.prefix_aware_id
        try:
            answer = self._runtime.invoke_endpoint(
                EndpointName=self.endpoint_name,
                ContentType=content_type,
                Accept=content_type,
                Body=body,
                **extra,
            )
        except ClientError as error:
            raise _error_from_client_error(error.response) from None
        except BotoCoreError as error:
            raise UnreachableError(0, f"cannot reach {self.describe()}: {error}") from None
        return _parse_answer(answer["Body"].read(), content_type)

    def wait_until_ready(
        self, timeout_s: float, progress: Callable[[str], None] | None = None
    ) -> dict[str, Any]:
        """Poll DescribeEndpoint until InService and return its answer; fail on Failed with
        SageMaker's reason."""
        control = self._control or _boto3_client("sagemaker", self.region)
        started = time.monotonic()
        while True:
            endpoint = control.describe_endpoint(EndpointName=self.endpoint_name)
            status = endpoint["EndpointStatus"]
            elapsed = time.monotonic() - started
            if progress is not None:
                progress(f"{self.endpoint_name}: {status} ({elapsed:.0f} s)")
            if status == "InService":
                return dict(endpoint)
            if status in _ENDPOINT_DONE:
                reason = endpoint.get("FailureReason", "no reason given")
                raise EndpointError(0, f"endpoint {self.endpoint_name} is {status}: {reason}")
            if elapsed >= timeout_s:
                raise EndpointError(
                    0, f"endpoint {self.endpoint_name} still {status} after {timeout_s:.0f} s"
                )
            time.sleep(min(self.poll_s, max(0.0, timeout_s - elapsed)))


def _boto3_client(service: str, region: str | None, endpoint_url: str | None = None) -> Any:
    """One try per call: botocore's `max_attempts` counts retries (1 would mean 2 tries),
    and its standard mode retries throttling, 5xx and read timeouts with its own sleeps, so
    only `total_max_attempts` 1 keeps a call inside the policy's budget. The read timeout
    outlasts SageMaker's 60 s invocation limit; a connection takes seconds or fails."""
    import boto3
    from botocore.config import Config

    config = Config(
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=10,
        read_timeout=70,
    )
    return boto3.client(service, region_name=region, endpoint_url=endpoint_url, config=config)


def _error_from_client_error(response: Mapping[str, Any]) -> EndpointError:
    """ModelError -> the container's own status and message; throttling -> busy. A
    Retry-After on the AWS answer itself is honoured (the local serve's SageMaker route
    keeps the container's; SageMaker is not known to)."""
    code = response.get("Error", {}).get("Code", "")
    message = response.get("Error", {}).get("Message", "")
    metadata = response.get("ResponseMetadata", {})
    retry_after = metadata.get("HTTPHeaders", {}).get("retry-after")
    if code == "ModelError" and "OriginalStatusCode" in response:
        original = str(response.get("OriginalMessage", message))
        return _error_from_answer(int(response["OriginalStatusCode"]), original, retry_after)
    status = int(metadata.get("HTTPStatusCode", 0))
    if code in _BUSY_AWS_ERRORS:
        hint = _retry_after_s(retry_after, None)
        return BusyError(status, f"{code}: {message}", dict(response), retry_after_s=hint)
    return EndpointError(status, f"{code}: {message}", dict(response))


# -- the client ---------------------------------------------------------------------------


class DecisionClient:
    """Typed calls on a decision endpoint, with the retry policy applied to every call."""

    def __init__(
        self,
        transport: Transport,
        *,
        retry: RetryPolicy | None = None,
        sleep: Callable[[float], None] = time.sleep,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.transport = transport
        self.retry = retry or RetryPolicy()
        self._sleep = sleep
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not security
        self._clock = clock  # measures the retry budget; injected with `sleep` in tests

    @classmethod
    def for_url(
        cls,
        base_url: str,
        *,
        retry: RetryPolicy | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,
        prefix_aware_id: str | None = None,
    ) -> DecisionClient:
        """A local or self-hosted `serve`, e.g. http://127.0.0.1:8080; `api_key` is the
        server's SEMIF_API_KEY, sent as a bearer token; `prefix_aware_id` is sent as
        SageMaker's prefix-aware routing header (see `for_endpoint`)."""
        transport = HttpTransport(
            base_url, timeout_s=timeout_s, api_key=api_key, prefix_aware_id=prefix_aware_id
        )
        return cls(transport, retry=retry)

    @classmethod
    def for_endpoint(
        cls,
        endpoint_name: str,
        *,
        region: str | None = None,
        runtime_client: Any = None,
        endpoint_url: str | None = None,
        retry: RetryPolicy | None = None,
        control_client: Any = None,
        prefix_aware_id: str | None = None,
    ) -> DecisionClient:
        """A SageMaker endpoint. `endpoint_url` sends the runtime calls elsewhere (e.g. a
        local serve) with the client's own boto3 settings; `runtime_client` reuses a boto3
        client configured by the caller, botocore retries included. `prefix_aware_id` (1-64
        printable characters) is InvokeEndpoint's `PrefixAwareId`: on an endpoint with
        prefix-aware routing, requests with the same leading bytes and the same id go to
        the same instance, so applications that share prompt prefixes can keep apart."""
        transport = SageMakerTransport(
            endpoint_name,
            region=region,
            runtime_client=runtime_client,
            endpoint_url=endpoint_url,
            control_client=control_client,
            prefix_aware_id=prefix_aware_id,
        )
        return cls(transport, retry=retry)

    def invoke(self, body: Mapping[str, Any]) -> Any:
        """POST any body to /invocations (its state first, `state_first`) and return the
        parsed JSON answer, retrying busy answers under the policy; raises BusyError once
        the policy gives up."""
        return self._post(json.dumps(state_first(body), allow_nan=False).encode(), JSON)

    def invoke_lines(self, bodies: Sequence[Mapping[str, Any] | str]) -> list[dict[str, Any]]:
        """POST many bodies as one JSON Lines request; the answer has one object per body,
        in order: the body's answer, or its error with `status` (the endpoint merges
        bodies about one state into one batch). A body given as a string is sent as it is
        (one line of a file: the endpoint judges it), a mapping state first."""

        def line(body: Mapping[str, Any] | str) -> str:
            if isinstance(body, str):
                if "\n" in body:
                    raise ValueError("a JSON Lines body must not contain a newline")
                return body
            return json.dumps(state_first(body), allow_nan=False)

        payload = "".join(line(body) + "\n" for body in bodies).encode()
        answers: list[dict[str, Any]] = self._post(payload, JSON_LINES)
        if len(answers) != len(bodies):
            raise EndpointError(
                200, f"the endpoint answered {len(answers)} lines to {len(bodies)}", answers
            )
        return answers

    def _post(self, payload: bytes, content_type: str) -> Any:
        """Post under the retry policy, sending back the last refusal's retry token."""
        started = self._clock()
        attempts = 0
        token: str | None = None  # the place the last refusal gave, sent back with the retry
        while True:
            attempts += 1
            try:
                return self.transport.post(payload, token, content_type)
            except BusyError as error:
                token = error.retry_token
                elapsed = self._clock() - started
                hint = error.retry_after_s
                reason = self.retry.give_up_reason(attempts, elapsed, hint)
                if reason is not None:
                    tries = f"{attempts} attempt{'s' if attempts > 1 else ''}"
                    raise BusyError(
                        error.status,
                        f"gave up after {tries} over {elapsed:.1f} s ({reason}); "
                        f"last answer: {error.message}",
                        error.body,
                        retry_after_s=hint,
                        retry_token=token,
                    ) from error
                self._sleep(self.retry.delay_s(attempts - 1, elapsed, hint, self._rng.random()))

    def decide(self, decision: Mapping[str, Any], **reading: str) -> DecisionResult:
        """One decision: {"id", "state", "question", "options": [{"id", "description"}]}.
        `reading` passes the policy fields (readout="likelihood", normalization="mean",
        option_order=...); the endpoint's defaults apply to the rest."""
        answer = self.invoke({"decision": dict(decision), **reading})
        return DecisionResult.from_json(answer["result"])

    def decide_many(
        self, decisions: Sequence[Mapping[str, Any]], **reading: str
    ) -> list[DecisionResult]:
        """Decisions about one state, scored together (the state is evaluated once);
        `reading` as for `decide`."""
        answer = self.invoke({"decisions": [dict(decision) for decision in decisions], **reading})
        return [DecisionResult.from_json(result) for result in answer["results"]]

    def systemone(
        self,
        state: str | Mapping[str, Any] | Sequence[Any],
        questions: Mapping[str, Mapping[str, Any]],
        model: str = "default",
        **reading: str,
    ) -> SystemOneAnswers:
        """System One questions about one state (noul, choice, score); `reading` passes
        option_order, readout and normalization."""
        body = {"model": model, "state": state, "questions": questions, **reading}
        return SystemOneAnswers.from_json(self.invoke(body))

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        max_tokens: int | None = None,
        temperature: float = 0.0,
        **options: Any,
    ) -> ChatCompletion:
        """A chat completion by the endpoint's model (greedy unless a temperature is given);
        `options` passes other supported fields (top_p, seed, stop)."""
        body: dict[str, Any] = {
            "messages": [dict(m) for m in messages],
            "temperature": temperature,
            **options,
        }
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        return ChatCompletion.from_json(self.invoke(body))

    def batch_async(
        self,
        source: Path,
        *,
        input_prefix: str,
        out: Path,
        timeout_s: float = 3600.0,
        progress: Callable[[str], None] | None = None,
        s3_client: Any = None,
    ) -> Summary:
        """A JSON Lines file through this client's endpoint as an asynchronous one: upload
        to `input_prefix` (the stack's AsyncInputPrefix), InvokeEndpointAsync, wait, and
        write the answers to `out` (client.batch_aws.run_async)."""
        from client.batch_aws import aws_client, run_async

        transport = self.transport
        if not isinstance(transport, SageMakerTransport):
            raise ValueError("batch_async needs a SageMaker endpoint (DecisionClient.for_endpoint)")
        return run_async(
            transport.runtime_client,
            s3_client or aws_client("s3", transport.region),
            endpoint_name=transport.endpoint_name,
            source=source,
            input_prefix=input_prefix,
            out=out,
            timeout_s=timeout_s,
            progress=progress,
        )

    def wait_until_ready(
        self, timeout_s: float = 1800.0, progress: Callable[[str], None] | None = None
    ) -> dict[str, Any]:
        """Block until the endpoint can answer; returns what it said then (the /ping answer
        for a URL, DescribeEndpoint's for SageMaker)."""
        return self.transport.wait_until_ready(timeout_s, progress)

    def close(self) -> None:
        """Close the transport's connections (a URL client keeps them alive between calls)."""
        self.transport.close()

    def __enter__(self) -> DecisionClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
