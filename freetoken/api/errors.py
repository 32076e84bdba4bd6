"""Errors as Ollama sends them: `{"error": "<message>"}` with an HTTP status.

Handlers raise; `handler` turns what they raise into the response, so no exception from bad
input reaches the server loop.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from freetoken.options import OptionError
from freetoken.pull import RegistryError
from freetoken.server.residency import ModelTooLarge, ServerBusy
from freetoken.server.runner import RunnerError, RunnerRequestError
from freetoken.store import CreateError, DigestMismatch, FilesNotVisible, InvalidName, ModelNotFound

__all__ = [
    "APIError",
    "BodyTooLarge",
    "JSONBody",
    "as_api_error",
    "error_response",
    "handler",
    "shaped_handler",
]

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error with the status and message the client should get."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class BodyTooLarge(Exception):
    """A request body past the size the server accepts (FREETOKEN_MAX_REQUEST_SIZE)."""

    def __init__(self, limit: int):
        super().__init__(f"request body too large (more than {limit} bytes)")


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_MESSAGE = "no space left on device while writing to the model store"


class JSONBody(JSONResponse):
    """A JSON response that renders whatever text it holds: a string that cannot be UTF-8
    (a lone surrogate echoed from a request) becomes '?', never an exception that would turn
    the answer into a plain-text 500 and reset the connection."""

    def render(self, content: Any) -> bytes:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return text.encode("utf-8", "replace")


def error_response(status: int, message: str) -> JSONResponse:
    return JSONBody({"error": message}, status_code=status)


def as_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ModelNotFound):
        return APIError(404, str(exc))
    if isinstance(exc, RegistryError):
        return APIError(exc.status, str(exc))
    if isinstance(exc, FilesNotVisible):  # the client's cue to upload the files instead
        return APIError(412, str(exc))
    if isinstance(exc, (InvalidName, OptionError, CreateError, DigestMismatch)):
        return APIError(400, str(exc))
    if isinstance(exc, ServerBusy):
        return APIError(503, str(exc))
    if isinstance(exc, ModelTooLarge):  # Ollama answers a model too large for memory so
        return APIError(500, str(exc))
    if isinstance(exc, RunnerRequestError):
        return APIError(exc.status, str(exc))
    if isinstance(exc, RunnerError):
        return APIError(500, str(exc))
    if isinstance(exc, ClientDisconnect):
        return APIError(499, "request canceled")
    if isinstance(exc, BodyTooLarge):
        return APIError(413, str(exc))
    if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
        return APIError(507, DISK_FULL_MESSAGE)
    log.exception("unexpected error", exc_info=exc)
    return APIError(500, str(exc) or type(exc).__name__)


Handler = Callable[[Request], Awaitable[Response]]


def shaped_handler(error_body: Callable[[APIError], dict]) -> Callable[[Handler], Handler]:
    """Wraps route handlers so that whatever they raise becomes an error response whose body
    is the API's own shape (Ollama's, OpenAI's, Anthropic's)."""

    def wrap(fn: Handler) -> Handler:
        @functools.wraps(fn)
        async def wrapped(request: Request) -> Response:
            try:
                return await fn(request)
            except Exception as e:
                err = as_api_error(e)
                return JSONBody(error_body(err), status_code=err.status)

        return wrapped

    return wrap


handler = shaped_handler(lambda err: {"error": err.message})
handler.__doc__ = 'Ollama\'s error shape: {"error": message} with the status.'
