"""The Starlette app: SageMaker's /ping and /invocations around the decision service.

Request handling order is deliberate: check the content type and read the body within
its limit, validate it, and only then take an admission slot, so a slow or invalid client
never holds capacity. Model work runs in a worker thread; the event loop stays free to
answer /ping and to turn excess requests away with a retryable 503.
"""

from __future__ import annotations

import asyncio
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
        return json.loads(b"".join(chunks), parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as error:
        raise ApiError(400, f"body: invalid JSON ({error})") from None


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _request_id(request: Request) -> str:
    given = request.headers.get("x-request-id", "")
    return given if _REQUEST_ID.match(given) else uuid.uuid4().hex


Handler = Callable[[Runtime, Any], Awaitable[tuple[dict[str, Any], dict[str, Any]]]]


async def decide(runtime: Runtime, body: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The decision API: validate, admit, score in a worker thread, shape the response."""
    mode, decisions = parse_decision_request(body, runtime.settings.max_shared_decisions)
    async with admission(runtime):
        service = runtime.service
        assert service is not None  # admission only passes when ready
        scored = await anyio.to_thread.run_sync(service.decide, decisions, mode)
    results = scored["results"]
    response: dict[str, Any] = {"result": results[0]} if mode == "single" else {"results": results}
    response.update(model=service.model, timing=scored["timing"])
    log = {
        "mode": mode,
        "decisions": len(decisions),
        "input_tokens": sum(result["input_tokens"] for result in results),
        "evaluated_tokens": scored["timing"]["evaluated_tokens"],
        "reused_tokens": scored["timing"]["reused_tokens"],
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
    handlers = dict(extra_handlers or {})

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

    async def invocations(request: Request) -> Response:
        request_id = _request_id(request)
        started = time.perf_counter()
        log: dict[str, Any] = {"request_id": request_id, "path": request.url.path}
        try:
            body = await read_json_body(request, settings.max_body_bytes)
            handler = select_handler(body, handlers)
            payload, details = await handler(runtime, body)
            log.update(details)
            payload["request_id"] = request_id
            response = json_response(200, payload, **{"x-request-id": request_id})
        except RequestError as error:
            response = _error(400, str(error), request_id)
        except ApiError as error:
            headers = {"x-request-id": request_id}
            if error.status == 503 and error.body.get("retryable"):
                headers["retry-after"] = str(RETRY_AFTER_SECONDS)
            response = json_response(
                error.status, {**error.body, "request_id": request_id}, **headers
            )
        except CapacityError as error:
            response = json_response(
                503,
                {"error": str(error), "retryable": True, "request_id": request_id},
                **{"x-request-id": request_id, "retry-after": str(RETRY_AFTER_SECONDS)},
            )
        except Exception:
            LOG.exception("scoring failed (request_id=%s)", request_id)
            response = _error(500, "scoring failed", request_id)
        log.update(status=response.status_code, seconds=round(time.perf_counter() - started, 6))
        LOG.info(json.dumps(log, default=str, allow_nan=True))
        return response

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
        ],
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error},
    )
    app.state.runtime = runtime
    return app


def _error(status: int, message: str, request_id: str) -> Response:
    return json_response(
        status, {"error": message, "request_id": request_id}, **{"x-request-id": request_id}
    )
