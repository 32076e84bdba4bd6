"""Anthropic Messages: POST /v1/messages and /v1/messages/count_tokens.

A Messages request becomes an Ollama chat request (system blocks, text, tool_use,
tool_result and thinking blocks, tools, tool_choice, thinking) and runs through the same
machinery as /api/chat. The answer is a `message` object, or the Messages event stream:
message_start, ping, content blocks (thinking, text, tool_use with its input streamed as
JSON pieces), message_delta with the stop reason, message_stop. The API key and
`anthropic-version` headers are accepted and ignored.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from freetoken.api import completion
from freetoken.api.compat import (
    Call,
    Outcome,
    argument_pieces,
    calls_of,
    joined_text,
    new_id,
    reply,
    sampling_options,
    v1_handler,
)
from freetoken.api.errors import APIError
from freetoken.api.sse import JSONResult, event
from freetoken.api.state import services
from freetoken.api.types import ChatRequest, field_of, parse_json

__all__ = [
    "MessageStream",
    "anthropic_error",
    "count_tokens",
    "message_object",
    "messages",
    "messages_request",
]

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
_TEXT = ("text",)
_TOOL_ID = ("toolu_", 24)  # the prefix and length of Anthropic's tool-use ids


def anthropic_error(err: APIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(err.status, "api_error")
    return {
        "type": "error",
        "error": {"type": kind, "message": err.message},
        "request_id": new_id("req_"),
    }


@dataclass
class MessagesCall:
    req: ChatRequest
    extra: dict[str, Any]  # runner request fields beyond Ollama's (tool_choice)


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise APIError(400, f"{where}: content must be a string or an array of blocks")
    return content


def _user(content: Any, names: dict[str, str]) -> list[dict[str, Any]]:
    """A user turn: its tool results become tool messages, its text one user message."""
    out, texts = [], []
    for block in _blocks(content, "user message"):
        kind = block.get("type")
        if kind == "tool_result":
            call_id = str(block.get("tool_use_id") or "")
            text = joined_text(block.get("content"), "tool_result", _TEXT)
            msg = {"role": "tool", "content": text, "tool_call_id": call_id}
            if call_id in names:
                msg["tool_name"] = names[call_id]
            out.append(msg)
        elif kind == "text":
            texts.append(str(block.get("text") or ""))
        else:
            joined_text([block], "user message", _TEXT)  # raises the right error for it
    if texts or not out:
        out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


def _assistant(content: Any, names: dict[str, str]) -> dict[str, Any]:
    texts, thinking, calls = [], [], []
    for block in _blocks(content, "assistant message"):
        kind = block.get("type")
        if kind == "text":
            texts.append(str(block.get("text") or ""))
        elif kind == "thinking":
            thinking.append(str(block.get("thinking") or ""))
        elif kind == "tool_use":
            name, args = str(block.get("name") or ""), block.get("input")
            if not isinstance(args, dict):
                raise APIError(400, "invalid tool call arguments")
            fn = {"index": len(calls), "name": name, "arguments": args}
            calls.append({"id": str(block.get("id") or ""), "function": fn})
            names[calls[-1]["id"]] = name
        elif kind != "redacted_thinking":  # encrypted elsewhere: nothing a local model can read
            raise APIError(400, f"assistant message: unsupported content block type {kind!r}")
    msg: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(texts)}
    if thinking:
        msg["thinking"] = "".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    raw = field_of(body, "messages", list, [])
    if not raw:
        raise APIError(400, "messages: at least one message is required")
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": joined_text(system, "system", _TEXT)})
    names: dict[str, str] = {}  # tool_use id -> tool name, for the results that follow
    for m in raw:
        role = m.get("role") if isinstance(m, dict) else None
        if role == "user":
            out += _user(m.get("content"), names)
        elif role == "assistant":
            out.append(_assistant(m.get("content"), names))
        else:
            raise APIError(400, f"messages: invalid role {role!r} (must be user or assistant)")
    return out


def _tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    out = []
    for i, tool in enumerate(field_of(body, "tools", list) or []):
        if not isinstance(tool, dict) or not isinstance(tool.get("input_schema"), dict):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise APIError(400, f"tools: tool type {kind!r} is not supported (no input_schema)")
        name, about = tool.get("name"), tool.get("description", "")
        if not isinstance(name, str) or not name or not isinstance(about, str):
            raise APIError(400, f"tools.{i}: name and description must be strings")
        fn = {"name": name, "description": about}
        out.append({"type": "function", "function": fn | {"parameters": tool["input_schema"]}})
    return out or None


def _tool_choice(choice: Any) -> Any:
    """Anthropic's tool_choice in the OpenAI terms the runner reads; "none" is None."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, "tool_choice.name: Field required")
        return {"type": "function", "function": {"name": name}}
    if kind in ("auto", "any"):
        return {"auto": "auto", "any": "required"}[kind]
    if kind != "none":
        raise APIError(400, f"tool_choice: invalid type {kind!r}")
    return None


def _think(body: dict[str, Any]) -> tuple[bool | None, dict[str, Any]]:
    """Thinking on or off, and the runner fields of its budget (`budget_tokens`: the
    thinking's length at most, where the model's format marks where thinking ends)."""
    thinking = field_of(body, "thinking", dict)
    if thinking is None:
        return None, {}
    kind = thinking.get("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise APIError(400, f"thinking: invalid type {kind!r}")
    budget = thinking.get("budget_tokens")
    if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)):
        raise APIError(400, "thinking.budget_tokens: expected an integer")
    if budget is not None and budget < 1:
        raise APIError(400, "thinking.budget_tokens: must be at least 1")
    extra = {"think_budget": budget} if kind == "enabled" and budget is not None else {}
    return kind != "disabled", extra


def messages_request(body: dict[str, Any], counting: bool = False) -> MessagesCall:
    """A Messages body as an Ollama chat request (`counting`: for count_tokens, no max_tokens)."""
    model = field_of(body, "model", str, "")
    if not model:
        raise APIError(400, "model: Field required")
    max_tokens = field_of(body, "max_tokens", int)
    if not counting and max_tokens is None:
        raise APIError(400, "max_tokens: Field required")
    if not counting and max_tokens < 1:
        raise APIError(400, "max_tokens: Input should be greater than or equal to 1")
    tools = _tools(body)
    think, extra = _think(body)
    # checked with or without tools: a choice nobody can honour is the client's mistake
    choice = _tool_choice(body["tool_choice"]) if body.get("tool_choice") is not None else None
    if tools and body.get("tool_choice") is not None:
        tools = tools if choice is not None else None
        extra |= {"tool_choice": choice} if choice is not None else {}
        if choice is not None and body["tool_choice"].get("disable_parallel_tool_use") is True:
            extra["parallel_tool_calls"] = False
    req = ChatRequest(
        model=model,
        stream=field_of(body, "stream", bool, False),
        options=sampling_options(
            body, max_keys=("max_tokens",), stop_key="stop_sequences", defaults=False
        ),
        think=think,
        messages=_messages(body),
        tools=tools,
    )
    return MessagesCall(req, extra)


def stop_reason(done_reason: str, calls: bool) -> str:
    if calls and done_reason != "length":  # a cut answer is max_tokens, calls or not
        return "tool_use"
    return {"stop": "end_turn", "length": "max_tokens"}.get(done_reason, "stop_sequence")


def _tool_use(call: Call) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}


def message_object(model: str, out: Outcome) -> dict[str, Any]:
    """The non-streamed `message`: thinking, text, then the tool calls."""
    content: list[dict[str, Any]] = []
    if out.thinking:
        content.append({"type": "thinking", "thinking": out.thinking, "signature": ""})
    calls = out.whole_calls  # a call the limit cut has no input to show: max_tokens says so
    if out.content or not calls:
        content.append({"type": "text", "text": out.content})
    content += [_tool_use(c) for c in calls]
    return {
        "id": new_id("msg_"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(out.done_reason, bool(calls)),
        "stop_sequence": None,
        "usage": {
            "input_tokens": out.prompt_tokens,
            "cache_read_input_tokens": out.cached_tokens,
            "output_tokens": out.completion_tokens,
        },
    }


PING = event({"type": "ping"}, "ping")
PING_AFTER = 10.0  # seconds of silence before a ping keeps the stream's connection alive


class MessageStream:
    """The event stream of one streamed message."""

    def __init__(self, model: str):
        self.model = model
        self.id = new_id("msg_")
        self.started = False
        self.index = -1  # the content block being written
        self.open: str | None = None  # its type, while it is open
        self.calls = 0

    def _start(self) -> list[bytes]:
        self.started = True
        message = message_object(self.model, Outcome()) | {"id": self.id, "content": []}
        message |= {"stop_reason": None, "usage": {"input_tokens": 0, "output_tokens": 0}}
        return [event({"type": "message_start", "message": message}, "message_start"), PING]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [event({"type": "content_block_stop", "index": self.index}, "content_block_stop")]

    def _open(self, block: dict[str, Any]) -> list[bytes]:
        frames = self._close()
        self.index += 1
        self.open = block["type"]
        data = {"type": "content_block_start", "index": self.index, "content_block": block}
        return frames + [event(data, "content_block_start")]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        data = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return event(data, "content_block_delta")

    def on_event(self, ev: dict[str, Any]) -> list[bytes]:
        frames = [] if self.started else self._start()
        if text := ev.get("thinking"):
            if self.open != "thinking":
                frames += self._open({"type": "thinking", "thinking": "", "signature": ""})
            frames.append(self._delta({"type": "thinking_delta", "thinking": text}))
        if text := ev.get("content"):
            if self.open != "text":
                frames += self._open({"type": "text", "text": ""})
            frames.append(self._delta({"type": "text_delta", "text": text}))
        if start := ev.get("tool_call_start"):  # a call whose arguments now stream
            call = Call(id=new_id(*_TOOL_ID), name=start["name"], arguments={}, index=self.calls)
            frames += self._open(_tool_use(call) | {"input": {}})
        if delta := ev.get("tool_call_delta"):
            frames.append(
                self._delta({"type": "input_json_delta", "partial_json": delta["arguments"]})
            )
        if ev.get("streamed"):  # its deltas went out already: only close its block
            self.calls += len(ev.get("tool_calls") or []) + ("tool_call_truncated" in ev)
            return frames + self._close()
        for call in calls_of(ev, self.calls, *_TOOL_ID):
            # a call the limit cut streams its partial input too; max_tokens says so
            self.calls += 1
            frames += self._open(_tool_use(call) | {"input": {}})
            for piece in argument_pieces(call.wire_arguments):
                frames.append(self._delta({"type": "input_json_delta", "partial_json": piece}))
            frames += self._close()
        return frames

    def on_done(self, done: dict[str, Any]) -> list[bytes]:
        frames = ([] if self.started else self._start()) + self._close()
        reason = stop_reason(done.get("done_reason") or "stop", self.calls > 0)
        usage = {
            "input_tokens": int(done.get("prompt_eval_count") or 0),
            "cache_read_input_tokens": int(done.get("prompt_cached_count") or 0),
            "output_tokens": int(done.get("eval_count") or 0),
        }
        delta = {"type": "message_delta", "usage": usage}
        delta["delta"] = {"stop_reason": reason, "stop_sequence": None}
        frames.append(event(delta, "message_delta"))
        return frames + [event({"type": "message_stop"}, "message_stop")]

    async def frames(self, events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
        async with aclosing(events) as stream:
            async for ev in stream:
                for frame in self.on_done(ev) if ev.get("done") else self.on_event(ev):
                    yield frame

    @staticmethod
    def error_frame(err: APIError) -> bytes:
        return event(anthropic_error(err), "error")


@v1_handler(anthropic_error)
async def messages(request: Request) -> Response:
    svc = services(request)
    call = messages_request(parse_json(await request.body()))
    req = call.req
    plan = await completion.prepare(svc, req)
    body = completion.chat_body(plan, req, **call.extra, stream_tool_calls=bool(req.stream))
    events = completion.events(svc, plan, None, body)
    stream = MessageStream(req.model) if req.stream else None
    whole = functools.partial(message_object, req.model)
    return reply(events, stream, whole, anthropic_error, _TOOL_ID, ping=PING, ping_after=PING_AFTER)


@v1_handler(anthropic_error)
async def count_tokens(request: Request) -> Response:
    svc = services(request)
    call = messages_request(parse_json(await request.body()), counting=True)
    plan = await completion.prepare(svc, call.req)
    body = completion.chat_body(plan, call.req, **call.extra)

    async def make() -> dict[str, Any]:  # inside the response: a hangup ends the model's wait
        return {"input_tokens": await completion.count_tokens(svc, plan, body)}

    return JSONResult(make, anthropic_error)
