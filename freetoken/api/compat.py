"""What the OpenAI, Anthropic and Responses translations share.

Each of those APIs is a different spelling of the same chat request and the same runner
events. This module holds the common parts: their error shapes, request-field helpers
(text parts, tool-call arguments, reasoning effort), tool calls as they come out of the
runner, and the accumulation of a whole (non-streamed) answer.
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response

from freetoken import options as opts
from freetoken.api.errors import APIError, shaped_handler
from freetoken.api.sse import JSONResult, SSEResponse
from freetoken.api.types import field_of

__all__ = [
    "Call",
    "Outcome",
    "argument_pieces",
    "arguments_json",
    "calls_of",
    "collect",
    "joined_text",
    "new_id",
    "openai_error",
    "parse_arguments",
    "reply",
    "sampling_options",
    "think_for_effort",
    "tool_choice",
    "v1_handler",
]

_ALPHABET = string.ascii_lowercase + string.digits
# Tool-call arguments are streamed in pieces of this many characters: a client that
# accumulates deltas must see more than one piece, as it would from a hosted API.
_PIECE = 8
# reasoning effort -> Ollama's think
_EFFORT = {
    "none": False,
    "minimal": "low",
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
    "max": "max",
}


def new_id(prefix: str, n: int = 24) -> str:
    return prefix + "".join(secrets.choice(_ALPHABET) for _ in range(n))


# -- errors -----------------------------------------------------------------------------


def openai_error(err: APIError) -> dict[str, Any]:
    kind = {400: "invalid_request_error", 404: "not_found_error"}.get(err.status, "api_error")
    return {"error": {"message": err.message, "type": kind, "param": None, "code": None}}


Handler = Callable[[Request], Awaitable[Response]]


v1_handler = shaped_handler  # each /v1 module passes its API's error body


# -- request fields ---------------------------------------------------------------------


def joined_text(content: Any, where: str, text_types: tuple[str, ...]) -> str:
    """A message's content as one string: a string, or the text of its parts joined.

    Parts of one message are one turn, so they are joined rather than made into separate
    messages the template would render as separate turns. Images are refused: the models
    served here read text only.
    """
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise APIError(400, f"invalid {where}: content must be a string or an array of parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in text_types and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in ("image_url", "input_image", "image", "input_audio", "input_file"):
            raise APIError(400, f"invalid {where}: this model does not support {kind} input")
        else:
            raise APIError(400, f"invalid {where}: unsupported content part type {kind!r}")
    return "\n\n".join(texts)


def parse_arguments(raw: Any) -> dict[str, Any]:
    """Tool-call arguments sent back in history: a JSON string (or an object) of an object."""
    if isinstance(raw, dict):
        return raw
    if raw in ("", None):
        return {}  # a call without arguments
    try:
        value = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise APIError(400, "invalid tool call arguments")
    return value


def think_for_effort(effort: Any) -> bool | str | None:
    if effort is None:
        return None
    if effort not in _EFFORT:
        choices = ", ".join(f'"{e}"' for e in _EFFORT)
        raise APIError(400, f"invalid reasoning effort {effort!r} (must be one of {choices})")
    return _EFFORT[effort]


_CHOICES = ("auto", "none", "required")


def tool_choice(choice: Any, flat: bool = False) -> Any:
    """An OpenAI `tool_choice`, checked: "auto", "none", "required", or a forced function,
    `{"type": "function", "function": {"name"}}` (Chat Completions) or, `flat`,
    `{"type": "function", "name"}` (Responses). Returned in Chat Completions' spelling."""
    if choice is None or choice in _CHOICES:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice if flat else choice.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]:
            return {"type": "function", "function": {"name": fn["name"]}}
    raise APIError(
        400,
        'invalid tool_choice: expected "auto", "none", "required" or a function to call by name',
    )


def _number(body: dict[str, Any], name: str, default: float | None = None) -> float | None:
    value = field_of(body, name, (int, float))
    return default if value is None else float(value)


def sampling_options(
    body: dict[str, Any], *, max_keys: tuple[str, ...], stop_key: str, defaults: bool
) -> dict[str, Any]:
    """Ollama options from OpenAI/Anthropic sampling fields. With `defaults`, temperature and
    top_p default to 1.0 as OpenAI's do (and Ollama's /v1 does), not to the model's."""
    one = 1.0 if defaults else None
    options: dict[str, Any] = {
        "temperature": _number(body, "temperature", one),
        "top_p": _number(body, "top_p", one),
        "frequency_penalty": _number(body, "frequency_penalty"),
        "presence_penalty": _number(body, "presence_penalty"),
        "seed": field_of(body, "seed", int),
        "top_k": field_of(body, "top_k", int),
        "ignore_eos": field_of(body, "ignore_eos", bool),  # vLLM's extension, for benchmarks
    }
    for key in max_keys:
        if (n := field_of(body, key, int)) is not None:
            if n < 0:  # Ollama's "unlimited"; a client that sends it made a mistake
                raise APIError(
                    400,
                    f"Invalid '{key}': integer below minimum value. "
                    f"Expected a value >= 0, but got {n} instead.",
                )
            options["num_predict"] = n
            break
    stop = field_of(body, stop_key, (str, list))
    if stop is not None:
        stop = [stop] if isinstance(stop, str) else stop
        if not all(isinstance(s, str) for s in stop):
            raise APIError(400, f'invalid value for "{stop_key}": expected strings')
        options["stop"] = stop
    try:
        return opts.validate(options)
    except opts.OptionError as e:
        raise APIError(400, str(e)) from None


# -- runner output ----------------------------------------------------------------------


@dataclass
class Call:
    """One tool call the model made."""

    id: str
    name: str
    arguments: dict[str, Any]
    index: int  # its position among the answer's calls
    # a call the token limit cut: its arguments' JSON text as far as it got (None: whole)
    partial: str | None = None

    @property
    def wire_arguments(self) -> str:
        """The arguments as the wire's JSON string (a cut call's text as it is)."""
        return self.partial if self.partial is not None else arguments_json(self.arguments)


def calls_of(event: dict[str, Any], first: int, prefix: str = "call_", n: int = 8) -> list[Call]:
    """The calls of a `tool_calls` event, numbered from `first`, or the one call of a
    `tool_call_truncated` event; ids are made where missing."""
    if cut := event.get("tool_call_truncated"):
        name, text = str(cut.get("name") or ""), str(cut.get("arguments") or "")
        return [Call(new_id(prefix, n), name, {}, first, partial=text)]
    out = []
    for i, raw in enumerate(event.get("tool_calls") or []):
        fn = raw.get("function") or {}
        args = fn.get("arguments")
        out.append(
            Call(
                id=raw.get("id") or new_id(prefix, n),
                name=str(fn.get("name") or ""),
                arguments=args if isinstance(args, dict) else {},
                index=first + i,
            )
        )
    return out


def arguments_json(args: dict[str, Any]) -> str:
    """Arguments as the JSON string the wire carries, compact and in the model's key order."""
    return json.dumps(args, ensure_ascii=False, separators=(",", ":"))


def argument_pieces(text: str) -> list[str]:
    """`text` cut into the pieces its deltas carry; joined, they are `text` exactly."""
    return [text[i : i + _PIECE] for i in range(0, len(text), _PIECE)] or [""]


@dataclass
class Outcome:
    """A whole answer, accumulated from the runner's events."""

    content: str = ""
    thinking: str = ""
    calls: list[Call] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    done: dict[str, Any] = field(default_factory=dict)

    @property
    def done_reason(self) -> str:
        return self.done.get("done_reason") or "stop"

    @property
    def whole_calls(self) -> list[Call]:
        """The calls the token limit did not cut."""
        return [c for c in self.calls if c.partial is None]

    @property
    def prompt_tokens(self) -> int:
        return int(self.done.get("prompt_eval_count") or 0)

    @property
    def cached_tokens(self) -> int:
        return int(self.done.get("prompt_cached_count") or 0)

    @property
    def completion_tokens(self) -> int:
        return int(self.done.get("eval_count") or 0)


async def collect(
    events: AsyncIterator[dict[str, Any]], prefix: str = "call_", n: int = 8
) -> Outcome:
    out = Outcome()
    async with aclosing(events) as stream:
        async for ev in stream:
            out.content += ev.get("content") or ""
            out.thinking += ev.get("thinking") or ""
            out.calls += calls_of(ev, len(out.calls), prefix, n)
            out.logprobs += ev.get("logprobs") or []
            if ev.get("done"):
                out.done = ev
    return out


class Stream(Protocol):
    """A stream builder: the frames of one answer, and the frame of an error within it."""

    def frames(self, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]: ...

    def error_frame(self, err: APIError) -> bytes: ...


def reply(
    events: AsyncIterator[dict[str, Any]],
    stream: Stream | None,
    whole: Callable[[Outcome], dict[str, Any]],
    error_body: Callable[[APIError], dict[str, Any]],
    ids: tuple[str, int] = ("call_", 8),
    **sse: Any,
) -> Response:
    """The answer to a completion: `stream`'s frames as server-sent events or, without a
    stream, `whole` of the accumulated outcome as JSON (tool-call ids made as `ids` says)."""
    if stream is not None:
        frames = stream.frames(events)
        return SSEResponse(frames, error_body=error_body, error_frame=stream.error_frame, **sse)

    async def answer() -> dict[str, Any]:
        return whole(await collect(events, *ids))

    return JSONResult(answer, error_body)
