"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions and /v1/models.

Requests are translated into Ollama's chat and generate requests and run through the same
machinery as /api/chat and /api/generate (`completion.py`); the runner's events are turned
back into OpenAI objects and chunks (`openai_stream.py`). Errors have OpenAI's shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from freetoken.api import completion
from freetoken.api.compat import (
    joined_text,
    openai_error,
    parse_arguments,
    reply,
    sampling_options,
    think_for_effort,
    tool_choice,
    v1_handler,
)
from freetoken.api.errors import APIError
from freetoken.api.openai_stream import (
    ChatStream,
    CompletionStream,
    chat_completion,
    text_completion,
)
from freetoken.api.state import resolve, services
from freetoken.api.types import ChatRequest, GenerateRequest, field_of, parse_json
from freetoken.api.validate import check_format, check_tools
from freetoken.store import Name

__all__ = [
    "chat_completions",
    "chat_request",
    "completion_request",
    "completions",
    "list_models",
    "retrieve_model",
]

_TEXT_PARTS = ("text", "input_text", "output_text")
_ROLES = {
    "system": "system",
    "developer": "system",  # OpenAI's newer name for the system role
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
_MAX_KEYS = ("max_completion_tokens", "max_tokens")  # the newer name wins when both are sent


@dataclass
class V1Call:
    """An OpenAI request in Ollama's terms, plus what only the OpenAI answer needs."""

    req: ChatRequest | GenerateRequest
    extra: dict[str, Any]  # runner request fields beyond Ollama's (tool_choice, logprobs)
    include_usage: bool = False


def _model(body: dict[str, Any]) -> str:
    if model := field_of(body, "model", str, ""):
        return model
    raise APIError(400, "model is required")


def _history_call(raw: Any, index: int, names: dict[str, str]) -> dict[str, Any]:
    """An assistant's earlier tool call, with its JSON-string arguments parsed to an object."""
    if not isinstance(raw, dict) or not isinstance(raw.get("function"), dict):
        raise APIError(400, "invalid tool call: expected an object with a function")
    fn = raw["function"]
    name = field_of(fn, "name", str, "")
    args = parse_arguments(fn.get("arguments"))
    call: dict[str, Any] = {"function": {"index": index, "name": name, "arguments": args}}
    if call_id := field_of(raw, "id", str):
        call["id"] = call_id
        names[call_id] = name
    return call


def _message(m: Any, names: dict[str, str]) -> dict[str, Any]:
    if not isinstance(m, dict):
        raise APIError(400, "invalid message: expected an object")
    role = _ROLES.get(field_of(m, "role", str, "").lower())
    if role is None:
        raise APIError(400, f"invalid message role {m.get('role')!r}")
    out: dict[str, Any] = {"role": role}
    out["content"] = joined_text(m.get("content"), "message", _TEXT_PARTS)
    if role == "assistant":
        # OpenAI-style servers send thinking back as `reasoning` or `reasoning_content`
        thinking = m.get("reasoning") or m.get("reasoning_content")
        if isinstance(thinking, str) and thinking:
            out["thinking"] = thinking
        calls = field_of(m, "tool_calls", list) or []
        if calls:
            out["tool_calls"] = [_history_call(c, i, names) for i, c in enumerate(calls)]
    if role == "tool" and (call_id := field_of(m, "tool_call_id", str)):
        out["tool_call_id"] = call_id
        if call_id in names:
            out["tool_name"] = names[call_id]
    return out


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    raw = field_of(body, "messages", list, [])
    if not raw:
        raise APIError(400, "[] is too short - 'messages'")
    names: dict[str, str] = {}  # tool-call id -> tool name, for the results that follow
    return [_message(m, names) for m in raw]


def _format(body: dict[str, Any]) -> str | dict[str, Any] | None:
    rf = field_of(body, "response_format", dict)
    kind = rf.get("type") if rf else None
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "invalid response_format: json_schema.schema must be an object")
        return check_format(schema)
    raise APIError(400, f"invalid response_format type {kind!r}")


def _think(body: dict[str, Any]) -> bool | str | None:
    effort = field_of(body, "reasoning_effort", str)
    if effort is None and (reasoning := field_of(body, "reasoning", dict)):
        effort = reasoning.get("effort")
    return think_for_effort(effort)


def _top_logprobs(top: int | None) -> int:
    if top is not None and not 0 <= top <= 20:
        raise APIError(400, "top_logprobs must be between 0 and 20")
    return top or 0


def _stream_options(body: dict[str, Any]) -> bool:
    return bool((field_of(body, "stream_options", dict) or {}).get("include_usage"))


def chat_request(body: dict[str, Any]) -> V1Call:
    """A /v1/chat/completions body as an Ollama chat request."""
    model = _model(body)
    tools = check_tools(field_of(body, "tools", list) or []) or None
    choice = tool_choice(body.get("tool_choice"))
    if choice == "none":
        tools = None  # "none": the model is not offered the tools at all
    req = ChatRequest(
        model=model,
        stream=field_of(body, "stream", bool, False),
        format=_format(body),
        options=sampling_options(body, max_keys=_MAX_KEYS, stop_key="stop", defaults=True),
        think=_think(body),
        messages=_messages(body),
        tools=tools,
        logprobs=field_of(body, "logprobs", bool, False),
        top_logprobs=_top_logprobs(field_of(body, "top_logprobs", int)),
    )
    extra = req.runner_fields()
    if tools and choice is not None:
        extra["tool_choice"] = choice
    parallel = field_of(body, "parallel_tool_calls", bool)
    if tools and parallel is not None:  # unset: a forced answer is one call, auto any number
        extra["parallel_tool_calls"] = parallel
    return V1Call(req, extra, _stream_options(body))


def completion_request(body: dict[str, Any]) -> V1Call:
    """A /v1/completions body as an Ollama generate request."""
    model = _model(body)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise APIError(400, "invalid prompt: expected a string")
    top = field_of(body, "logprobs", int)  # here an int: how many alternatives per token
    req = GenerateRequest(
        model=model,
        stream=field_of(body, "stream", bool, False),
        options=sampling_options(body, max_keys=("max_tokens",), stop_key="stop", defaults=True),
        prompt=prompt,
        suffix=field_of(body, "suffix", str),
        logprobs=top is not None,
        top_logprobs=_top_logprobs(top),
    )
    return V1Call(req, req.runner_fields(), _stream_options(body))


@v1_handler(openai_error)
async def chat_completions(request: Request) -> Response:
    svc = services(request)
    call = chat_request(parse_json(await request.body()))
    req = call.req
    plan = await completion.prepare(svc, req)
    # a stream gets tool-call arguments as they are generated, not only once a call is whole
    body = completion.chat_body(plan, req, **call.extra, stream_tool_calls=bool(req.stream))
    events = completion.events(svc, plan, None, body)
    stream = ChatStream(req.model, call.include_usage) if req.stream else None
    return reply(events, stream, lambda out: chat_completion(req.model, out), openai_error)


@v1_handler(openai_error)
async def completions(request: Request) -> Response:
    svc = services(request)
    call = completion_request(parse_json(await request.body()))
    req = call.req
    plan = await completion.prepare(svc, req)
    body = completion.generate_body(plan, req, **call.extra)
    events = completion.events(svc, plan, None, body)
    stream = CompletionStream(req.model, call.include_usage) if req.stream else None
    return reply(events, stream, lambda out: text_completion(req.model, out), openai_error)


def _model_object(name: str, created: float) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": int(created),
        "owned_by": Name.parse(name).namespace,
    }


@v1_handler(openai_error)
async def list_models(request: Request) -> Response:
    models = await run_in_threadpool(services(request).store.list_models)
    data = [
        _model_object(m["name"], datetime.fromisoformat(m["modified_at"]).timestamp())
        for m in models
    ]
    return JSONResponse({"object": "list", "data": data})


@v1_handler(openai_error)
async def retrieve_model(request: Request) -> Response:
    view = await resolve(services(request), request.path_params["model"])
    return JSONResponse(_model_object(view.display, view.modified_at))
