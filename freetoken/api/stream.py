"""NDJSON responses from an async iterator of JSON objects, with Ollama's error rules.

An error raised before the first object becomes a plain `{"error": ...}` response with its
status code; once streaming has begun it becomes one final `{"error": ...}` line. With
`stream: false` the objects are reduced to one, and any error keeps its status code. A client
that disconnects cancels the iterator, so a generation in a runner stops with it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.types import Receive, Scope, Send

from freetoken import jsonline
from freetoken.api.errors import as_api_error

__all__ = ["NDJSONResponse", "dumps", "last", "until_disconnect"]

Reduce = Callable[[list[dict[str, Any]]], dict[str, Any]]


def dumps(obj: Any) -> bytes:
    return jsonline.dumps_bytes(obj)


def last(items: list[dict[str, Any]]) -> dict[str, Any]:
    return items[-1] if items else {}


async def until_disconnect(receive: Receive, work: Callable[[], Awaitable[None]]) -> None:
    """Runs `work`, cancelling it if the client disconnects first (which stops generation)."""
    async with anyio.create_task_group() as tg:

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(watch_disconnect)
        await work()
        tg.cancel_scope.cancel()


class NDJSONResponse:
    def __init__(
        self, items: AsyncIterator[dict[str, Any]], *, stream: bool = True, reduce: Reduce = last
    ):
        self.items = items
        self.stream = stream
        self.reduce = reduce

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await until_disconnect(
                receive, lambda: self._stream(send) if self.stream else self._whole(send)
            )
        finally:
            aclose = getattr(self.items, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()

    async def _start(self, send: Send, status: int, media_type: str) -> None:
        headers = [(b"content-type", media_type.encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})

    async def _error(self, send: Send, exc: Exception) -> None:
        err = as_api_error(exc)
        await self._start(send, err.status, "application/json; charset=utf-8")
        await send({"type": "http.response.body", "body": dumps({"error": err.message})})

    async def _stream(self, send: Send) -> None:
        it = aiter(self.items)
        started = False
        while True:
            try:
                item = await anext(it)
            except StopAsyncIteration:
                break
            except Exception as e:
                if not started:
                    await self._error(send, e)
                    return
                item = {"error": as_api_error(e).message}
            if not started:
                await self._start(send, 200, "application/x-ndjson")
                started = True
            await send(
                {"type": "http.response.body", "body": dumps(item) + b"\n", "more_body": True}
            )
            if "error" in item:
                break
        if not started:
            await self._start(send, 200, "application/x-ndjson")
        await send({"type": "http.response.body", "body": b""})

    async def _whole(self, send: Send) -> None:
        try:
            items = [item async for item in self.items]
        except Exception as e:
            await self._error(send, e)
            return
        await self._start(send, 200, "application/json; charset=utf-8")
        await send({"type": "http.response.body", "body": dumps(self.reduce(items))})
