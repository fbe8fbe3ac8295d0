"""A small client for application code: decisions, System One questions and chat.

One interface, two transports: a SageMaker endpoint through boto3's `sagemaker-runtime`
`invoke_endpoint`, or a local `serve` over HTTP. Everything goes through /invocations, so
the same calls work on both. A busy answer (a retryable 503, a 429, SageMaker throttling)
is retried: after the endpoint's own Retry-After when it gives one, else with capped
exponential backoff and full jitter, within a bounded number of attempts and a bounded total
time; other answers are never retried. A retry sends back the refusal's `retry_token`, the
caller's place in the endpoint's retry line, so it is served ahead of newcomers once its
turn comes. Errors keep the endpoint's message.

Answers can also be read as they are made (`stream_decide`, `stream_chat`: docs/client.md,
"Streaming"). A stream is retried only until its answer begins, under the same policy: once
the first piece has been handed over, a retry would hand it over again, so a break after it
is raised (`StreamError`), never retried.

Only boto3 (SageMaker) or httpx (local URL) is needed: this module never imports llama.cpp.

    client = DecisionClient.for_endpoint("semif-decision", region="us-east-1")
    result = client.decide({"id": "route", "state": "...", "question": "...",
                            "options": [{"id": "a", "description": "..."}, ...]})
    print(result.choice, result.probability("a"))

This module is the client itself (`DecisionClient`: the typed calls and the retry loop)
and its public face. Each other job sits in a module of its own below it, so that the
batch paths above (`client.batch_local`, `client.batch_aws`) and the client import one way
only, and each piece reads on its own: `client.transports` (one attempt over HTTP or
SageMaker), `client.retry` (the policy), `client.error_mapping` (an error answer or a
SageMaker ModelError -> exception), `client.answers` (2xx bodies -> typed results),
`client.wire` (content types, header names, `state_first`), `client.streams` (a streamed
answer's chunks -> lines -> typed items), `client.errors` (the exceptions) and
`client.async_endpoint` (a file through the asynchronous endpoint, for `batch_async`).
Their public names are importable from here as before (`__all__`).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from client.answers import (
    ChatCompletion,
    ChoiceAnswer,
    DecisionResult,
    MultiAnswer,
    NoulAnswer,
    ScoreAnswer,
    SystemOneAnswer,
    SystemOneAnswers,
)
from client.async_endpoint import run_async
from client.aws import aws_client
from client.error_mapping import RETRY_AFTER_FIELD, RETRY_TOKEN_FIELD, retry_token_of
from client.errors import (
    BusyError,
    EndpointError,
    ScaledToZeroError,
    StreamError,
    UnreachableError,
)
from client.retry import RetryPolicy, WakeUp, parse_retry_after
from client.streams import (
    ChatStream,
    ChatUsage,
    DecisionStream,
    DecisionStreamSummary,
    StreamedDecision,
)
from client.summary import Summary
from client.transports import (
    DEFAULT_TIMEOUT_S,
    HttpTransport,
    OpenStream,
    SageMakerTransport,
    StreamingTransport,
    Transport,
)
from client.wire import (
    CUSTOM_ATTRIBUTES_HEADER,
    EVENT_STREAM,
    JSON,
    JSON_LINES,
    PREFIX_AWARE_ID_HEADER,
    RETRY_TOKEN_ATTRIBUTE,
    check_prefix_aware_id,
    custom_attributes,
    state_first,
)

# The client's public names, as importable from this module before it was split.
__all__ = [
    "CUSTOM_ATTRIBUTES_HEADER",
    "DEFAULT_TIMEOUT_S",
    "JSON",
    "JSON_LINES",
    "PREFIX_AWARE_ID_HEADER",
    "RETRY_AFTER_FIELD",
    "RETRY_TOKEN_ATTRIBUTE",
    "RETRY_TOKEN_FIELD",
    "BusyError",
    "ChatCompletion",
    "ChatStream",
    "ChatUsage",
    "ChoiceAnswer",
    "DecisionClient",
    "DecisionResult",
    "DecisionStream",
    "DecisionStreamSummary",
    "EndpointError",
    "HttpTransport",
    "MultiAnswer",
    "NoulAnswer",
    "RetryPolicy",
    "SageMakerTransport",
    "ScaledToZeroError",
    "ScoreAnswer",
    "StreamError",
    "StreamedDecision",
    "SystemOneAnswer",
    "SystemOneAnswers",
    "Transport",
    "UnreachableError",
    "WakeUp",
    "check_prefix_aware_id",
    "custom_attributes",
    "parse_retry_after",
    "retry_token_of",
    "state_first",
]

T = TypeVar("T")


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
        wake_up: WakeUp | None = None,
        on_wait: Callable[[float], None] | None = None,
    ) -> None:
        self.transport = transport
        self.retry = retry or RetryPolicy()
        # An endpoint that scaled to zero (ScaledToZeroError): without a wake-up the call
        # fails at once; with one it waits up to its budget, `on_wait` hearing the seconds
        # waited before each sleep (the CLI's waiting line).
        self.wake_up = wake_up
        self._on_wait = on_wait
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
        inference_component: str | None = None,
        wake_up: WakeUp | None = None,
        on_wait: Callable[[float], None] | None = None,
    ) -> DecisionClient:
        """A SageMaker endpoint. `endpoint_url` sends the runtime calls elsewhere (e.g. a
        local serve) with the client's own boto3 settings; `runtime_client` reuses a boto3
        client configured by the caller, botocore retries included. `prefix_aware_id` (1-64
        printable characters) is InvokeEndpoint's `PrefixAwareId`: on an endpoint with
        prefix-aware routing, requests with the same leading bytes and the same id go to
        the same instance, so applications that share prompt prefixes can keep apart.
        `inference_component` (the stack's DecisionInferenceComponentName) calls an endpoint
        that can scale to zero through its component; `wake_up` lets a call wait for it to
        start a copy again instead of failing with ScaledToZeroError at once."""
        transport = SageMakerTransport(
            endpoint_name,
            region=region,
            runtime_client=runtime_client,
            endpoint_url=endpoint_url,
            control_client=control_client,
            prefix_aware_id=prefix_aware_id,
            inference_component=inference_component,
        )
        return cls(transport, retry=retry, wake_up=wake_up, on_wait=on_wait)

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
        """Post under the retry policy."""
        return self._retrying(lambda token: self.transport.post(payload, token, content_type))

    def _retrying(self, attempt: Callable[[str | None], T]) -> T:
        """Run `attempt` (given the last refusal's retry token) until it is not busy, under
        the retry policy."""
        started = self._clock()
        attempts = 0
        token: str | None = None  # the place the last refusal gave, sent back with the retry
        waking: float | None = None  # when the first call found no copy
        waits = 0
        while True:
            attempts += 1
            try:
                return attempt(token)
            except ScaledToZeroError as error:
                waking = self._clock() if waking is None else waking
                waited = self._clock() - waking
                delay = None if self.wake_up is None else self.wake_up.delay_s(waits, waited)
                if delay is None:
                    raise self._not_awake(error, waited) from error
                if self._on_wait is not None:
                    self._on_wait(waited)
                self._sleep(delay)
                waits += 1
                started, attempts = self._clock(), 0  # busy answers' budget: from the copy
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

    def _not_awake(self, error: ScaledToZeroError, waited: float) -> ScaledToZeroError:
        """What a call that found no copy raises: at once without a wake-up budget (saying
        how to wait), else once the budget is spent."""
        if self.wake_up is None:
            advice = "retry in a few minutes, or give the client a wake-up budget (WakeUp)"
            return ScaledToZeroError(error.status, f"{error.message}; {advice}", error.body)
        return ScaledToZeroError(
            error.status,
            f"still no copy after {waited:.0f} s (wake-up budget {self.wake_up.budget_s:g} s): "
            f"{error.message}",
            error.body,
        )

    def decide(self, decision: Mapping[str, Any], **reading: str | float) -> DecisionResult:
        """One decision: {"id", "state", "question", "options": [{"id", "description"}]}.
        `reading` passes the policy fields (readout="likelihood", normalization="mean",
        option_order=..., coverage=0.9 for a prediction set) and `audit_id`, the key the
        decision's audit record carries for joining labels later; the endpoint's defaults
        apply to the rest."""
        answer = self.invoke({"decision": dict(decision), **reading})
        return DecisionResult.from_json(answer["result"])

    def decide_many(
        self, decisions: Sequence[Mapping[str, Any]], **reading: str | float
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
        """System One questions about one state (noul, choice, score, multi); `reading`
        passes option_order, readout, normalization, coverage and audit_id."""
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
        return ChatCompletion.from_json(
            self.invoke(_chat_body(messages, max_tokens, temperature, options))
        )

    def stream_decide(
        self,
        decision_or_decisions: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        **reading: str | float,
    ) -> DecisionStream:
        """One decision (a mapping) or decisions about one state (a sequence), each answer
        handed over as soon as it is scored: `for item in client.stream_decide(...)` yields
        `StreamedDecision(index, result)` in the order they finish, and the stream's
        `summary` (model, timing, request id) is set once the iteration has ended.
        `reading` as for `decide`. Retried like `decide` until the answer begins, never
        after (module docstring)."""
        body: dict[str, Any] = dict(reading)
        if isinstance(decision_or_decisions, Mapping):
            asked, body["decision"] = 1, dict(decision_or_decisions)
        else:
            body["decisions"] = [dict(decision) for decision in decision_or_decisions]
            asked = len(body["decisions"])
        opened = self._open_stream(body, JSON_LINES)
        return DecisionStream(opened.chunks, opened.close, asked)

    def stream_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        max_tokens: int | None = None,
        temperature: float = 0.0,
        include_usage: bool = True,
        **options: Any,
    ) -> ChatStream:
        """`chat`, its text handed over as the model writes it: `for text in
        client.stream_chat(...)`; the stream's `finish_reason` and `usage` are set once
        the iteration has ended (`include_usage` asks for the usage)."""
        body = _chat_body(messages, max_tokens, temperature, options)
        return self.stream_chat_body(body, include_usage=include_usage)

    def stream_chat_body(
        self, body: Mapping[str, Any], *, include_usage: bool = True
    ) -> ChatStream:
        """Any chat completion body (`messages`, ...) streamed as it is written, as
        `stream_chat` does; the body is sent as given plus `"stream": true` (and
        `stream_options`), so a chat request file reads the same streamed or whole."""
        streamed = {**body, "stream": True}
        if include_usage:
            streamed["stream_options"] = {"include_usage": True}
        opened = self._open_stream(streamed, EVENT_STREAM)
        return ChatStream(opened.chunks, opened.close)

    def _open_stream(self, body: Mapping[str, Any], accept: str) -> OpenStream:
        """Open a streamed answer under the retry policy: a busy answer arrives before the
        stream begins and is retried like any other; once it has begun, nothing is."""
        transport = self.transport
        if not isinstance(transport, StreamingTransport):
            raise ValueError(f"{transport.describe()} cannot stream answers")
        payload = json.dumps(state_first(body), allow_nan=False).encode()
        return self._retrying(lambda token: transport.open_stream(payload, token, accept))

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
        write the answers to `out` (client.async_endpoint.run_async)."""
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


def _chat_body(
    messages: Sequence[Mapping[str, Any]],
    max_tokens: int | None,
    temperature: float,
    options: Mapping[str, Any],
) -> dict[str, Any]:
    """The chat completion body `chat` and `stream_chat` send."""
    body: dict[str, Any] = {
        "messages": [dict(m) for m in messages],
        "temperature": temperature,
        **options,
    }
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return body
