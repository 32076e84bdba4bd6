"""The Starlette application: every route in one list, plus the app factory."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from freetoken import config
from freetoken.api import anthropic, cache, completion, embed, ollama, openai, responses
from freetoken.api.guard import RequestGuard
from freetoken.api.middleware import CORS, HostGuard, is_loopback_bind
from freetoken.api.state import Services
from freetoken.server.residency import Residency
from freetoken.store import Store

__all__ = ["create_app", "routes"]

routes = [
    Route("/", ollama.root, methods=["GET"]),
    Route("/api/version", ollama.version, methods=["GET"]),
    Route("/api/tags", ollama.tags, methods=["GET"]),
    Route("/api/show", ollama.show, methods=["POST"]),
    Route("/api/ps", ollama.ps, methods=["GET"]),
    Route("/api/loading", ollama.loading, methods=["GET"]),
    Route("/api/cache", cache.cache, methods=["GET"]),
    Route("/api/cache/resize", cache.resize, methods=["POST"]),
    Route("/api/generate", completion.generate, methods=["POST"]),
    Route("/api/chat", completion.chat, methods=["POST"]),
    Route("/api/embed", embed.embed, methods=["POST"]),
    Route("/api/embeddings", embed.embeddings, methods=["POST"]),
    Route("/api/create", ollama.create, methods=["POST"]),
    Route("/api/blobs/{digest}", ollama.blob_exists, methods=["HEAD"]),
    Route("/api/blobs/{digest}", ollama.blob_upload, methods=["POST"]),
    Route("/api/copy", ollama.copy, methods=["POST"]),
    Route("/api/delete", ollama.delete, methods=["DELETE"]),
    Route("/api/pull", ollama.pull, methods=["POST"]),
    Route("/api/push", ollama.push, methods=["POST"]),
    Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
    Route("/v1/completions", openai.completions, methods=["POST"]),
    Route("/v1/embeddings", embed.v1_embeddings, methods=["POST"]),
    Route("/v1/models", openai.list_models, methods=["GET"]),
    # names may hold '/' (namespace/model:tag), so the rest of the path is the name
    Route("/v1/models/{model:path}", openai.retrieve_model, methods=["GET"]),
    Route("/v1/responses", responses.responses, methods=["POST"]),
    Route("/v1/messages", anthropic.messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
]


async def _not_found(request: Request, exc: Exception) -> Response:
    return PlainTextResponse("404 page not found", status_code=404)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return PlainTextResponse(exc.detail, status_code=exc.status_code, headers=exc.headers)


async def _method_not_allowed(request: Request, exc: Exception) -> Response:
    headers = getattr(exc, "headers", None)
    return PlainTextResponse("405 method not allowed", status_code=405, headers=headers)


def create_app(
    cfg: Any = None,
    store: Store | None = None,
    residency: Residency | None = None,
    spare: bool = False,
) -> Starlette:
    """The app for `cfg` (default: this process's settings); stopping it stops the runners.
    `spare`: keep a runner started ahead (`freetoken serve` asks, FREETOKEN_WARM_START).

    Requests pass the Host-header guard (only when `cfg.host` is a loopback address), CORS
    (`freetoken.api.middleware`) and the request guard (`freetoken.api.guard`: body size,
    errors in the API's own shape) before the routes."""
    cfg = cfg or config.current()
    svc = Services(cfg=cfg, store=store or Store(cfg.models), residency=residency or Residency(cfg))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if spare:
            await svc.residency.start_spare()
        try:
            yield
        finally:
            await svc.residency.shutdown()

    # The host guard runs first: a rebinding page is refused before CORS can answer it;
    # the request guard last, so its answers carry CORS headers too.
    middleware = [
        Middleware(HostGuard, enabled=is_loopback_bind(cfg.host.host)),
        Middleware(CORS, origins=cfg.origins),
        Middleware(RequestGuard, max_body=cfg.max_request_size),
    ]
    app = Starlette(
        routes=routes,
        middleware=middleware,
        lifespan=lifespan,
        exception_handlers={404: _not_found, 405: _method_not_allowed, HTTPException: _http_error},
    )
    app.state.services = svc
    return app
