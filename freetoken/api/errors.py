"""Errors as Ollama sends them: `{"error": "<message>"}` with an HTTP status.

Handlers raise; `handler` turns what they raise into the response, so no exception from bad
input reaches the server loop.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from freetoken.options import OptionError
from freetoken.pull import RegistryError
from freetoken.server.residency import ModelTooLarge, ServerBusy
from freetoken.server.runner import RunnerError, RunnerRequestError
from freetoken.store import CreateError, DigestMismatch, FilesNotVisible, InvalidName, ModelNotFound

__all__ = ["APIError", "as_api_error", "error_response", "handler"]

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error with the status and message the client should get."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


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
                return JSONResponse(error_body(err), status_code=err.status)

        return wrapped

    return wrap


handler = shaped_handler(lambda err: {"error": err.message})
handler.__doc__ = 'Ollama\'s error shape: {"error": message} with the status.'
