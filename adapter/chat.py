"""OpenAI chat completions from the decision endpoint's own model, whole or streamed.

One endpoint can then serve both paths: decisions and text generation. This module parses
the request and shapes the answer; the service renders the messages with the model's chat
template and generates (greedy at temperature 0, else top-p then temperature), stopping at
the model's end-of-generation token, a stop string, or `max_tokens`, which may not exceed
SEMIF_MAX_CHAT_TOKENS. Every validation failure is a 400 naming the field. With `"stream":
true` the answer is OpenAI's `chat.completion.chunk` events (`Chunks`), whose contents
joined are the whole answer's content, bit for bit (adapter.streaming, adapter.handlers).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from adapter import fields
from adapter.errors import RequestError
from adapter.fields import member_path
from adapter.service import Generation, Sampling

ROLES = ("system", "user", "assistant")
MAX_STOP_STRINGS = 4
# Rendering and tokenizing a conversation costs time per message before the token limit can
# be checked; far more turns than any prompt within SEMIF_MAX_TOKENS would hold are refused.
MAX_MESSAGES = 512
MAX_SEED = 2**32 - 1  # llama.cpp samplers take a uint32 seed
_FIELDS = (
    "messages",
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
)
_STREAM_OPTIONS = ("include_usage",)


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, str]]
    max_tokens: int
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage


def _number(body: Mapping[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise RequestError(key, f"must be a number from {low} to {high}")
    return float(value)


def _content(value: Any, path: str) -> str:
    """Message content: a string or a list of text parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for index, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise RequestError(f"{path}[{index}]", 'only {"type": "text"} parts are supported')
            text = part.get("text")
            if not isinstance(text, str):
                raise RequestError(f"{path}[{index}].text", "must be a string")
            parts.append(text)
        return "".join(parts)
    raise RequestError(path, "must be a string or an array of text parts")


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise RequestError("messages", "must be a non-empty array")
    if len(value) > MAX_MESSAGES:
        raise RequestError("messages", f"has {len(value)} messages; the limit is {MAX_MESSAGES}")
    messages = []
    for index, item in enumerate(value):
        path = f"messages[{index}]"
        if not isinstance(item, dict):
            raise RequestError(path, "must be an object with role and content")
        role = item.get("role")
        if role not in ROLES:
            raise RequestError(f"{path}.role", f"must be one of {', '.join(ROLES)}")
        messages.append({"role": role, "content": _content(item.get("content"), f"{path}.content")})
    return messages


def _max_tokens(body: Mapping[str, Any], limit: int) -> int:
    key = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    value = body.get(key, limit)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
        raise RequestError(
            key,
            f"must be an integer from 1 to {limit} (SEMIF_MAX_CHAT_TOKENS); "
            f"got {fields.shown(value)}",
        )
    return value


def _stop(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS:
        raise RequestError("stop", f"must be a string or up to {MAX_STOP_STRINGS} strings")
    if not all(isinstance(stop, str) and stop for stop in stops):
        raise RequestError("stop", "stop strings must be non-empty strings")
    return tuple(stops)


def parse_chat_request(body: Mapping[str, Any], max_chat_tokens: int) -> ChatRequest:
    """Validate the supported subset of the OpenAI chat completions request."""
    for key in body:
        if key not in _FIELDS:
            raise RequestError(
                member_path("", key), f"unsupported field; supported: {', '.join(_FIELDS)}"
            )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream", "must be true or false")
    n = body.get("n", 1)
    if type(n) is not int or n != 1:  # not True, not 1.0
        raise RequestError("n", "only one choice (n=1, an integer) is supported")
    if "model" in body and not isinstance(body["model"], str):
        raise RequestError("model", "must be a string")
    seed = body.get("seed")
    if seed is not None and (type(seed) is not int or not 0 <= seed <= MAX_SEED):
        raise RequestError("seed", f"must be an integer from 0 to {MAX_SEED}")
    return ChatRequest(
        messages=_messages(body.get("messages")),
        max_tokens=_max_tokens(body, max_chat_tokens),
        sampling=Sampling(
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
            seed=seed,
        ),
        stop=_stop(body.get("stop", [])),
        stream=stream,
        include_usage=_include_usage(body, stream),
    )


def _include_usage(body: Mapping[str, Any], stream: bool) -> bool:
    """`stream_options` (OpenAI's): only with `"stream": true`, only `include_usage`."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise RequestError("stream_options", 'is only allowed with "stream": true')
    if not isinstance(options, dict):
        raise RequestError("stream_options", "must be an object")
    for key in options:
        if key not in _STREAM_OPTIONS:
            raise RequestError(
                member_path("stream_options", key),
                f"unsupported field; supported: {', '.join(_STREAM_OPTIONS)}",
            )
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise RequestError("stream_options.include_usage", "must be true or false")
    return include


def completion(generation: Generation, model: str, completion_id: str) -> dict[str, Any]:
    """The OpenAI `chat.completion` object for one generation."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": generation.text},
                "finish_reason": generation.finish_reason,
                "logprobs": None,
            }
        ],
        "usage": _usage(generation),
    }


def _usage(generation: Generation) -> dict[str, int]:
    return {
        "prompt_tokens": generation.prompt_tokens,
        "completion_tokens": generation.completion_tokens,
        "total_tokens": generation.prompt_tokens + generation.completion_tokens,
    }


@dataclass(frozen=True)
class Chunks:
    """The `chat.completion.chunk` objects of one streamed completion, as OpenAI sends
    them: the role first, then each piece of content, then the finish reason, and with
    `include_usage` a last chunk with no choices and the usage (every other chunk then
    carries `"usage": null`). One id and one `created` time for all of them."""

    completion_id: str
    model: str
    include_usage: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def role(self) -> dict[str, Any]:
        return self._choice({"role": "assistant", "content": ""}, None)

    def content(self, text: str) -> dict[str, Any]:
        return self._choice({"content": text}, None)

    def finish(self, generation: Generation) -> dict[str, Any]:
        return self._choice({}, generation.finish_reason)

    def usage(self, generation: Generation) -> dict[str, Any]:
        return {**self._chunk([]), "usage": _usage(generation)}

    def _choice(self, delta: dict[str, str], finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        chunk = self._chunk([choice])
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
