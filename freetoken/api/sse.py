"""Responses for the /v1 routes: server-sent events, and JSON computed while the client waits.

Both do their work while watching the connection, so a client that leaves cancels the work
and with it the generation in the runner. An error raised before the first event becomes a
JSON error body with its status code (the API's own error shape); once events have been sent
it becomes the stream's own error frame, and the stream ends.

SSE frames are produced by one task and written by another, so that a stream that stays
silent for a while (a long prefill, thinking that is not shown) can be kept alive with a
`ping` frame without interrupting the producer.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from starlette.types import Receive, Scope, Send

from freetoken import jsonline
from freetoken.api.errors import APIError, as_api_error
from freetoken.api.stream import until_disconnect

__all__ = ["DONE", "JSONResult", "SSEResponse", "event", "json_bytes"]

ErrorBody = Callable[[APIError], dict[str, Any]]
ErrorFrame = Callable[[APIError], bytes]

DONE = b"data: [DONE]\n\n"


def json_bytes(obj: Any) -> bytes:
    return jsonline.dumps_bytes(obj)


def event(data: Any, name: str | None = None) -> bytes:
    """One SSE frame: an optional `event:` line, then the JSON `data:` line."""
    head = f"event: {name}\n".encode() if name else b""
    return head + b"data: " + json_bytes(data) + b"\n\n"


async def _send_json(send: Send, status: int, body: Any) -> None:
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": json_bytes(body)})


class JSONResult:
    """A JSON answer computed by `make` inside the response, so a disconnect cancels it."""

    def __init__(self, make: Callable[[], Awaitable[dict[str, Any]]], error_body: ErrorBody):
        self.make = make
        self.error_body = error_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def work() -> None:
            try:
                body = await self.make()
            except Exception as e:
                err = as_api_error(e)
                await _send_json(send, err.status, self.error_body(err))
                return
            await _send_json(send, 200, body)

        await until_disconnect(receive, work)


@dataclass
class _Failed:
    error: APIError


class SSEResponse:
    """`text/event-stream` from an async iterator of ready-made frames.

    `error_body` shapes an error that happens before the first frame (sent as JSON with its
    status); `error_frame` one that happens later. With `ping`, that frame is sent whenever
    nothing else was sent for `ping_after` seconds once the stream has begun.
    """

    def __init__(
        self,
        frames: AsyncIterator[bytes],
        *,
        error_body: ErrorBody,
        error_frame: ErrorFrame,
        ping: bytes | None = None,
        ping_after: float = 10.0,
    ):
        self.frames = frames
        self.error_body = error_body
        self.error_frame = error_frame
        self.ping = ping
        self.ping_after = ping_after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sender, receiver = anyio.create_memory_object_stream[Any](0)

        async def work() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._produce, sender)
                await self._relay(receiver, send)
                tg.cancel_scope.cancel()

        with receiver:
            await until_disconnect(receive, work)

    async def _produce(self, sender: MemoryObjectSendStream[Any]) -> None:
        # The frames are iterated and closed in this task only: the generators below hold
        # the runner's connection, and closing them is what cancels the generation.
        frames = self.frames
        async with sender:
            try:
                async for frame in frames:
                    await sender.send(frame)
            except Exception as e:
                await sender.send(_Failed(as_api_error(e)))
            finally:
                aclose = getattr(frames, "aclose", None)
                if aclose is not None:
                    with anyio.CancelScope(shield=True):
                        await aclose()

    async def _relay(self, receiver: MemoryObjectReceiveStream[Any], send: Send) -> None:
        started = False
        while True:
            wait = self.ping_after if started and self.ping else math.inf
            try:
                with anyio.move_on_after(wait) as scope:
                    item = await receiver.receive()
            except anyio.EndOfStream:
                break
            if scope.cancelled_caught:
                await self._body(send, self.ping or b"")
                continue
            if isinstance(item, _Failed):
                if not started:
                    err = item.error
                    await _send_json(send, err.status, self.error_body(err))
                    return
                await self._body(send, self.error_frame(item.error))
                break
            if not started:
                await self._start(send)
                started = True
            await self._body(send, item)
        if not started:
            await self._start(send)
        await send({"type": "http.response.body", "body": b""})

    async def _start(self, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

    async def _body(self, send: Send, data: bytes) -> None:
        await send({"type": "http.response.body", "body": data, "more_body": True})
