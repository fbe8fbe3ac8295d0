"""A small client for application code: decisions, System One questions and chat.

One interface, two transports: a SageMaker endpoint through boto3's `sagemaker-runtime`
`invoke_endpoint`, or a local `serve` over HTTP. Everything goes through /invocations, so
the same calls work on both. A busy answer (503, SageMaker throttling) is retried with
capped exponential backoff and full jitter, within a bounded number of attempts and a
bounded total time; 4xx answers are never retried. Errors keep the endpoint's message.

Only boto3 (SageMaker) or httpx (local URL) is needed: this module never imports llama.cpp.

    client = DecisionClient.for_endpoint("semif-decision", region="us-east-1")
    result = client.decide({"id": "route", "state": "...", "question": "...",
                            "options": [{"id": "a", "description": "..."}, ...]})
    print(result.choice, result.probability("a"))
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

DEFAULT_TIMEOUT_S = 120.0
_BUSY_AWS_ERRORS = ("ThrottlingException", "ServiceUnavailable", "ModelNotReadyException")
_ENDPOINT_DONE = ("InService", "Failed", "OutOfService", "Deleting")


class EndpointError(Exception):
    """The endpoint answered with an error; `message` is its own explanation."""

    def __init__(self, status: int, message: str, body: Any = None) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.body = body


class BusyError(EndpointError):
    """The endpoint stayed busy (503) through every retry the policy allowed."""


class UnreachableError(EndpointError):
    """No HTTP answer at all (connection refused, timeout); status is 0."""


@dataclass(frozen=True)
class RetryPolicy:
    """Capped exponential backoff with full jitter, bounded in attempts and total time.

    Before retry n (0-based) the client sleeps uniform(0, min(max_delay_s, base_delay_s *
    2**n)) seconds, unless that sleep would pass `max_total_s` since the first attempt.
    """

    max_attempts: int = 6
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0
    max_total_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or min(self.base_delay_s, self.max_delay_s) < 0:
            raise ValueError("max_attempts must be >= 1 and delays >= 0")

    def backoff_s(self, retry: int, unit: float) -> float:
        """The sleep before retry `retry`, for a uniform draw `unit` in [0, 1)."""
        return unit * min(self.max_delay_s, self.base_delay_s * 2.0**retry)


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

    @classmethod
    def from_json(cls, result: Mapping[str, Any]) -> DecisionResult:
        return cls(
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
    """Posts one JSON body to /invocations; returns the parsed 2xx answer or raises."""

    def post(self, body: bytes) -> Any: ...

    def wait_until_ready(
        self, timeout_s: float, progress: Callable[[str], None] | None = None
    ) -> dict[str, Any]: ...

    def describe(self) -> str: ...

    def close(self) -> None: ...


def _error_from_answer(status: int, text: str) -> EndpointError:
    """Keep the endpoint's own message: the `error` field of a JSON body, else the text."""
    try:
        body: Any = json.loads(text)
    except ValueError:
        body = text
    message = body.get("error") if isinstance(body, dict) else None
    message = message if isinstance(message, str) else text.strip() or f"HTTP {status}"
    retryable = status == 503 and not (isinstance(body, dict) and body.get("retryable") is False)
    error_type = BusyError if retryable else EndpointError
    return error_type(status, message, body)


def _parse_answer(text: str | bytes) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise EndpointError(200, "the endpoint answered with invalid JSON", text) from None


class HttpTransport:
    """A local (or any HTTP) `serve`: POST {base_url}/invocations."""

    def __init__(
        self, base_url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S, api_key: str | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # A local serve started with SEMIF_API_KEY guards every route but /ping.
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers)

    def describe(self) -> str:
        return self.base_url

    def post(self, body: bytes) -> Any:
        try:
            response = self._http.post(
                "/invocations", content=body, headers={"content-type": "application/json"}
            )
        except httpx.HTTPError as error:
            raise UnreachableError(0, f"cannot reach {self.base_url}: {error}") from None
        if response.status_code >= 300:
            raise _error_from_answer(response.status_code, response.text)
        return _parse_answer(response.content)

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
    status and body; it is mapped back to that status and message. botocore's own retries
    are the caller's to configure; the client created here has them off, so the retry
    policy alone decides.
    """

    def __init__(
        self,
        endpoint_name: str,
        *,
        region: str | None = None,
        runtime_client: Any = None,
        control_client: Any = None,
        poll_s: float = 15.0,
    ) -> None:
        self.endpoint_name = endpoint_name
        self.region = region
        self.poll_s = poll_s  # DescribeEndpoint interval while waiting
        self._runtime = runtime_client or _boto3_client("sagemaker-runtime", region)
        self._control = control_client

    def describe(self) -> str:
        return f"SageMaker endpoint {self.endpoint_name}"

    def close(self) -> None:
        """boto3 clients hold no resources that need closing."""

    def post(self, body: bytes) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            answer = self._runtime.invoke_endpoint(
                EndpointName=self.endpoint_name,
                ContentType="application/json",
                Accept="application/json",
                Body=body,
            )
        except ClientError as error:
            raise _error_from_client_error(error.response) from None
        except BotoCoreError as error:
            raise UnreachableError(0, f"cannot reach {self.describe()}: {error}") from None
        return _parse_answer(answer["Body"].read())

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


def _boto3_client(service: str, region: str | None) -> Any:
    import boto3
    from botocore.config import Config

    config = Config(retries={"max_attempts": 1, "mode": "standard"}, read_timeout=70)
    return boto3.client(service, region_name=region, config=config)


def _error_from_client_error(response: Mapping[str, Any]) -> EndpointError:
    """ModelError -> the container's own status and message; throttling -> busy."""
    code = response.get("Error", {}).get("Code", "")
    message = response.get("Error", {}).get("Message", "")
    if code == "ModelError" and "OriginalStatusCode" in response:
        return _error_from_answer(
            int(response["OriginalStatusCode"]), str(response.get("OriginalMessage", message))
        )
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
    if code in _BUSY_AWS_ERRORS:
        return BusyError(503, f"{code}: {message}", dict(response))
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
    ) -> None:
        self.transport = transport
        self.retry = retry or RetryPolicy()
        self._sleep = sleep
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not security

    @classmethod
    def for_url(
        cls,
        base_url: str,
        *,
        retry: RetryPolicy | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,
    ) -> DecisionClient:
        """A local or self-hosted `serve`, e.g. http://127.0.0.1:8080; `api_key` is the
        server's SEMIF_API_KEY, sent as a bearer token."""
        return cls(HttpTransport(base_url, timeout_s=timeout_s, api_key=api_key), retry=retry)

    @classmethod
    def for_endpoint(
        cls,
        endpoint_name: str,
        *,
        region: str | None = None,
        runtime_client: Any = None,
        retry: RetryPolicy | None = None,
        control_client: Any = None,
    ) -> DecisionClient:
        """A SageMaker endpoint; pass `runtime_client` to reuse a configured boto3 client
        (for example one with `endpoint_url` pointing at a local server)."""
        transport = SageMakerTransport(
            endpoint_name,
            region=region,
            runtime_client=runtime_client,
            control_client=control_client,
        )
        return cls(transport, retry=retry)

    def invoke(self, body: Mapping[str, Any]) -> Any:
        """POST any body to /invocations and return the parsed JSON answer, retrying busy
        answers under the policy; raises BusyError once the policy gives up."""
        payload = json.dumps(body, allow_nan=False).encode()
        started = time.monotonic()
        for attempt in range(self.retry.max_attempts):
            try:
                return self.transport.post(payload)
            except BusyError as error:
                delay = self.retry.backoff_s(attempt, self._rng.random())
                elapsed = time.monotonic() - started
                last_attempt = attempt + 1 >= self.retry.max_attempts
                if last_attempt or elapsed + delay > self.retry.max_total_s:
                    raise BusyError(
                        error.status,
                        f"{error.message} (gave up after {attempt + 1} attempt(s) in "
                        f"{elapsed:.1f} s)",
                        error.body,
                    ) from error
                self._sleep(delay)
        raise AssertionError("unreachable: the loop returns or raises")

    def decide(self, decision: Mapping[str, Any]) -> DecisionResult:
        """One decision: {"id", "state", "question", "options": [{"id", "description"}]}."""
        answer = self.invoke({"decision": dict(decision)})
        return DecisionResult.from_json(answer["result"])

    def decide_many(self, decisions: Sequence[Mapping[str, Any]]) -> list[DecisionResult]:
        """Decisions about one state, scored together (the state is evaluated once)."""
        answer = self.invoke({"decisions": [dict(decision) for decision in decisions]})
        return [DecisionResult.from_json(result) for result in answer["results"]]

    def systemone(
        self,
        state: str | Mapping[str, Any] | Sequence[Any],
        questions: Mapping[str, Mapping[str, Any]],
        model: str = "default",
    ) -> SystemOneAnswers:
        """System One questions about one state (noul, choice, score)."""
        body = {"model": model, "state": state, "questions": questions}
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
