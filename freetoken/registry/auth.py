"""Challenge mode: the registry asks for tokens as Ollama's registry does, so the client's
handshake (freetoken/pull/auth.py) is tested against a server that checks it.

Every request under /v2/<namespace>/<model>/ without a valid token is answered 401 with
`WWW-Authenticate: Bearer realm="<server>/token",service="…",scope="repository:<repo>:<actions>"`.
`GET /token` checks the request's ed25519 signature (over `GET,<url>,<empty body digest>`,
with a timestamp no older than five minutes) and answers `{"token": …}`: a grant of the
scope's actions on the repository, signed with a secret of this process, for an hour.
Pulls are granted to any key that signs; pushes only to the keys listed in the keys file
(a key registered with the registry), when one is given.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from freetoken.pull.auth import signed_payload, verify

__all__ = ["ChallengeAuth", "Guard", "token_endpoint"]

SERVICE = "freetoken-registry"
_REPO = re.compile(r"^/v2/([^/]+/[^/]+)/(?:manifests|blobs|tags)/")
_SCOPE = re.compile(r"^repository:([^:]+/[^:]+):([a-z,]+)$")
_MAX_SKEW_S = 300
_TOKEN_S = 3600


@dataclass
class ChallengeAuth:
    """The tokens of one registry process; `keys`: the public key blobs allowed to push
    (None: any key that signs)."""

    keys: set[str] | None = None
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))

    @classmethod
    def from_keys_file(cls, path: Path | None) -> ChallengeAuth:
        if path is None:
            return cls()
        words = [line.split() for line in path.read_text().splitlines() if line.strip()]
        return cls({w[1] if len(w) > 1 else w[0] for w in words if not w[0].startswith("#")})

    def grant(self, repo: str, actions: list[str], key: str) -> str:
        body = json.dumps(
            {"repo": repo, "actions": actions, "key": key, "exp": time.time() + _TOKEN_S}
        )
        payload = base64.urlsafe_b64encode(body.encode()).decode()
        mac = hmac.new(self.secret, payload.encode(), hashlib.sha256).hexdigest()
        return f"{payload}.{mac}"

    def allows(self, token: str, repo: str, action: str) -> bool:
        payload, _, mac = token.partition(".")
        want = hmac.new(self.secret, payload.encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(mac, want):
            return False
        grant = json.loads(base64.urlsafe_b64decode(payload))
        return grant["repo"] == repo and action in grant["actions"] and grant["exp"] > time.time()


def _challenge(request_url: str, repo: str, action: str) -> Response:
    base = request_url.split("/v2/", 1)[0]
    actions = "pull" if action == "pull" else "pull,push"
    header = f'Bearer realm="{base}/token",service="{SERVICE}",scope="repository:{repo}:{actions}"'
    body = {"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]}
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": header})


class Guard:
    """ASGI middleware: repository requests need a token granting their action."""

    def __init__(self, app: ASGIApp, auth: ChallengeAuth):
        self.app, self.auth = app, auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        m = _REPO.match(scope.get("path", "")) if scope["type"] == "http" else None
        if m is not None:
            request = Request(scope)
            action = "pull" if request.method in ("GET", "HEAD") else "push"
            given = request.headers.get("authorization", "")
            token = given[7:].strip() if given.lower().startswith("bearer ") else ""
            if not (token and self.auth.allows(token, m.group(1), action)):
                await _challenge(str(request.url), m.group(1), action)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def token_endpoint(auth: ChallengeAuth) -> Callable[[Request], Awaitable[Response]]:
    """GET /token: a signed token request answered with a grant of its scope."""

    async def endpoint(request: Request) -> Response:
        return _token(auth, request)

    return endpoint


def _token(auth: ChallengeAuth, request: Request) -> Response:
    q = request.query_params
    key = verify(request.headers.get("authorization", ""), signed_payload("GET", str(request.url)))
    if key is None:
        return _error(401, "the token request's signature does not check")
    try:
        stale = abs(time.time() - int(q.get("ts", "0"))) > _MAX_SKEW_S
    except ValueError:
        stale = True
    if stale or not q.get("nonce"):
        return _error(401, "the token request is stale or has no nonce")
    m = _SCOPE.match(q.get("scope", ""))
    if q.get("service") != SERVICE or m is None:
        return _error(400, "unknown service or scope")
    actions = m.group(2).split(",")
    if "push" in actions and auth.keys is not None and key not in auth.keys:
        return _error(403, "this key may not push here: add its public key to the keys file")
    return JSONResponse({"token": auth.grant(m.group(1), actions, key)})


def _error(status: int, message: str) -> Response:
    return JSONResponse(
        {"errors": [{"code": "UNAUTHORIZED", "message": message}]}, status_code=status
    )
