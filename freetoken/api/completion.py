"""POST /api/generate and /api/chat, and the machinery every completion route shares.

A request is checked, its options merged (request > Modelfile PARAMETERs > defaults), the
model leased from the residency, and the runner's events turned into chunks. The lease is
released when the response ends, however it ends. The OpenAI, Anthropic and Responses
routes build the same requests and call `prepare`, `chat_body`/`generate_body` and
`events` here, so every API behaves alike underneath.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response

from freetoken import options as opts
from freetoken.api.errors import APIError, handler
from freetoken.api.sse import JSONResult
from freetoken.api.state import Services, resolve, services
from freetoken.api.stream import NDJSONResponse
from freetoken.api.types import (
    ChatRequest,
    GenerateRequest,
    chat_chunk,
    generate_chunk,
    metrics,
    now,
    parse_json,
    reduce_chat,
    reduce_generate,
)
from freetoken.protocol import CompletionRequest
from freetoken.server.residency import default_num_ctx
from freetoken.server.runner import RunnerError, RunnerSpec, refusal
from freetoken.store import ModelView

__all__ = [
    "Plan",
    "chat",
    "chat_body",
    "chat_messages",
    "count_tokens",
    "events",
    "generate",
    "generate_body",
    "prepare",
]


@dataclass
class Plan:
    """A request resolved against its model: the runner to use and the options to send."""

    view: ModelView
    capabilities: list[str]
    options: dict[str, Any]
    spec: RunnerSpec
    think_budgets: dict[str, int]  # think level -> thinking tokens at most (the settings')

    def thinking(self, think: Any, extra: dict[str, Any]) -> dict[str, Any]:
        """The runner field of a think level's budget, unless the request has its own
        (Anthropic's budget_tokens) or gives no level."""
        budget = self.think_budgets.get(think) if isinstance(think, str) else None
        return {"think_budget": budget} if budget and "think_budget" not in extra else {}


def _plan(svc: Services, view: ModelView, request_options: dict[str, Any]) -> Plan:
    store = svc.store
    merged = opts.merge(view.params, request_options)
    num_ctx = default_num_ctx(
        merged.get("num_ctx"), store.context_length(view), svc.cfg.context_length
    )
    merged["num_ctx"] = num_ctx
    load = {k: merged[k] for k in sorted(opts.LOAD_OPTIONS - {"num_ctx"}) if k in merged}
    spec = RunnerSpec(view.display, store.runner_files(view), num_ctx, svc.cfg.num_parallel, load)
    return Plan(view, store.capabilities(view), merged, spec, svc.cfg.think_budgets)


async def prepare(svc: Services, req: GenerateRequest | ChatRequest) -> Plan:
    """Resolves the model and checks the request against what its template supports."""
    view = await resolve(svc, req.model)
    plan = await run_in_threadpool(_plan, svc, view, req.options)
    if req.think not in (None, False) and "thinking" not in plan.capabilities:
        raise APIError(400, f'"{req.model}" does not support thinking')
    if getattr(req, "suffix", None) and "insert" not in plan.capabilities:
        raise APIError(400, f"{view.name} does not support insert")
    if getattr(req, "tools", None) and "tools" not in plan.capabilities:
        raise APIError(400, f"{view.name} does not support tools")
    return plan


def ollama_error(err: APIError) -> dict[str, Any]:
    return {"error": err.message}


def _load_or_unload(
    svc: Services, plan: Plan, keep_alive: float | None, answer: dict[str, Any]
) -> JSONResult:
    """An empty prompt loads the model; with keep_alive 0 it unloads it instead. Awaited
    inside the response, so a client that hangs up while the model loads (or waits its turn)
    ends the wait: nobody is left to load it for."""

    async def make() -> dict[str, Any]:
        if keep_alive == 0:
            await svc.residency.unload(plan.view)
            return {
                "model": answer["model"],
                "created_at": now(),
                **answer,
                "done_reason": "unload",
            }
        lease = await svc.residency.acquire(plan.view, plan.spec, keep_alive)
        lease.release()
        return {"model": answer["model"], "created_at": now(), **answer, "done_reason": "load"}

    return JSONResult(make, ollama_error)


async def events(
    svc: Services, plan: Plan, keep_alive: float | None, body: CompletionRequest
) -> AsyncIterator[dict[str, Any]]:
    """The runner's events; the done event gains `total_ns` and `load_ns`."""
    start = time.monotonic_ns()
    lease = await svc.residency.acquire(plan.view, plan.spec, keep_alive)
    try:
        async with aclosing(lease.runner.completion(body)) as stream:
            async for event in stream:
                if event.get("done"):
                    event = {
                        **event,
                        "total_ns": time.monotonic_ns() - start,
                        "load_ns": int(lease.load_duration * 1e9),
                    }
                yield event
    finally:
        lease.release()


async def count_tokens(svc: Services, plan: Plan, body: CompletionRequest) -> int:
    """The prompt length of a runner request, rendered and tokenized by the runner itself."""
    lease = await svc.residency.acquire(plan.view, plan.spec, None)
    transport = httpx.AsyncHTTPTransport(uds=str(lease.runner.socket))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://runner") as client:
            r = await client.post("/tokenize", json=body.to_json(), timeout=60.0)
    except httpx.TransportError as e:
        raise RunnerError(f"lost the connection to the model runner: {e}") from None
    finally:
        lease.release()
    if r.status_code != 200:
        raise refusal(r.status_code, r.content)
    return int(r.json()["count"])


def _final(model: str, key: str, value: Any, event: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": model,
        "created_at": now(),
        key: value,
        "done": True,
        "done_reason": event.get("done_reason") or "stop",
    }


async def _generate_chunks(
    req: GenerateRequest, events: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[dict[str, Any]]:
    async with aclosing(events) as stream:
        async for event in stream:
            if not event.get("done"):
                yield generate_chunk(req.model, event)
                continue
            final = _final(req.model, "response", "", event)
            if not req.raw and event.get("context") is not None:
                final["context"] = event["context"]
            yield final | metrics(event, event["total_ns"], event["load_ns"])


async def _chat_chunks(
    req: ChatRequest, events: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[dict[str, Any]]:
    async with aclosing(events) as stream:
        async for event in stream:
            if set(event) <= {"tool_call_truncated", "streamed"}:
                continue  # Ollama has no shape for a call the limit cut: done_reason says it
            if not event.get("done"):
                yield chat_chunk(req.model, event)
                continue
            final = _final(req.model, "message", {"role": "assistant", "content": ""}, event)
            yield final | metrics(event, event["total_ns"], event["load_ns"])


def generate_body(plan: Plan, req: GenerateRequest, **extra: Any) -> CompletionRequest:
    """The runner's /completion request for a generate; `extra` sets fields beyond Ollama's."""
    view = plan.view
    return CompletionRequest(
        kind="generate",
        prompt=req.prompt,
        suffix=req.suffix,
        system=None if req.raw else (req.system if req.system is not None else view.system),
        raw=req.raw,
        template=None if req.raw else (req.template or view.template),
        think=req.think,
        format=req.format,
        context=req.context,
        truncate=True if req.truncate is None else req.truncate,
        options=plan.options,
        **extra,
        **plan.thinking(req.think, extra),
    )


@handler
async def generate(request: Request) -> Response:
    svc = services(request)
    req = GenerateRequest.parse(parse_json(await request.body()))
    plan = await prepare(svc, req)
    if not req.prompt and not req.suffix:
        return _load_or_unload(
            svc,
            plan,
            req.keep_alive,
            {
                "model": req.model,
                "response": "",
                "done": True,
            },
        )
    body = generate_body(plan, req, **req.runner_fields())
    chunks = _generate_chunks(req, events(svc, plan, req.keep_alive, body))
    return NDJSONResponse(chunks, stream=req.stream, reduce=reduce_generate)


def chat_messages(view: ModelView, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Modelfile's MESSAGEs, then the request's; the Modelfile SYSTEM goes first unless
    the request starts with its own system message."""
    out = [dict(m) for m in view.messages] + messages
    if view.system and not (messages and messages[0]["role"] == "system"):
        out.insert(0, {"role": "system", "content": view.system})
    return out


def chat_body(plan: Plan, req: ChatRequest, **extra: Any) -> CompletionRequest:
    """The runner's /completion request for a chat; `extra` sets fields beyond Ollama's."""
    return CompletionRequest(
        kind="chat",
        messages=chat_messages(plan.view, req.messages),
        template=plan.view.template,
        tools=req.tools,
        think=req.think,
        format=req.format,
        truncate=True if req.truncate is None else req.truncate,
        options=plan.options,
        **extra,
        **plan.thinking(req.think, extra),
    )


@handler
async def chat(request: Request) -> Response:
    svc = services(request)
    req = ChatRequest.parse(parse_json(await request.body()))
    plan = await prepare(svc, req)
    if not req.messages:
        return _load_or_unload(
            svc,
            plan,
            req.keep_alive,
            {
                "model": req.model,
                "message": {"role": "assistant", "content": ""},
                "done": True,
            },
        )
    body = chat_body(plan, req, **req.runner_fields())
    chunks = _chat_chunks(req, events(svc, plan, req.keep_alive, body))
    return NDJSONResponse(chunks, stream=req.stream, reduce=reduce_chat)
