"""OCI-style error answers: `{"errors": [{"code": ..., "message": ..., "detail": ...}]}`."""

from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

__all__ = ["RegistryError", "error_response", "handlers"]


class RegistryError(Exception):
    """An answer with an OCI error code; raised anywhere in a handler."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: dict[str, str] | None = None,
        detail: Any = None,
    ):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}
        self.detail = detail


def error_response(exc: RegistryError) -> Response:
    error: dict[str, Any] = {"code": exc.code, "message": exc.message}
    if exc.detail is not None:
        error["detail"] = exc.detail
    return JSONResponse({"errors": [error]}, status_code=exc.status, headers=exc.headers)


async def _registry_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RegistryError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    # Unknown paths and methods answer in the same shape as everything else.
    assert isinstance(exc, HTTPException)
    code = {404: "NOT_FOUND", 405: "UNSUPPORTED"}.get(exc.status_code, "UNKNOWN")
    return error_response(
        RegistryError(exc.status_code, code, str(exc.detail), dict(exc.headers or {}))
    )


handlers = {RegistryError: _registry_error, HTTPException: _http_error}
