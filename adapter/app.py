"""The Starlette app: SageMaker's /ping and /invocations around the decision service.

Request handling order is deliberate: check the content type and read the body within
its limit, validate it, and only then take an admission slot, so a slow or invalid client
never holds capacity. Model work runs in a worker thread; the event loop stays free to
answer /ping and to turn excess requests away with a retryable 503.

/invocations picks the API by the body's distinguishing field: `questions` (System One),
`messages` (chat completion), else the decision API. The same APIs answer on their own
paths for local use (`/v1/systemone`, `/v1/chat/completions`, `/v1/models`, guarded by
SEMIF_API_KEY when set), and `/endpoints/<name>/invocations` mimics the SageMaker runtime,
so boto3's `invoke_endpoint` with `endpoint_url` runs unchanged against a local server.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio.to_thread
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from adapter import chat, systemone
from adapter.engine import CapacityError
from adapter.runtime import Runtime
from adapter.schema import RequestError, parse_decision_request
from adapter.settings import Settings

LOG = logging.getLogger("adapter.requests")
RETRY_AFTER_SECONDS = 1
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class ApiError(Exception):
    """An error answer with a status and a JSON body."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": message, **extra}


def json_response(status: int, body: dict[str, Any], **headers: str) -> Response:
    """Serialise strictly: NaN or Infinity must never reach a client as invalid JSON."""
    content = json.dumps(body, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    return Response(content, status_code=status, media_type="application/json", headers=headers)


async def read_json_body(request: Request, max_bytes: int) -> Any:
    """Read and parse a JSON body, enforcing content type and size before parsing."""
    content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type != "application/json" and not content_type.endswith("+json"):
        raise ApiError(415, f"content type {content_type or 'missing'!r}: send application/json")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(
            413, f"body is {declared} bytes; the limit is {max_bytes} (SEMIF_MAX_BODY_BYTES)"
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(413, f"body exceeds {max_bytes} bytes (SEMIF_MAX_BODY_BYTES)")
        chunks.append(chunk)
    try:
        return json.loads(
            b"".join(chunks), parse_constant=_reject_constant, object_pairs_hook=_unique_keys
        )
    except (ValueError, UnicodeDecodeError) as error:
        raise ApiError(400, f"body: invalid JSON ({error})") from None
    except RecursionError:
        raise ApiError(400, "body: invalid JSON (nested too deeply)") from None


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """Refuse duplicate object keys: JSON parsers disagree on which one wins, and a
    duplicated option or question would otherwise vanish silently."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {json.dumps(key)}")
        result[key] = value
    return result


def _request_id(request: Request) -> str:
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.match(given) else uuid.uuid4().hex


Handler = Callable[[Runtime, Any, str], Awaitable[tuple[dict[str, Any], dict[str, Any]]]]


async def decide(
    runtime: Runtime, body: Any, request_id: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The decision API: validate, admit, score in a worker thread, shape the response."""
    mode, decisions = parse_decision_request(body, runtime.settings.max_shared_decisions)
    async with admission(runtime):
        service = runtime.service
        assert service is not None  # admission only passes when ready
        scored = await anyio.to_thread.run_sync(service.decide, decisions, mode)
    results = scored["results"]
    response: dict[str, Any] = {"result": results[0]} if mode == "single" else {"results": results}
    response.update(model=service.model, timing=scored["timing"], request_id=request_id)
    log = {
        "mode": mode,
        "decisions": len(decisions),
        "input_tokens": sum(result["input_tokens"] for result in results),
        "evaluated_tokens": scored["timing"]["evaluated_tokens"],
        "reused_tokens": scored["timing"]["reused_tokens"],
    }
    return response, log


async def answer_systemone(
    runtime: Runtime, body: Any, request_id: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """System One: every question about the state in one batched pass, format-exact answer."""
    try:
        request = systemone.parse_systemone(body, runtime.settings.max_shared_decisions)
        async with admission(runtime):
            service = runtime.service
            assert service is not None
            response, batch = await anyio.to_thread.run_sync(systemone.answer, service, request)
    except RequestError as error:
        status = 422 if isinstance(error, systemone.SchemaError) else 400
        raise ApiError(status, str(error), field=error.path) from None
    timing = batch.timing_json()
    log = {
        "mode": "systemone",
        "decisions": len(request.questions),
        "input_tokens": response["usage"]["input_tokens"],
        "evaluated_tokens": timing["evaluated_tokens"],
        "reused_tokens": timing["reused_tokens"],
    }
    return response, log


async def complete_chat(
    runtime: Runtime, body: Any, request_id: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Chat completion by the loaded model, under the same admission control."""
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    settings = runtime.settings
    # load_settings keeps the chat limit within SEMIF_MAX_TOKENS; Settings built directly may not.
    request = chat.parse_chat_request(body, min(settings.max_chat_tokens, settings.max_tokens))
    async with admission(runtime):
        service = runtime.service
        assert service is not None
        generation = await anyio.to_thread.run_sync(chat.generate, service, request)
    response = chat.completion(
        generation, systemone.served_model_id(service), f"chatcmpl-{request_id}"
    )
    log = {
        "mode": "chat",
        "input_tokens": generation.prompt_tokens,
        "reused_tokens": generation.reused_tokens,
        "output_tokens": generation.completion_tokens,
        "finish_reason": generation.finish_reason,
    }
    return response, log


@asynccontextmanager
async def admission(runtime: Runtime) -> AsyncIterator[None]:
    """Take one of SEMIF_MAX_IN_FLIGHT slots or refuse at once with a retryable 503."""
    if not runtime.healthy:
        message = "model is loading" if runtime.state == "loading" else "model is not healthy"
        raise ApiError(503, message, retryable=runtime.state == "loading")
    if runtime.in_flight >= runtime.settings.max_in_flight:
        raise ApiError(503, "busy: all scoring slots are in use", retryable=True)
    runtime.in_flight += 1
    try:
        yield
    finally:
        runtime.in_flight -= 1


def select_handler(body: Any, handlers: dict[str, Handler]) -> Handler:
    """Pick the API by the body's distinguishing field (decision API by default)."""
    if isinstance(body, dict):
        for key, handler in handlers.items():
            if key in body:
                return handler
    return decide


def create_app(
    settings: Settings,
    *,
    extra_handlers: dict[str, Handler] | None = None,
    on_load_failure: Callable[[str], None] | None = None,
) -> Starlette:
    """Build the app; the lifespan loads the model in a worker thread and frees it at exit."""
    runtime = Runtime(settings)
    handlers: dict[str, Handler] = {
        "questions": answer_systemone,
        "messages": complete_chat,
        **(extra_handlers or {}),
    }

    async def ping(request: Request) -> Response:
        if runtime.healthy:
            service = runtime.service
            assert service is not None
            return json_response(
                200,
                {
                    "status": "ok",
                    "model": service.model.get("file"),
                    "backends": service.model.get("backends"),
                },
            )
        error = runtime.error or (runtime.service.health.error if runtime.service else None)
        status = runtime.state if runtime.state != "ready" else "unhealthy"
        return json_response(503, {"status": status, "error": error})

    async def handle(
        request: Request, choose: Callable[[Any], Handler], *, authenticate: bool = False
    ) -> Response:
        """Run one API call: errors become JSON answers, every call is logged once."""
        request_id = _request_id(request)
        started = time.perf_counter()
        log: dict[str, Any] = {"request_id": request_id, "path": request.url.path}
        headers = {"x-request-id": request_id}
        try:
            if authenticate:
                _authenticate(request, settings.api_key)
            body = await read_json_body(request, settings.max_body_bytes)
            payload, details = await choose(body)(runtime, body, request_id)
            log.update(details)
            response = json_response(200, payload, **headers)
        except RequestError as error:
            response = json_response(
                400, {"error": str(error), "request_id": request_id}, **headers
            )
        except ApiError as error:
            if error.status == 503 and error.body.get("retryable"):
                headers["retry-after"] = str(RETRY_AFTER_SECONDS)
            if error.status == 401:
                headers["www-authenticate"] = "Bearer"
            response = json_response(
                error.status, {**error.body, "request_id": request_id}, **headers
            )
        except CapacityError as error:
            response = json_response(
                503,
                {"error": str(error), "retryable": True, "request_id": request_id},
                **headers,
                **{"retry-after": str(RETRY_AFTER_SECONDS)},
            )
        except Exception:
            LOG.exception("scoring failed (request_id=%s)", request_id)
            response = json_response(
                500, {"error": "scoring failed", "request_id": request_id}, **headers
            )
        log.update(status=response.status_code, seconds=round(time.perf_counter() - started, 6))
        LOG.info(json.dumps(log, default=str, allow_nan=True))
        return response

    async def invocations(request: Request) -> Response:
        return await handle(request, lambda body: select_handler(body, handlers))

    async def sagemaker_runtime(request: Request) -> Response:
        return _as_sagemaker_runtime(await invocations(request))

    async def systemone_route(request: Request) -> Response:
        return await handle(request, lambda body: answer_systemone, authenticate=True)

    async def chat_route(request: Request) -> Response:
        return await handle(request, lambda body: complete_chat, authenticate=True)

    async def models(request: Request) -> Response:
        try:
            _authenticate(request, settings.api_key)
        except ApiError as error:
            return json_response(401, error.body, **{"www-authenticate": "Bearer"})
        service = runtime.service
        if service is None:
            return json_response(503, {"error": "model is loading", "retryable": True})
        model = {"id": systemone.served_model_id(service), "object": "model", "owned_by": "semif"}
        return json_response(200, {"object": "list", "data": [model]})

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async def load() -> None:
            try:
                await anyio.to_thread.run_sync(runtime.load)
            except Exception:
                if on_load_failure is not None:
                    on_load_failure(runtime.error or "model load failed")

        task = asyncio.create_task(load())
        try:
            yield
        finally:
            await task
            runtime.close()

    async def http_error(request: Request, error: Exception) -> Response:
        assert isinstance(error, HTTPException)
        return json_response(
            error.status_code, {"error": error.detail}, **dict(error.headers or {})
        )

    app = Starlette(
        routes=[
            Route("/ping", ping, methods=["GET"]),
            Route("/invocations", invocations, methods=["POST"]),
            Route("/endpoints/{name}/invocations", sagemaker_runtime, methods=["POST"]),
            Route("/v1/systemone", systemone_route, methods=["POST"]),
            Route("/v1/chat/completions", chat_route, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
        ],
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error},
    )
    app.state.runtime = runtime
    return app


def _authenticate(request: Request, api_key: str | None) -> None:
    """With SEMIF_API_KEY set, the /v1 routes need `Authorization: Bearer <key>`."""
    if api_key is None:
        return
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        given.strip().encode(), api_key.encode()
    ):
        raise ApiError(401, "missing or wrong API key: send Authorization: Bearer <SEMIF_API_KEY>")


def _as_sagemaker_runtime(response: Response) -> Response:
    """Answer as SageMaker's InvokeEndpoint does: the container's 2xx body as is, any other
    answer wrapped in a 424 ModelError carrying the original status and body."""
    if response.status_code < 300:
        response.headers["x-amzn-invoked-production-variant"] = "AllTraffic"
        return response
    original = bytes(response.body).decode("utf-8", errors="replace")
    side = "client" if response.status_code < 500 else "server"
    body = {
        "ErrorCode": f"{side.upper()}_ERROR_FROM_MODEL",
        "Message": (
            f"Received {side} error ({response.status_code}) from primary with message "
            f'"{original}".'
        ),
        "OriginalMessage": original,
        "OriginalStatusCode": response.status_code,
        "LogStreamArn": "local",
    }
    return json_response(
        424,
        body,
        **{"x-amzn-errortype": "ModelError:http://internal.amazon.com/coral/com.amazon.sagemaker/"},
    )
