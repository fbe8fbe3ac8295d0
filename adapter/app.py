"""The Starlette app: SageMaker's /ping and /invocations, and the same APIs on their own paths.

/invocations picks the API by the body's distinguishing field: `questions` (System One),
`messages` (chat completion), else the decision API; a JSON Lines body (adapter.lines)
holds one such request per line. `/execution-parameters` tells SageMaker batch transform
how to send those. The same APIs answer on their own
paths for local use (`/v1/systemone`, `/v1/chat/completions`, `/v1/models`, guarded by
SEMIF_API_KEY when set), and `/endpoints/<name>/invocations` mimics the SageMaker runtime,
so boto3's `invoke_endpoint` with `endpoint_url` runs unchanged against a local server.
Outside SageMaker a key guards those two as well (`Settings.guard_invocations`); inside,
SageMaker's IAM does. /ping is never guarded. Paths match exactly (no slash redirects).
The lifespan owns the model: it loads it in a worker thread, stops admission and cancels
in-flight work at shutdown, and frees it at exit.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import anyio.to_thread
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from adapter import handlers, lines
from adapter.apis import Api, select_api
from adapter.errors import ApiError, UnavailableError
from adapter.http import (
    Call,
    accepts_lines,
    answer,
    as_response_stream,
    as_sagemaker_runtime,
    authenticate,
    content_type_of,
    error_response,
    json_response,
)
from adapter.runtime import Runtime
from adapter.settings import Settings


def create_app(
    settings: Settings, *, on_load_failure: Callable[[str], None] | None = None
) -> Starlette:
    """Build the app; `on_load_failure` hears a failed model load (serve exits on it)."""
    runtime = Runtime(settings)

    def call_of(api: Api) -> tuple[str, Call]:
        return api, partial(handlers.BY_API[api], runtime)

    def by_field(body: Any) -> tuple[str, Call]:
        return call_of(select_api(body))

    async def ping(request: Request) -> Response:
        if runtime.healthy and runtime.service is not None:
            model = runtime.service.model
            return json_response(
                200,
                {
                    "status": "ok",
                    "model": model.get("file"),
                    "backends": model.get("backends"),
                    "chat_template": model.get("chat_template"),  # which one renders prompts
                    "serving": model.get("serving"),  # the KV cache's real size among them
                },
            )
        if runtime.stopping:
            return json_response(503, {"status": "stopping", "error": "server is shutting down"})
        error = runtime.error or (runtime.service.health.error if runtime.service else None)
        status = runtime.state if runtime.state != "ready" else "unhealthy"
        return json_response(503, {"status": status, "error": error})

    invocations_key = settings.api_key if settings.guard_invocations else None

    def streamed_by_field(body: Any) -> tuple[str, Call]:
        """A decision body asked as a stream (adapter.handlers.decide_streamed); any other
        body as it would be answered anyway."""
        api = select_api(body)
        if api == "decision":
            return api, partial(handlers.decide_streamed, runtime)
        return call_of(api)

    async def invocations(request: Request) -> Response:
        if content_type_of(request) in lines.MEDIA_TYPES:
            return await lines.answer_lines(request, runtime, api_key=invocations_key)
        return await answer(
            request,
            streamed_by_field if accepts_lines(request) else by_field,
            max_body_bytes=settings.max_body_bytes,
            api_key=invocations_key,
            body_timeout_seconds=settings.body_timeout_seconds,
            metrics=runtime.metrics,
        )

    async def sagemaker_runtime(request: Request) -> Response:
        return as_sagemaker_runtime(await invocations(request))

    async def sagemaker_response_stream(request: Request) -> Response:
        return as_response_stream(await invocations(request))

    def guarded(api: Api) -> Callable[[Request], Any]:
        async def route(request: Request) -> Response:
            return await answer(
                request,
                lambda body: call_of(api),
                max_body_bytes=settings.max_body_bytes,
                api_key=settings.api_key,
                body_timeout_seconds=settings.body_timeout_seconds,
                metrics=runtime.metrics,
            )

        return route

    async def models(request: Request) -> Response:
        try:
            authenticate(request, settings.api_key)
            if runtime.service is None:
                raise UnavailableError("model is loading", retryable=True)
        except ApiError as error:
            return error_response(error)
        model = {"id": runtime.service.model_id, "object": "model", "owned_by": "semif"}
        return json_response(200, {"object": "list", "data": [model]})

    async def execution_parameters(request: Request) -> Response:
        """SageMaker batch transform asks this before a job's first mini-batch."""
        try:
            authenticate(request, invocations_key)
        except ApiError as error:
            return error_response(error)
        return json_response(200, lines.execution_parameters(settings.max_lines_bytes))

    async def metrics(request: Request) -> Response:
        """Prometheus metrics (adapter.metrics), answered without touching the engine.
        Inside SageMaker unguarded (SageMaker scrapes it; its IAM guards the endpoint),
        outside guarded by SEMIF_API_KEY like /invocations."""
        try:
            authenticate(request, invocations_key)
        except ApiError as error:
            return error_response(error)
        content, media_type = runtime.metrics.exposition()
        return Response(content, media_type=media_type)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # Each queued request waits for the scheduler in a worker thread: allow a thread
        # for every queued and batched request, so none waits for a thread instead.
        limiter = anyio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = max(
            limiter.total_tokens, settings.max_queue + settings.max_batch_requests + 8
        )

        async def load() -> None:
            try:
                await anyio.to_thread.run_sync(runtime.load)
            except Exception:
                # A load cancelled by shutdown is not a failure to report.
                if on_load_failure is not None and not runtime.stopping:
                    on_load_failure(runtime.error or "model load failed")

        task = asyncio.create_task(load())
        try:
            yield
        finally:
            runtime.begin_shutdown(settings.shutdown_grace_seconds)
            await task
            await anyio.to_thread.run_sync(runtime.close)

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
            Route(
                "/endpoints/{name}/invocations-response-stream",
                sagemaker_response_stream,
                methods=["POST"],
            ),
            Route("/v1/systemone", guarded("systemone"), methods=["POST"]),
            Route("/v1/chat/completions", guarded("chat"), methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/execution-parameters", execution_parameters, methods=["GET"]),
        ],
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error},
    )
    # POST /invocations/ is a 404 like any unknown path, not a 307 to /invocations.
    app.router.redirect_slashes = False
    app.state.runtime = runtime
    return app
