"""How a body reaches /invocations: over HTTP to a `serve` (httpx), or through boto3's
`sagemaker-runtime` `invoke_endpoint` to a SageMaker endpoint, and how each waits until
its endpoint is ready.

A transport makes one attempt and raises what the answer means (`client.error_mapping`);
retrying is the client's (`DecisionClient` under `client.retry.RetryPolicy`), so the
transports hold no policy and the policy no I/O.

A streamed answer (`StreamingTransport.open_stream`) is opened in one attempt too: the
call returns once the answer's head said 2xx (the endpoint sends its head with the first
piece of the answer), with the body's chunks still to come (`OpenStream`); an error answer
raises before, like `post`'s, and may be retried. Over a URL the chunks are httpx's reads;
through InvokeEndpointWithResponseStream they are the `PayloadPart`s of botocore's event
stream, and its `ModelStreamError` and `InternalStreamFailure` events are raised as
`StreamError`s naming them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import httpx

from client.answers import parse_answer
from client.error_mapping import error_from_answer, error_from_client_error
from client.errors import EndpointError, StreamError, UnreachableError
from client.wire import (
    CUSTOM_ATTRIBUTES_HEADER,
    JSON,
    PREFIX_AWARE_ID_HEADER,
    check_prefix_aware_id,
    custom_attributes,
    media_type,
)

DEFAULT_TIMEOUT_S = 120.0
_ENDPOINT_DONE = ("InService", "Failed", "OutOfService", "Deleting")


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


@dataclass(frozen=True)
class OpenStream:
    """A streamed answer whose head said 2xx: its body's chunks as they arrive (cut
    anywhere; `client.streams` reassembles them), and how to let go of the connection
    before the end. A break part-way is raised from `chunks` as a `StreamError`."""

    chunks: Iterator[bytes]
    close: Callable[[], None]


@runtime_checkable
class StreamingTransport(Protocol):
    """A transport that can also read an answer as it is written (both of the client's
    own do; a `Transport` need not)."""

    def open_stream(self, body: bytes, retry_token: str | None, accept: str) -> OpenStream: ...


def _streamed(answered: str | None, accept: str, where: str) -> None:
    """Refuse an answer that is not the stream asked for (an endpoint that does not
    stream this request answers it whole), before reading it as one."""
    if answered is not None and media_type(answered) != media_type(accept):
        raise EndpointError(
            200,
            f"{where} answered {media_type(answered)}, not the {accept} stream asked for",
            answered,
        )


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
        response = self._send(body, retry_token, {"content-type": content_type}, stream=False)
        return parse_answer(response.content, content_type)

    def open_stream(self, body: bytes, retry_token: str | None, accept: str) -> OpenStream:
        headers = {"content-type": JSON, "accept": accept}
        response = self._send(body, retry_token, headers, stream=True)
        try:
            _streamed(response.headers.get("content-type"), accept, self.base_url)
        except EndpointError:
            response.close()
            raise
        return OpenStream(_http_chunks(response), response.close)

    def _send(
        self, body: bytes, retry_token: str | None, headers: dict[str, str], *, stream: bool
    ) -> httpx.Response:
        """POST /invocations; a 2xx answer's response (its body unread when `stream`),
        else the error it means."""
        if retry_token is not None:
            headers[CUSTOM_ATTRIBUTES_HEADER] = custom_attributes(retry_token)
        request = self._http.build_request("POST", "/invocations", content=body, headers=headers)
        try:
            response = self._http.send(request, stream=stream)
            if response.status_code >= 300:
                response.read()  # an error answer is small, and read whole
        except httpx.HTTPError as error:
            raise UnreachableError(0, f"cannot reach {self.base_url}: {error}") from None
        if response.status_code >= 300:
            response.close()
            raise error_from_answer(
                response.status_code, response.text, response.headers.get("retry-after")
            )
        return response

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


def _http_chunks(response: httpx.Response) -> Iterator[bytes]:
    """The body as it arrives; a connection lost part-way (the server's chunked body cut
    off, a read timeout) is a `StreamError`."""
    try:
        yield from response.iter_bytes()
    except httpx.HTTPError as error:
        raise StreamError("StreamBroken", f"the connection broke part-way: {error}") from None
    finally:
        response.close()


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
        inference_component: str | None = None,
    ) -> None:
        if runtime_client is not None and endpoint_url is not None:
            raise ValueError("pass runtime_client or endpoint_url, not both")
        self.endpoint_name = endpoint_name
        # An endpoint that hosts its model as an inference component (one that can scale
        # to zero) is called through it: InvokeEndpoint's InferenceComponentName.
        self.inference_component = inference_component
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
        through = f" (inference component {self.inference_component})"
        return f"SageMaker endpoint {self.endpoint_name}" + (
            through if self.inference_component else ""
        )

    def close(self) -> None:
        """boto3 clients hold no resources that need closing."""

    def post(self, body: bytes, retry_token: str | None = None, content_type: str = JSON) -> Any:
        answer = self._invoke(
            self._runtime.invoke_endpoint, body, retry_token, content_type, content_type
        )
        return parse_answer(answer["Body"].read(), content_type)

    def open_stream(self, body: bytes, retry_token: str | None, accept: str) -> OpenStream:
        """InvokeEndpointWithResponseStream: its `Accept` reaches the container as the
        Accept header, and the container's content type comes back as `ContentType`."""
        invoke = self._runtime.invoke_endpoint_with_response_stream
        answer = self._invoke(invoke, body, retry_token, JSON, accept)
        events = answer["Body"]
        try:
            _streamed(answer.get("ContentType"), accept, self.describe())
        except EndpointError:
            events.close()
            raise
        return OpenStream(_payload_parts(events), events.close)

    def _invoke(
        self,
        invoke: Callable[..., dict[str, Any]],
        body: bytes,
        retry_token: str | None,
        content_type: str,
        accept: str,
    ) -> dict[str, Any]:
        """One runtime call with the routing and the retry token; an error (before any
        answer byte, for a stream) raised as what it means."""
        from botocore.exceptions import BotoCoreError, ClientError

        extra = {} if retry_token is None else {"CustomAttributes": custom_attributes(retry_token)}
        if self.prefix_aware_id is not None:
            extra["PrefixAwareId"] = self.prefix_aware_id
        if self.inference_component is not None:
            extra["InferenceComponentName"] = self.inference_component
        try:
            return invoke(
                EndpointName=self.endpoint_name,
                ContentType=content_type,
                Accept=accept,
                Body=body,
                **extra,
            )
        except ClientError as error:
            raise error_from_client_error(error.response) from None
        except BotoCoreError as error:
            raise UnreachableError(0, f"cannot reach {self.describe()}: {error}") from None

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


def _payload_parts(events: Any) -> Iterator[bytes]:
    """The bytes of each `PayloadPart` of botocore's event stream, in order. SageMaker ends
    a broken stream with a `ModelStreamError` (the model took too long, or its connection
    broke) or an `InternalStreamFailure` event, which botocore raises as an
    EventStreamError named after it; a connection lost part-way, or a frame that fails its
    checksum, surfaces from urllib3 or from botocore's frame parser. Each is a
    `StreamError` saying what happened."""
    from botocore.eventstream import ParserError
    from botocore.exceptions import BotoCoreError, EventStreamError
    from urllib3.exceptions import HTTPError

    try:
        for event in events:
            part = event.get("PayloadPart")
            if part is not None and part.get("Bytes"):
                yield part["Bytes"]
    except EventStreamError as error:
        raised = error.response.get("Error", {})
        code = str(raised.get("Code") or "EventStreamError")
        raise StreamError(code, raised.get("Message") or "no message") from None
    except (BotoCoreError, HTTPError, ParserError) as error:
        raise StreamError("StreamBroken", f"the event stream broke part-way: {error}") from None
    finally:
        events.close()


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
