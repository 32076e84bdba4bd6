"""The HTTP side of pull and push: the registry API of docs/architecture.md over httpx.

Every failure leaves this module as a `RegistryError` with the message the user should
read and the HTTP status the API should answer with. `transport` is the seam for tests
(httpx.MockTransport, or a wrapper that counts or slows the bytes of a real one).
"""

from __future__ import annotations

import contextlib
import json
import platform
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx

import freetoken
from freetoken.pull.auth import Challenge, RegistryAuth
from freetoken.pull.wire import is_loopback
from freetoken.store import manifest as mf

__all__ = ["RegistryClient", "RegistryError", "TransientError"]

_CONNECT_TIMEOUT_S = 10.0
_MANIFEST_ACCEPT = f"{mf.MANIFEST}, application/vnd.oci.image.manifest.v1+json"


class RegistryError(RuntimeError):
    """A pull or push that cannot go on; `status` is what /api/pull and /api/push answer."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class TransientError(RegistryError):
    """The connection broke or the registry answered 5xx: worth another try."""


def _oci_message(response: httpx.Response) -> str:
    """`CODE: message` from an OCI error body, else the status line."""
    try:
        errors = json.loads(response.content).get("errors") or []
        first = errors[0]
        return f"{first.get('code', 'UNKNOWN')}: {first.get('message', '')}".rstrip(": ")
    except (ValueError, AttributeError, IndexError, TypeError):
        text = response.text.strip()[:200]
        return f"{response.status_code} {response.reason_phrase}" + (f": {text}" if text else "")


class RegistryClient:
    """One connection pool to one registry; safe to share between threads."""

    def __init__(
        self,
        base_url: str,
        token: str = "",
        *,
        transport: httpx.BaseTransport | None = None,
        read_timeout: float = 30.0,
        max_connections: int = 16,
        key_file: Path | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.key_file = key_file
        self.auth = RegistryAuth(key_file)
        headers = {
            "User-Agent": f"freetoken/{freetoken.__version__} ({platform.machine()} "
            f"{platform.system().lower()}) Python/{platform.python_version()}"
        }
        if token:
            headers["Authorization"] = f"Bearer {token}"
        # A read that waits `read_timeout` for a byte is a stalled transfer: the caller retries.
        timeout = httpx.Timeout(read_timeout, connect=_CONNECT_TIMEOUT_S)
        limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
        # HTTP(S)_PROXY and NO_PROXY apply, as for Ollama, except to a loopback registry.
        local = is_loopback(httpx.URL(self.base_url).netloc.decode())
        self.http = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=timeout,
            limits=limits,
            transport=transport,
            follow_redirects=True,
            trust_env=not local,
            # Bearer challenges answered with a token the user's key signs for, as Ollama's
            auth=self.auth,
        )

    def close(self) -> None:
        self.http.close()

    # -- requests --------------------------------------------------------------------------

    def _request(self, method: str, url: str, **kw: Any) -> httpx.Response:
        try:
            response = self.http.request(method, url, **kw)
        except httpx.TransportError as e:
            raise self._transport_error(e) from None
        return self._check(response, method, url)

    @contextlib.contextmanager
    def _stream(self, method: str, url: str, **kw: Any) -> Iterator[httpx.Response]:
        try:
            with self.http.stream(method, url, **kw) as response:
                if response.status_code >= 400:
                    response.read()
                yield self._check(response, method, url)
        except httpx.TransportError as e:
            raise self._transport_error(e) from None

    def _transport_error(self, e: httpx.TransportError) -> RegistryError:
        text = str(e) or type(e).__name__
        tls = self.base_url.startswith("https:")
        if isinstance(e, httpx.ConnectError) and "SSL" in text and tls:
            return RegistryError(
                f"cannot speak https to {self.base_url}: {text} "
                "(use --insecure for a plain-http registry)",
                502,
            )
        return TransientError(f"registry {self.base_url}: {text}", 502)

    def _check(self, response: httpx.Response, method: str, url: str) -> httpx.Response:
        status = response.status_code
        if status < 400:
            return response
        if status in (401, 403):
            if self.auth.refused or Challenge.parse(response.headers.get("WWW-Authenticate", "")):
                hint = (
                    f"the registry refused the key {self.key_file} (its public key, in "
                    f"{self.key_file}.pub, may need adding to your account there)"
                )
            elif self.token:
                hint = "the registry rejected the token in FREETOKEN_REGISTRY_TOKEN"
            else:
                hint = "the registry needs a token: set FREETOKEN_REGISTRY_TOKEN"
            raise RegistryError(f"unauthorized: {method} {self.base_url}{url}: {hint}", 401)
        message = f"registry {self.base_url}: {method} {url}: {_oci_message(response)}"
        if status >= 500 or status == 429:
            raise TransientError(message, 502)
        raise RegistryError(message, 502)

    # -- manifests -------------------------------------------------------------------------

    def manifest(self, repo: str, tag: str) -> bytes:
        """The manifest bytes; an unknown model or tag is Ollama's error."""
        url = f"/v2/{repo}/manifests/{tag}"
        try:
            response = self.http.get(url, headers={"Accept": _MANIFEST_ACCEPT})
        except httpx.TransportError as e:
            raise self._transport_error(e) from None
        if response.status_code == 404:
            raise RegistryError("pull model manifest: file does not exist", 404)
        return self._check(response, "GET", url).content

    def put_manifest(self, repo: str, tag: str, data: bytes) -> None:
        self._request(
            "PUT",
            f"/v2/{repo}/manifests/{tag}",
            content=data,
            headers={"Content-Type": mf.MANIFEST},
        )

    # -- blobs -----------------------------------------------------------------------------

    def has_blob(self, repo: str, digest: str) -> bool:
        url = f"/v2/{repo}/blobs/{digest}"
        try:
            response = self.http.head(url)
        except httpx.TransportError as e:
            raise self._transport_error(e) from None
        if response.status_code == 404:
            return False
        self._check(response, "HEAD", url)
        return True

    @contextlib.contextmanager
    def blob_range(self, repo: str, digest: str, start: int, end: int) -> Iterator[httpx.Response]:
        """A streaming response for bytes [start, end) of a blob (end > start)."""
        url = f"/v2/{repo}/blobs/{digest}"
        # identity: the bytes written at their offsets must be the blob's, not a re-encoding.
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        with self._stream("GET", url, headers=headers) as response:
            if response.status_code == 206:
                _check_content_range(response, start, end)
            elif not (response.status_code == 200 and start == 0):
                # A 200 answers with the whole blob; only the first part can use that.
                raise RegistryError(
                    f"registry {self.base_url} ignored a Range request for {digest}", 502
                )
            yield response

    # -- uploads ---------------------------------------------------------------------------

    def start_upload(self, repo: str) -> str:
        response = self._request("POST", f"/v2/{repo}/blobs/uploads/")
        return self._location(response)

    def upload_chunk(self, location: str, chunks: Iterable[bytes], start: int, length: int) -> str:
        """PATCHes `length` bytes at offset `start`; returns where the upload goes on."""
        headers = {
            "Content-Type": "application/octet-stream",
            "Content-Length": str(length),
            "Content-Range": f"{start}-{start + length - 1}",
        }
        response = self._request("PATCH", location, content=chunks, headers=headers)
        return self._location(response, default=location)

    def finish_upload(self, location: str, digest: str) -> None:
        # merged, not replaced: a registry's location carries its own state in the query
        # (the distribution registry's `_state`), which `params=` would drop
        url = str(httpx.URL(location).copy_merge_params({"digest": digest}))
        self._request("PUT", url, content=b"", headers={"Content-Length": "0"})

    def _location(self, response: httpx.Response, default: str | None = None) -> str:
        headers = response.headers
        location = headers.get("Docker-Upload-Location") or headers.get("Location")
        if not location:
            if default is not None:
                return default
            raise RegistryError(
                f"registry {self.base_url} started an upload without a Location", 502
            )
        # Relative locations are resolved against the registry, absolute ones used as given.
        return str(self.http.base_url.join(location)) if location.startswith("/") else location


def _check_content_range(response: httpx.Response, start: int, end: int) -> None:
    value = response.headers.get("Content-Range", "")
    want = f"bytes {start}-{end - 1}/"
    if not value.startswith(want):
        raise RegistryError(
            f"registry answered Content-Range {value!r} for bytes {start}-{end - 1}", 502
        )
