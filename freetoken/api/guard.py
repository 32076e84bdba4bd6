"""The outermost guard of the routes: a bound on request bodies, and an error in the API's own
shape for whatever a route lets escape.

Plain ASGI (not BaseHTTPMiddleware), like the Host guard and CORS, so streamed responses
pass untouched. A body past the limit is refused from its Content-Length before a byte of
it is read, or, sent without one, as soon as it grows past the limit (the handler reading
it gets `BodyTooLarge`, which its error wrapper answers with 413). Blob uploads carry
model weights and are not bounded. An exception that reaches this guard before the
response started becomes a JSON error in the shape of the API the path belongs to
(Ollama's `{"error"}`, OpenAI's `error` object, Anthropic's `invalid_request_error`
family): never Starlette's plain-text 500, which also drops a keep-alive connection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from freetoken.api.anthropic import anthropic_error
from freetoken.api.compat import openai_error
from freetoken.api.errors import APIError, BodyTooLarge, JSONBody, as_api_error

__all__ = ["RequestGuard", "error_shape"]

log = logging.getLogger(__name__)

ErrorBody = Callable[[APIError], dict[str, Any]]
_UNBOUNDED = ("/api/blobs/",)  # weights, gigabytes each


def _ollama_error(err: APIError) -> dict[str, Any]:
    return {"error": err.message}


def error_shape(path: str) -> ErrorBody:
    """The error body of the API `path` belongs to."""
    if path.startswith("/v1/messages"):
        return anthropic_error
    if path.startswith("/v1/"):
        return openai_error
    return _ollama_error


class RequestGuard:
    def __init__(self, app: ASGIApp, max_body: int):
        self.app = app
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        shape = error_shape(scope["path"])
        if not scope["path"].startswith(_UNBOUNDED):
            if self._declared(scope) > self.max_body:
                await self._refuse(send, shape, BodyTooLarge(self.max_body))
                return
            receive = self._bounded(receive)
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as e:
            if started:  # the status is sent: all that is left is to end the body cleanly
                log.exception("error after the response started", exc_info=e)
                await send({"type": "http.response.body", "body": b""})
                return
            await self._refuse(send, shape, e)

    @staticmethod
    def _declared(scope: Scope) -> int:
        for key, value in scope["headers"]:
            if key == b"content-length" and value.isdigit():
                return int(value)
        return 0

    def _bounded(self, receive: Receive) -> Receive:
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise BodyTooLarge(self.max_body)
            return message

        return bounded

    @staticmethod
    async def _refuse(send: Send, shape: ErrorBody, exc: Exception) -> None:
        err = as_api_error(exc)
        response = JSONBody(shape(err), status_code=err.status)
        await send(
            {"type": "http.response.start", "status": err.status, "headers": response.raw_headers}
        )
        await send({"type": "http.response.body", "body": response.body})
