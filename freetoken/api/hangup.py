"""A model request whose client hangs up stops waiting: its handler is cancelled.

Starlette notices a client gone only when a streaming response writes; a handler waiting
for its model's load (or in the queue behind other requests) waits on. After a burst of
requests whose clients gave up, those waits would still load, reload and hold the model for
nobody, minutes after the clients left. Ollama ends such a request with its client's context;
this does the same for the routes that run a model. The handler is cancelled only while its
response is unfinished, so a completed exchange's cleanup always runs.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["MODEL_ROUTES", "CancelOnHangup"]

MODEL_ROUTES = frozenset(
    {
        "/api/chat",
        "/api/generate",
        "/api/embed",
        "/api/embeddings",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/messages",
        "/v1/messages/count_tokens",
    }
)


class CancelOnHangup:
    def __init__(self, app: ASGIApp, paths: frozenset[str] = MODEL_ROUTES):
        self.app, self.paths = app, paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        body_read, finished = asyncio.Event(), asyncio.Event()

        async def recv() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                body_read.set()
            return message

        async def snd(message: Message) -> None:
            # set before the last write: the server reports the client gone once it is done
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                finished.set()
            await send(message)

        async def hung_up() -> None:
            # only after the handler has the whole body: the watch must not take a part of it
            await body_read.wait()
            while (await receive())["type"] != "http.disconnect":
                pass

        handler = asyncio.ensure_future(self.app(scope, recv, snd))
        watch = asyncio.ensure_future(hung_up())
        try:
            await asyncio.wait({handler, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not handler.done() and not finished.is_set():
                handler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await handler
        finally:
            watch.cancel()
            handler.cancel()  # a no-op once it is done; else the server is stopping this one
