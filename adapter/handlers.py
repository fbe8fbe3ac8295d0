"""The three APIs as plain functions: validate, admit, run the model in a worker thread, shape.

Validation comes before admission, so an invalid request never holds capacity; the model
work runs in a worker thread so the event loop stays free for /ping and for turning excess
requests away. Each returns the response body and the fields its log line adds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio.to_thread

from adapter import chat, decisions, systemone
from adapter.apis import Api
from adapter.cancel import Cancellation
from adapter.errors import RequestError
from adapter.runtime import Runtime
from adapter.schema import DecisionRequest, parse_decision_body

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
    mode, asked = request.mode, request.decisions
    async with runtime.admit() as service:
        scored = await anyio.to_thread.run_sync(
            lambda: decisions.decide(
                service, asked, mode, request.policy, cancel, retry_token=retry_token
            )
        )
    results = scored["results"]
    runtime.metrics.abstentions.inc(sum(1 for result in results if result["abstained"]))
    runtime.audit.decisions(
        asked,
        results,
        api="decision",
        request_id=request_id,
        model=service.model,
        seconds=scored["timing"]["total_seconds"],
    )
    response: dict[str, Any] = {"result": results[0]} if mode == "single" else {"results": results}
    response.update(model=service.model, timing=scored["timing"], request_id=request_id)
    log = {
        "mode": mode,
        "decisions": len(asked),
        "input_tokens": sum(result["input_tokens"] for result in results),
        **batching_fields(scored["timing"]),
    }
    return response, log


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
) -> Result:
    """Chat completion by the loaded model, under the same admission control. Chat holds
    no place in the retry line (a generation is refused only by a full queue): a token it
    brings is ignored."""
    del retry_token
    if not isinstance(body, dict):
        raise RequestError("body", "must be a JSON object")
    settings = runtime.settings
    # load_settings keeps the chat limit within SEMIF_MAX_TOKENS; Settings built directly may not.
    request = chat.parse_chat_request(body, min(settings.max_chat_tokens, settings.max_tokens))
    async with runtime.admit() as service:
        generation = await anyio.to_thread.run_sync(
            lambda: service.generate(
                request.messages,
                max_new_tokens=request.max_tokens,
                sampling=request.sampling,
                stop=request.stop,
                cancel=cancel,
            )
        )
    response = chat.completion(generation, service.model_id, f"chatcmpl-{request_id}")
    log = {
        "mode": "chat",
        "input_tokens": generation.prompt_tokens,
        "reused_tokens": generation.reused_tokens,
        "output_tokens": generation.completion_tokens,
        "finish_reason": generation.finish_reason,
    }
    return response, log


BY_API: dict[Api, Handler] = {
    "decision": decide,
    "systemone": answer_systemone,
    "chat": complete_chat,
}
