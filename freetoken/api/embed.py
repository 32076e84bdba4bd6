"""Embeddings: POST /api/embed, /api/embeddings (the older form) and /v1/embeddings.

All three lease the model like a completion and ask its runner for `POST /embed`: each
input's final hidden states, mean-pooled over its tokens. `embed_texts` is the shared call;
/api/embed and /v1/embeddings get L2-normalised vectors, /api/embeddings the raw mean (as
Ollama's older endpoint gives).
"""

from __future__ import annotations

import base64
import struct
import time
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response

from freetoken.api import completion
from freetoken.api.compat import openai_error, v1_handler
from freetoken.api.errors import APIError, handler
from freetoken.api.sse import JSONResult
from freetoken.api.state import Services, services
from freetoken.api.types import (
    EmbeddingsRequest,
    EmbedRequest,
    GenerateRequest,
    field_of,
    parse_json,
)
from freetoken.server.runner import RunnerError, refusal

__all__ = ["Embedded", "embed", "embed_texts", "embeddings", "v1_embeddings"]


@dataclass
class Embedded:
    embeddings: list[list[float]]
    prompt_eval_count: int  # tokens read, over all inputs
    total_ns: int
    load_ns: int


async def _runner_embed(socket: str, body: dict[str, Any]) -> dict[str, Any]:
    transport = httpx.AsyncHTTPTransport(uds=socket)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://runner") as client:
            r = await client.post("/embed", json=body, timeout=httpx.Timeout(10.0, read=None))
    except httpx.TransportError as e:
        raise RunnerError(f"lost the connection to the model runner: {e}") from None
    if r.status_code != 200:
        raise refusal(r.status_code, r.content)
    return r.json()


async def embed_texts(
    svc: Services,
    model: str,
    inputs: list[str],
    *,
    truncate: bool = True,
    dimensions: int | None = None,
    keep_alive: float | None = None,
    options: dict[str, Any] | None = None,
    normalize: bool = True,
) -> Embedded:
    """Embeds `inputs` with `model` (loading it if need be; no inputs only loads it)."""
    start = time.monotonic_ns()
    plan = await completion.prepare(svc, GenerateRequest(model=model, options=options or {}))
    lease = await svc.residency.acquire(plan.view, plan.spec, keep_alive)
    try:
        if not inputs:
            return Embedded([], 0, time.monotonic_ns() - start, int(lease.load_duration * 1e9))
        body = {
            "input": inputs,
            "truncate": truncate,
            "dimensions": dimensions,
            "normalize": normalize,
            "options": plan.options,
        }
        out = await _runner_embed(str(lease.runner.socket), body)
    finally:
        lease.release()
    return Embedded(
        out["embeddings"],
        int(out.get("prompt_eval_count") or 0),
        time.monotonic_ns() - start,
        int(lease.load_duration * 1e9),
    )


@handler
async def embed(request: Request) -> Response:
    req = EmbedRequest.parse(parse_json(await request.body()))
    svc = services(request)

    async def make() -> dict[str, Any]:
        got = await embed_texts(
            svc,
            req.model,
            req.input,
            truncate=req.truncate,
            dimensions=req.dimensions,
            keep_alive=req.keep_alive,
            options=req.options,
        )
        return {
            "model": req.model,
            "embeddings": got.embeddings,
            "total_duration": got.total_ns,
            "load_duration": got.load_ns,
            "prompt_eval_count": got.prompt_eval_count,
        }

    return JSONResult(make, completion.ollama_error)


@handler
async def embeddings(request: Request) -> Response:
    req = EmbeddingsRequest.parse(parse_json(await request.body()))
    svc = services(request)

    async def make() -> dict[str, Any]:
        got = await embed_texts(
            svc,
            req.model,
            [req.prompt] if req.prompt else [],
            keep_alive=req.keep_alive,
            options=req.options,
            normalize=False,
        )
        return {"embedding": got.embeddings[0] if got.embeddings else []}

    return JSONResult(make, completion.ollama_error)


def _v1_input(value: Any) -> list[str]:
    if isinstance(value, str) and value:
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return list(value)
    if isinstance(value, list) and value and all(isinstance(v, (int, list)) for v in value):
        raise APIError(400, "invalid input type: token arrays are not supported")
    raise APIError(400, "invalid input")


def _base64(vec: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()


@v1_handler(openai_error)
async def v1_embeddings(request: Request) -> Response:
    """POST /v1/embeddings (OpenAI's shape; `encoding_format` "float" or "base64")."""
    body = parse_json(await request.body())
    model = field_of(body, "model", str, "")
    if not model:
        raise APIError(400, "model is required")
    encoding = field_of(body, "encoding_format", str, "float")
    if encoding not in ("float", "base64"):
        raise APIError(400, f'invalid encoding_format "{encoding}": must be "float" or "base64"')
    dims = field_of(body, "dimensions", int)
    if dims is not None and dims <= 0:
        raise APIError(400, "dimensions must be a positive integer")
    inputs, svc = _v1_input(body.get("input")), services(request)

    async def make() -> dict[str, Any]:  # inside the response: a hangup ends the model's wait
        got = await embed_texts(svc, model, inputs, dimensions=dims)
        data = [
            {
                "object": "embedding",
                "embedding": _base64(v) if encoding == "base64" else v,
                "index": i,
            }
            for i, v in enumerate(got.embeddings)
        ]
        usage = {"prompt_tokens": got.prompt_eval_count, "total_tokens": got.prompt_eval_count}
        return {"object": "list", "data": data, "model": model, "usage": usage}

    return JSONResult(make, openai_error)
