"""OpenAI Responses, stateless: POST /v1/responses.

`input` (a string, or message / function_call / function_call_output / reasoning items),
`instructions` and function `tools` become an Ollama chat request; the answer is a
`response` whose output holds a reasoning item (the thinking, as a summary), a message
and function_call items. Streamed, it is the Responses event sequence (`responses_stream.py`).
Nothing is stored, so `previous_response_id` is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from freetoken.api import completion
from freetoken.api.compat import (
    Outcome,
    joined_text,
    new_id,
    openai_error,
    parse_arguments,
    reply,
    sampling_options,
    think_for_effort,
    tool_choice,
    v1_handler,
)
from freetoken.api.errors import APIError
from freetoken.api.responses_stream import (
    Meta,
    ResponseStream,
    final_status,
    function_call_item,
    message_item,
    reasoning_item,
    response_object,
)
from freetoken.api.state import services
from freetoken.api.types import ChatRequest, field_of, parse_json
from freetoken.api.validate import check_format, check_tools

__all__ = ["responses", "responses_request"]

_TEXT = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_ITEMS = ("message", "function_call", "function_call_output", "reasoning")


@dataclass
class ResponsesCall:
    req: ChatRequest
    extra: dict[str, Any]
    meta: Meta


class _Items:
    """Input items folded into chat messages: function_call items join the assistant turn
    before them, reasoning items become the thinking of the assistant turn after them."""

    def __init__(self) -> None:
        self.out: list[dict[str, Any]] = []
        self.names: dict[str, str] = {}  # call_id -> tool name, for the outputs that follow
        self.thinking = ""

    def message(self, item: dict[str, Any]) -> None:
        role = _ROLES.get(str(item.get("role") or ""))
        if role is None:
            raise APIError(400, f"invalid input item role {item.get('role')!r}")
        msg = {"role": role, "content": joined_text(item.get("content"), "input item", _TEXT)}
        self.out.append(self._with_thinking(msg))

    def _with_thinking(self, msg: dict[str, Any]) -> dict[str, Any]:
        if msg["role"] == "assistant" and self.thinking:
            msg["thinking"], self.thinking = self.thinking, ""
        return msg

    def function_call(self, item: dict[str, Any]) -> None:
        call_id, name = str(item.get("call_id") or ""), str(item.get("name") or "")
        self.names[call_id] = name
        last = self.out[-1] if self.out else None
        if last is None or last["role"] != "assistant":
            last = self._with_thinking({"role": "assistant", "content": ""})
            self.out.append(last)
        calls = last.setdefault("tool_calls", [])
        args = parse_arguments(item.get("arguments"))
        fn = {"index": len(calls), "name": name, "arguments": args}
        calls.append({"id": call_id, "function": fn})

    def function_call_output(self, item: dict[str, Any]) -> None:
        call_id = str(item.get("call_id") or "")
        text = joined_text(item.get("output"), "function_call_output", _TEXT)
        msg = {"role": "tool", "content": text, "tool_call_id": call_id}
        if call_id in self.names:
            msg["tool_name"] = self.names[call_id]
        self.out.append(msg)

    def reasoning(self, item: dict[str, Any]) -> None:
        parts = (field_of(item, "summary", list) or []) + (field_of(item, "content", list) or [])
        self.thinking += joined_text(parts, "reasoning item", _TEXT)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    instructions = field_of(body, "instructions", str)
    raw = field_of(body, "input", (str, list), "")
    items = _Items()
    if instructions:
        items.out.append({"role": "system", "content": instructions})
    if isinstance(raw, str):
        items.out.append({"role": "user", "content": raw})
        return items.out
    for item in raw:
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind not in _ITEMS:
            raise APIError(400, f"input item type {kind!r} is not supported")
        getattr(items, kind)(item)
    return items.out


def _tools(body: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for tool in field_of(body, "tools", list) or []:
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise APIError(400, f"tool type {kind!r} is not supported")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": fn})
    return check_tools(out)


def _format(text: dict[str, Any] | None) -> str | dict[str, Any] | None:
    fmt = (text or {}).get("format") or {}
    if not isinstance(fmt, dict):
        raise APIError(400, "invalid text.format: expected an object")
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return check_format(fmt["schema"])
    raise APIError(400, f"invalid text.format {kind!r}")


def responses_request(body: dict[str, Any]) -> ResponsesCall:
    """A /v1/responses body as an Ollama chat request, and what the answer echoes."""
    if body.get("previous_response_id") or body.get("conversation"):
        raise APIError(
            400,
            "previous_response_id and conversation are not supported: "
            "this server stores no responses, so send the whole input",
        )
    model = field_of(body, "model", str, "")
    if not model:
        raise APIError(400, "model is required")
    tools, choice = _tools(body), body.get("tool_choice")
    forced = tool_choice(choice, flat=True)  # the runner reads Chat Completions' spelling
    reasoning = field_of(body, "reasoning", dict) or {}
    text = field_of(body, "text", dict)
    options = sampling_options(
        body, max_keys=("max_output_tokens",), stop_key="stop", defaults=True
    )
    extra = {"tool_choice": forced} if tools and forced not in (None, "none") else {}
    parallel = field_of(body, "parallel_tool_calls", bool)
    if tools and parallel is not None:  # unset: a forced answer is one call, auto any number
        extra["parallel_tool_calls"] = parallel
    req = ChatRequest(
        model=model,
        stream=field_of(body, "stream", bool, False),
        format=_format(text),
        options=options,
        think=think_for_effort(reasoning.get("effort")),
        messages=_messages(body),
        tools=(tools or None) if choice != "none" else None,
    )
    meta = Meta(
        model=model,
        instructions=field_of(body, "instructions", str),
        max_output_tokens=options.get("num_predict"),
        temperature=options.get("temperature"),
        top_p=options.get("top_p"),
        tools=field_of(body, "tools", list) or [],
        tool_choice=choice if choice is not None else "auto",
        reasoning={"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        text=text or {"format": {"type": "text"}},
    )
    return ResponsesCall(req, extra, meta)


def _whole(meta: Meta, out: Outcome) -> dict[str, Any]:
    output = [reasoning_item(new_id("rs_"), out.thinking)] if out.thinking else []
    if out.content or not out.calls:
        output.append(message_item(new_id("msg_"), out.content))
    output += [function_call_item(new_id("fc_"), c) for c in out.calls]
    return response_object(meta, output, final_status(out.done), out.done)


@v1_handler(openai_error)
async def responses(request: Request) -> Response:
    svc = services(request)
    call = responses_request(parse_json(await request.body()))
    req = call.req
    plan = await completion.prepare(svc, req)
    events = completion.events(svc, plan, None, completion.chat_body(plan, req, **call.extra))
    stream = ResponseStream(call.meta) if req.stream else None
    return reply(events, stream, lambda out: _whole(call.meta, out), openai_error)
