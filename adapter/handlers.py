"""The three APIs as plain functions: validate, admit, run the model in a worker thread, shape.

Validation comes before admission, so an invalid request never holds capacity; the model
work runs in a worker thread so the event loop stays free for /ping and for turning excess
requests away. Each returns the response body (a streamed chat: its events,
adapter.streaming) and the fields its log line adds.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio.to_thread

from adapter import chat, decisions, systemone
from adapter.apis import Api
from adapter.cancel import Cancellation
from adapter.errors import RequestError
from adapter.runtime import Runtime
from adapter.schema import DecisionRequest, parse_decision_body
from adapter.service import DecisionService, Generation
from adapter.streaming import LINES, Feed, P, Streamed, event, line

Result = tuple[dict[str, Any], dict[str, Any]]
# (runtime, body, request id, the request's cancellation, the retry token it brought) ->
# awaitable Result
Handler = Callable[[Runtime, Any, str, Cancellation, str | None], Any]


def batching_fields(timing: dict[str, Any]) -> dict[str, Any]:
    """What a scoring request's log line says about its queueing and the passes it rode."""
    keys = (
        "evaluated_tokens",
        "reused_tokens",
        "pad_tokens",
        "queue_seconds",
        "passes",
        "batch_requests",
    )
    return {key: timing[key] for key in keys}


async def decide(
    runtime: Runtime, body: Any, request_id: str, cancel: Cancellation, retry_token: str | None
) -> Result:
    """The decision API: one decision, or a shared-state batch scored as branches."""
    settings = runtime.settings
    request = parse_decision_body(body, settings.max_shared_decisions, settings.readout)
    return await decide_parsed(runtime, request, request_id, cancel, retry_token)


async def decide_parsed(
    runtime: Runtime,
    request: DecisionRequest,
    request_id: str,
    cancel: Cancellation,
    retry_token: str | None,
) -> Result:
    """`decide` after validation (adapter.lines also scores decisions it merged by state)."""
    async with runtime.admit() as service:
        scored = await anyio.to_thread.run_sync(
            lambda: _decide(service, request, cancel, retry_token, None)
        )
    results = scored["results"]
    log = _decided(runtime, service, request, scored, request_id)
    response: dict[str, Any] = (
        {"result": results[0]} if request.mode == "single" else {"results": results}
    )
    response.update(model=service.model, timing=scored["timing"], request_id=request_id)
    return response, log


def _decide(
    service: DecisionService,
    request: DecisionRequest,
    cancel: Cancellation,
    retry_token: str | None,
    on_result: decisions.ResultObserver | None,
) -> dict[str, Any]:
    """The request's decisions scored (on a request thread); `on_result` hears a streamed
    one's results as they are ready."""
    return decisions.decide(
        service,
        request.decisions,
        request.mode,
        request.policy,
        cancel,
        retry_token=retry_token,
        on_result=on_result,
    )


def _decided(
    runtime: Runtime,
    service: DecisionService,
    request: DecisionRequest,
    scored: dict[str, Any],
    request_id: str,
) -> dict[str, Any]:
    """What answering decisions leaves behind, whole or streamed: the abstentions counted,
    the audit records, and the fields of the call's log line (returned)."""
    results = scored["results"]
    runtime.metrics.abstentions.inc(sum(1 for result in results if result["abstained"]))
    runtime.audit.decisions(
        request.decisions,
        results,
        api="decision",
        request_id=request_id,
        model=service.model,
        seconds=scored["timing"]["total_seconds"],
    )
    return {
        "mode": request.mode,
        "decisions": len(request.decisions),
        "input_tokens": sum(result["input_tokens"] for result in results),
        **batching_fields(scored["timing"]),
    }


async def decide_streamed(
    runtime: Runtime, body: Any, request_id: str, cancel: Cancellation, retry_token: str | None
) -> tuple[Streamed, dict[str, Any]]:
    """The decision API answered as JSON Lines (`Accept: application/jsonlines`): a line
    `{"index", "result"}` per decision as soon as it is scored, the first one after a pass
    of its own, in the order they finish, then `{"done": true, "model", "timing",
    "request_id"}`. The results are the whole answer's, bit for bit. As a streamed chat,
    the answer begins with the first result, so what fails before it is the usual JSON
    error; after it, a last line `{"error", "status", ...}` replaces the closing one."""
    settings = runtime.settings
    request = parse_decision_body(body, settings.max_shared_decisions, settings.readout)
    admitted = AsyncExitStack()
    service = await admitted.enter_async_context(runtime.admit())

    def produce(put: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        def told(index: int, result: dict[str, Any]) -> None:
            put({"index": index, "result": result})

        return _decide(service, request, cancel, retry_token, told)

    feed = Feed(produce, cancel)
    first = await _first(feed, admitted)
    log: dict[str, Any] = {"mode": request.mode}
    lines = _result_lines(feed, first, admitted, log, runtime, service, request, request_id)
    return Streamed(lines, log, LINES), {}


async def _first(feed: Feed[P, Any], admitted: AsyncExitStack) -> P | None:
    """A stream's first piece; when the work fails before it, the work has ended and the
    admission is given back before the error is answered as usual."""
    try:
        return await feed.next()
    except BaseException:
        await feed.settle()
        await admitted.aclose()
        raise


async def _result_lines(
    feed: Feed[dict[str, Any], dict[str, Any]],
    first: dict[str, Any] | None,
    admitted: AsyncExitStack,
    log: dict[str, Any],
    runtime: Runtime,
    service: DecisionService,
    request: DecisionRequest,
    request_id: str,
) -> AsyncGenerator[bytes, None]:
    """A streamed decision request's lines (`decide_streamed`); a client that leaves closes
    this generator, which cancels the rest of the work before the admission is given
    back."""
    try:
        piece = first
        while piece is not None:
            yield line(piece)
            piece = await feed.next()
        scored = feed.result()
        log.update(_decided(runtime, service, request, scored, request_id))
        closing = {"model": service.model, "timing": scored["timing"], "request_id": request_id}
        yield line({"done": True, **closing})
    finally:
        await feed.settle()
        await admitted.aclose()


async def answer_systemone(
    runtime: Runtime, body: Any, request_id: str, cancel: Cancellation, retry_token: str | None
) -> Result:
    """System One: every question about the state in one batched pass, format-exact answer."""
    request = systemone.parse_systemone(body, runtime.settings.max_shared_decisions)
    return await answer_systemone_parsed(runtime, request, request_id, cancel, retry_token)


async def answer_systemone_parsed(
    runtime: Runtime,
    request: systemone.SystemOneRequest,
    request_id: str,
    cancel: Cancellation,
    retry_token: str | None,
) -> Result:
    """`answer_systemone` after validation (System One's response has no request id of its
    own; the questions' audit records carry it)."""
    async with runtime.admit() as service:
        answered = await anyio.to_thread.run_sync(
            lambda: systemone.answer(service, request, cancel, retry_token=retry_token)
        )
    timing = answered.batch.timing_json()
    runtime.audit.decisions(
        [question.decision for question in request.questions],
        answered.readings,
        api="systemone",
        request_id=request_id,
        model=service.model,
        seconds=timing["total_seconds"],
    )
    log = {
        "mode": "systemone",
        "decisions": len(request.questions),
        "input_tokens": answered.response["usage"]["input_tokens"],
        **batching_fields(timing),
    }
    return answered.response, log


async def complete_chat(
    runtime: Runtime, body: Any, request_id: str, cancel: Cancellation, retry_token: str | None
) -> tuple[dict[str, Any] | Streamed, dict[str, Any]]:
    """Chat completion by the loaded model, under the same admission control, whole or
    streamed (`"stream": true`). Chat holds no place in the retry line (a generation is
    refused only by a full queue): a token it brings is ignored."""
    del retry_token
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    settings = runtime.settings
    # load_settings keeps the chat limit within SEMIF_MAX_TOKENS; Settings built directly may not.
    request = chat.parse_chat_request(body, min(settings.max_chat_tokens, settings.max_tokens))
    if request.stream:
        return await _stream_chat(runtime, request, request_id, cancel)
    async with runtime.admit() as service:
        generation = await anyio.to_thread.run_sync(
            lambda: _generate(service, request, cancel, None)
        )
    response = chat.completion(generation, service.model_id, f"chatcmpl-{request_id}")
    return response, _chat_log(generation)


def _generate(
    service: DecisionService,
    request: chat.ChatRequest,
    cancel: Cancellation,
    on_text: Callable[[str], None] | None,
) -> Generation:
    """The request's generation (on a request thread); `on_text` hears a streamed one."""
    return service.generate(
        request.messages,
        max_new_tokens=request.max_tokens,
        sampling=request.sampling,
        stop=request.stop,
        cancel=cancel,
        on_text=on_text,
    )


def _chat_log(generation: Generation) -> dict[str, Any]:
    """What a chat's log line adds (and the chat token metrics count)."""
    return {
        "mode": "chat",
        "input_tokens": generation.prompt_tokens,
        "reused_tokens": generation.reused_tokens,
        "output_tokens": generation.completion_tokens,
        "finish_reason": generation.finish_reason,
    }


async def _stream_chat(
    runtime: Runtime, request: chat.ChatRequest, request_id: str, cancel: Cancellation
) -> tuple[Streamed, dict[str, Any]]:
    """A streamed chat: the generation runs as a whole one does, its text handed over a
    step at a time (adapter.streaming's `Feed`). The answer begins once the first step has
    run, so what fails before (a full queue, the deadline while queued, a prompt too long
    for a stream, shutdown) is the usual JSON error; the admission is held until the
    stream ends, as a whole answer holds it until it is written."""
    admitted = AsyncExitStack()
    service = await admitted.enter_async_context(runtime.admit())
    feed: Feed[str, Generation] = Feed(lambda put: _generate(service, request, cancel, put), cancel)
    first = await _first(feed, admitted)
    chunks = chat.Chunks(f"chatcmpl-{request_id}", service.model_id, request.include_usage)
    log: dict[str, Any] = {"mode": "chat"}
    return Streamed(_chat_events(feed, first, chunks, admitted, log), log), {}


async def _chat_events(
    feed: Feed[str, Generation],
    first: str | None,
    chunks: chat.Chunks,
    admitted: AsyncExitStack,
    log: dict[str, Any],
) -> AsyncGenerator[bytes, None]:
    """The chunks of a streamed chat: the role, each non-empty piece of text (a step that
    only held bytes back adds none), the finish reason, the usage when asked. A failure
    after the first byte is raised from `feed.next` (adapter.http ends the stream with it);
    a client that leaves closes this generator, which cancels the generation and waits for
    the scheduler to drop it before the admission is given back. `log` gets the
    generation's numbers once it has ended (the call's log line and chat token metrics)."""
    try:
        yield event(chunks.role())
        piece = first
        while piece is not None:
            if piece:
                yield event(chunks.content(piece))
            piece = await feed.next()
        generation = feed.result()
        log.update(_chat_log(generation))
        yield event(chunks.finish(generation))
        if chunks.include_usage:
            yield event(chunks.usage(generation))
    finally:
        await feed.settle()
        await admitted.aclose()


BY_API: dict[Api, Handler] = {
    "decision": decide,
    "systemone": answer_systemone,
    "chat": complete_chat,
}
