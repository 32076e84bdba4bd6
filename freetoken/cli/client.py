"""The CLI's view of the server: JSON calls, NDJSON streams and blob transfers over httpx.

Every failure reaches the caller as one of two exceptions, so commands never handle
httpx errors themselves: `NotRunning` (nothing answers at the address) and `ServerError`
(the server answered with an error, before or during a stream).
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from freetoken.cli.errors import NotRunning, ServerError

__all__ = ["Client"]

_CHUNK = 1 << 20


def _error_message(response: httpx.Response) -> str:
    text = response.text
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("error"):
        err = body["error"]
        # The /v1 routes nest the message; accept both shapes.
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    return text.strip() or f"{response.status_code} {response.reason_phrase}"


def _parse_line(line: str) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except ValueError:
        raise ServerError(f"unexpected response from server: {line[:200]!r}") from None
    if not isinstance(obj, dict):
        raise ServerError(f"unexpected response from server: {line[:200]!r}")
    if obj.get("error"):
        raise ServerError(str(obj["error"]))
    return obj


class Client:
    """One connection pool to the server at `base_url` (default: FREETOKEN_HOST)."""

    def __init__(
        self, base_url: str | None = None, *, transport: httpx.BaseTransport | None = None
    ) -> None:
        if base_url is None:
            from freetoken import config

            base_url = config.current().host.url
        self.base_url = base_url.rstrip("/")
        # Loading a large model can take minutes before the first byte, so reads never time
        # out; a proxy named in the environment must not sit between us and a local server.
        self.http = httpx.Client(
            base_url=self.base_url,
            transport=transport,
            trust_env=False,
            timeout=httpx.Timeout(None, connect=10.0),
        )

    def close(self) -> None:
        self.http.close()

    @property
    def is_local(self) -> bool:
        """The server is on this machine (a loopback address): it may read files in place."""
        host = httpx.URL(self.base_url).host
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    def _send(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kw)
        except httpx.ConnectError:
            raise NotRunning(self.base_url) from None
        except httpx.TransportError as e:
            raise ServerError(f"connection to the server failed: {e}") from None
        if response.status_code >= 400:
            raise ServerError(_error_message(response), response.status_code)
        return response

    def heartbeat(self) -> None:
        self._send("HEAD", "/")

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """A JSON request; returns the decoded body, or None when it is empty."""
        response = self._send(method, path, json=body)
        if not response.content.strip():
            return None
        try:
            return response.json()
        except ValueError:
            raise ServerError(f"unexpected response from server: {response.text[:200]!r}") from None

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """POSTs `body` and yields each NDJSON object; an `error` line raises ServerError.

        Closing the generator (or an exception in the consumer, such as Ctrl-C) closes
        the HTTP response, which is how the server learns to cancel the request.
        """
        try:
            with self.http.stream("POST", path, json=body) as response:
                if response.status_code >= 400:
                    response.read()
                    raise ServerError(_error_message(response), response.status_code)
                for line in response.iter_lines():
                    if line.strip():
                        yield _parse_line(line)
        except httpx.ConnectError:
            raise NotRunning(self.base_url) from None
        except httpx.TransportError as e:
            raise ServerError(f"connection to the server was lost: {e}") from None

    def blob_exists(self, digest: str) -> bool:
        try:
            self._send("HEAD", f"/api/blobs/{digest}")
        except ServerError as e:
            if e.status == 404:
                return False
            raise
        return True

    def upload_blob(
        self, digest: str, path: Path, progress: Callable[[int], None] | None = None
    ) -> None:
        """Streams the file as the raw request body; `progress` gets the bytes sent so far."""
        size = path.stat().st_size

        def chunks() -> Iterator[bytes]:
            sent = 0
            with path.open("rb") as f:
                while block := f.read(_CHUNK):
                    sent += len(block)
                    yield block
                    if progress:
                        progress(sent)

        self._send(
            "POST",
            f"/api/blobs/{digest}",
            content=chunks(),
            headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"},
        )
