"""What every request passes before it reaches a route: the Host-header guard and CORS.

Both are plain ASGI middleware (not BaseHTTPMiddleware), so streamed responses and the
disconnect watch of `NDJSONResponse` go through untouched.

- `HostGuard` blocks DNS rebinding: a page on a hostile domain that resolves to 127.0.0.1
  could otherwise drive a server that listens only on loopback. While the server is bound to
  a loopback address, the Host header must name a loopback, private or unspecified IP,
  `localhost`, a `*.localhost`, `*.local` or `*.internal` name, or this machine's hostname;
  anything else is a 403. A server bound to all interfaces (or a public address) is meant
  to be reached by name and is not guarded.
- `CORS` lets browser pages on the allowed origins call the API: the settings' origins
  (FREETOKEN_ORIGINS / OLLAMA_ORIGINS, `*` wildcards allowed) plus local pages and app
  shells (`ALLOWED_ORIGINS`). A preflight (OPTIONS with an Origin) is answered 204 with the
  allowed methods and headers; a request from an origin not allowed is a 403, as Ollama
  does, so a foreign page cannot even send a "simple" request that changes the store.
  Requests without an Origin, or from the server's own origin, are not CORS and pass.

Authorization headers are never checked: clients send API keys (`ollama-local`, an
OLLAMA_API_KEY, an OpenAI or Anthropic key) that a local server ignores.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "ALLOWED_HEADERS",
    "ALLOWED_METHODS",
    "ALLOWED_ORIGINS",
    "CORS",
    "HostGuard",
    "host_allowed",
    "is_loopback_bind",
    "origin_pattern",
]

# Local pages on any port, and the schemes desktop and editor app shells load pages from.
ALLOWED_ORIGINS: tuple[str, ...] = (
    "http://localhost",
    "https://localhost",
    "http://localhost:*",
    "https://localhost:*",
    "http://127.0.0.1",
    "https://127.0.0.1",
    "http://127.0.0.1:*",
    "https://127.0.0.1:*",
    "http://0.0.0.0",
    "https://0.0.0.0",
    "http://0.0.0.0:*",
    "https://0.0.0.0:*",
    "app://*",
    "file://*",
    "tauri://*",
    "vscode-webview://*",
    "vscode-file://*",
)

ALLOWED_METHODS: tuple[str, ...] = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")

# What the Ollama, OpenAI and Anthropic SDKs send from a browser.
ALLOWED_HEADERS: tuple[str, ...] = (
    "Authorization",
    "Content-Type",
    "User-Agent",
    "Accept",
    "X-Requested-With",
    "OpenAI-Beta",
    "x-api-key",
    "anthropic-version",
    "anthropic-beta",
    "anthropic-dangerous-direct-browser-access",
    "x-stainless-arch",
    "x-stainless-async",
    "x-stainless-custom-poll-interval",
    "x-stainless-helper-method",
    "x-stainless-lang",
    "x-stainless-os",
    "x-stainless-package-version",
    "x-stainless-poll-helper",
    "x-stainless-retry-count",
    "x-stainless-runtime",
    "x-stainless-runtime-version",
    "x-stainless-timeout",
)

_MAX_AGE = str(12 * 3600)  # how long a browser may cache a preflight answer
_LOCAL_SUFFIXES = (".localhost", ".local", ".internal")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key == name:
            return value.decode("latin-1")
    return None


async def _plain(
    send: Send, status: int, body: bytes = b"", headers: Iterable[tuple[bytes, bytes]] = ()
) -> None:
    head = [*headers]
    if body:
        head.append((b"content-type", b"text/plain; charset=utf-8"))
    head.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


# -- DNS-rebinding guard ----------------------------------------------------------------


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text.strip("[]").split("%", 1)[0])
    except ValueError:
        return None


def is_loopback_bind(host: str) -> bool:
    """Whether a server bound to `host` (an IP or a name) listens on loopback only."""
    ip = _ip(host)
    if ip is not None:
        return ip.is_loopback
    name = host.lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    if not name:
        return False
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    addrs = [_ip(str(info[4][0])) for info in infos]
    return bool(addrs) and all(a is not None and a.is_loopback for a in addrs)


def _split_host(value: str) -> str:
    """The host part of a Host header: `name`, `name:port`, `[v6]` or `[v6]:port`."""
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        return value.split(":", 1)[0]
    return value  # no port, or a bare IPv6 address


def host_allowed(header: str | None, hostname: str) -> bool:
    """Whether a Host header may reach a loopback-bound server on the machine `hostname`."""
    host = _split_host((header or "").strip()).lower()
    if host.endswith(".") and not host.endswith(".."):
        host = host[:-1]
    ip = _ip(host)
    if ip is not None:
        return ip.is_loopback or ip.is_private or ip.is_unspecified
    return (
        host in ("", "localhost")
        or (bool(hostname) and host == hostname.lower())
        or host.endswith(_LOCAL_SUFFIXES)
    )


class HostGuard:
    """403 for a Host header that no local client would send, while bound to loopback."""

    def __init__(self, app: ASGIApp, *, enabled: bool, hostname: str | None = None):
        self.app = app
        self.enabled = enabled
        self.hostname = socket.gethostname() if hostname is None else hostname

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self.enabled
            and scope["type"] == "http"
            and not host_allowed(_header(scope, b"host"), self.hostname)
        ):
            await _plain(send, 403, b"403 Forbidden")
            return
        await self.app(scope, receive, send)


# -- CORS ----------------------------------------------------------------------------------


def _origin_regex(origin: str) -> str:
    if origin == "*":
        return ".*"
    # A trailing `:*` is any port: "http://localhost:*" must not match "http://localhost:1.evil".
    any_port = origin.endswith(":*") and "://" in origin[:-2]
    body = origin[:-2] if any_port else origin
    regex = ".*".join(map(re.escape, body.split("*")))
    return regex + r":\d+" if any_port else regex


def origin_pattern(origins: Iterable[str]) -> re.Pattern[str]:
    """One regex for origin patterns: `*` stands for any run of characters (a trailing `:*`
    for any port), and a lone `*` allows every origin. Case-insensitive, like host names."""
    parts = [_origin_regex(o) for o in origins]
    return re.compile("|".join(f"(?:{p})" for p in parts) or "(?!)", re.IGNORECASE)


class CORS:
    """Cross-origin access for the allowed origins; a preflight is answered here, 204."""

    def __init__(self, app: ASGIApp, *, origins: Iterable[str] = ()):
        self.app = app
        self.allowed = origin_pattern([*ALLOWED_ORIGINS, *origins])

    def _same_origin(self, origin: str, scope: Scope) -> bool:
        host = _header(scope, b"host")
        return bool(host) and origin.lower() in (
            f"http://{host}".lower(),
            f"https://{host}".lower(),
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        origin = _header(scope, b"origin") if scope["type"] == "http" else None
        if not origin or self._same_origin(origin, scope):
            await self.app(scope, receive, send)
            return
        if not self.allowed.fullmatch(origin):
            await _plain(send, 403, b"403 Forbidden")
            return
        common = [
            (b"access-control-allow-origin", origin.encode("latin-1")),
            (b"vary", b"Origin"),
        ]
        if scope["method"] == "OPTIONS":
            await _plain(
                send,
                204,
                headers=[
                    *common,
                    (b"access-control-allow-methods", ", ".join(ALLOWED_METHODS).encode()),
                    (b"access-control-allow-headers", ", ".join(ALLOWED_HEADERS).encode()),
                    (b"access-control-max-age", _MAX_AGE.encode()),
                ],
            )
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (k, v)
                    for k, v in message.get("headers", ())
                    if k.lower() != b"access-control-allow-origin"
                ]
                message = {**message, "headers": [*headers, *common]}
            await send(message)

        await self.app(scope, receive, send_with_cors)
