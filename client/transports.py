"""How a body reaches /invocations: over HTTP to a `serve` (httpx), or through boto3's
`sagemaker-runtime` `invoke_endpoint` to a SageMaker endpoint, and how each waits until
its endpoint is ready.

A transport makes one attempt and raises what the answer means (`client.error_mapping`);
retrying is the client's (`DecisionClient` under `client.retry.RetryPolicy`), so the
transports hold no policy and the policy no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import httpx

from client.answers import parse_answer
from client.error_mapping import error_from_answer, error_from_client_error
from client.errors import EndpointError, UnreachableError
from client.wire import (
    CUSTOM_ATTRIBUTES_HEADER,
    JSON,
    PREFIX_AWARE_ID_HEADER,
    check_prefix_aware_id,
    custom_attributes,
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
            raise error_from_answer(
                response.status_code, response.text, response.headers.get("retry-after")
            )
        return parse_answer(response.content, content_type)

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
            raise error_from_client_error(error.response) from None
        except BotoCoreError as error:
            raise UnreachableError(0, f"cannot reach {self.describe()}: {error}") from None
        return parse_answer(answer["Body"].read(), content_type)

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
