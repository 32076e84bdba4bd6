"""Registry authentication as Ollama's client does it: a 401 whose `WWW-Authenticate` is a
Bearer challenge (realm, service, scope) is answered by asking the realm for a token, the
request signed with the user's ed25519 key; the original request is then sent again with
`Authorization: Bearer <token>`.

The token request is `GET <realm>?service=…&scope=…&ts=<unix seconds>&nonce=<random>` with
`Authorization: <public key>:<signature>`, where the public key is the base64 blob of the
OpenSSH public key (as in `id_ed25519.pub`) and the signature is ed25519 over
`GET,<that URL>,<base64 of the hex SHA-256 of the empty body>`. The key is an OpenSSH
private key file; Ollama's (`~/.ollama/id_ed25519`) is used where it exists, so a key
registered with Ollama's registry works here too.
"""

from __future__ import annotations

import base64
import hashlib
import re
import secrets
import threading
import time
import urllib.parse
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = [
    "Challenge",
    "RegistryAuth",
    "load_or_create_key",
    "public_key",
    "sign",
    "signed_payload",
    "verify",
]

_PARAM = re.compile(r'(\w+)="([^"]*)"')
EMPTY_BODY_DIGEST = base64.b64encode(hashlib.sha256(b"").hexdigest().encode()).decode()


@dataclass(frozen=True)
class Challenge:
    realm: str
    service: str
    scope: str

    @classmethod
    def parse(cls, header: str) -> Challenge | None:
        """The Bearer challenge of a `WWW-Authenticate` value; None for anything else, or a
        realm that is not a URL (a registry that only wants a fixed token)."""
        scheme, _, rest = header.strip().partition(" ")
        if scheme.lower() != "bearer":
            return None
        params = dict(_PARAM.findall(rest))
        realm = params.get("realm", "")
        if not realm.startswith(("http://", "https://")):
            return None
        return cls(realm, params.get("service", ""), params.get("scope", ""))

    def token_url(self, now: float | None = None, nonce: str | None = None) -> str:
        query = [("service", self.service)]
        query += [("scope", s) for s in self.scope.split(" ") if s]
        query += [
            ("ts", str(int(time.time() if now is None else now))),
            ("nonce", nonce or base64.urlsafe_b64encode(secrets.token_bytes(16)).decode()),
        ]
        sep = "&" if "?" in self.realm else "?"
        return self.realm + sep + urllib.parse.urlencode(query)


def signed_payload(method: str, url: str) -> bytes:
    return f"{method},{url},{EMPTY_BODY_DIGEST}".encode()


def load_or_create_key(path: Path):
    """The ed25519 private key in `path` (OpenSSH format), made with its .pub if missing."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if path.exists():
        key = serialization.load_ssh_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path} is not an ed25519 key")
        return key
    key = Ed25519PrivateKey.generate()
    path.parent.mkdir(parents=True, exist_ok=True)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.OpenSSH,
        serialization.NoEncryption(),
    )
    tmp = path.with_suffix(".tmp")
    tmp.touch(mode=0o600)
    tmp.write_bytes(pem)
    tmp.replace(path)
    path.with_name(path.name + ".pub").write_text(f"ssh-ed25519 {public_key(key)}\n")
    return key


def public_key(key) -> str:
    """The base64 blob of the OpenSSH public key (the middle word of `id_ed25519.pub`)."""
    from cryptography.hazmat.primitives import serialization

    line = key.public_key().public_bytes(
        serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH
    )
    return line.split()[1].decode()


def sign(key, data: bytes) -> str:
    """`<public key>:<base64 signature>`: the Authorization value of a token request."""
    return f"{public_key(key)}:{base64.b64encode(key.sign(data)).decode()}"


def verify(authorization: str, data: bytes) -> str | None:
    """The public key blob that signed `data`, or None where the signature does not check."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization

    blob, _, signature = authorization.strip().partition(":")
    try:
        key = serialization.load_ssh_public_key(f"ssh-ed25519 {blob}".encode())
        key.verify(base64.b64decode(signature, validate=True), data)
    except (ValueError, TypeError, InvalidSignature, AttributeError):
        return None
    return blob


class RegistryAuth(httpx.Auth):
    """Answers Bearer challenges with a token signed for by the key in `key_file` (loaded,
    or made, at the first challenge) and sends it again with later requests it covers.

    Tokens are kept by the scope they were asked for: a push's uploads run in parallel with
    its checks, and a token for pulling alone must never replace one for pushing (an upload
    whose streamed body met a 401 could not be sent again)."""

    def __init__(self, key_file: Path | None):
        self.key_file = key_file
        self._tokens: dict[str, str] = {}  # challenge scope -> token
        self.refused: str | None = None  # what the realm said to the last refused request
        self._lock = threading.Lock()

    def _covering(self, request: httpx.Request) -> str | None:
        parts = request.url.path.split("/")
        repo = "/".join(parts[2:4]) if len(parts) > 4 and parts[1] == "v2" else ""
        push = request.method not in ("GET", "HEAD")
        with self._lock:
            for scope, token in self._tokens.items():
                if f"repository:{repo}:" in scope and (not push or "push" in scope):
                    return token
        return None

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        token = self._covering(request)
        if token and "Authorization" not in request.headers:
            request.headers["Authorization"] = f"Bearer {token}"
        response = yield request
        challenge = Challenge.parse(response.headers.get("WWW-Authenticate", ""))
        if response.status_code != 401 or challenge is None or self.key_file is None:
            return
        url = challenge.token_url()
        with self._lock:
            key = load_or_create_key(self.key_file)
        token_request = httpx.Request(
            "GET", url, headers={"Authorization": sign(key, signed_payload("GET", url))}
        )
        answer = yield token_request
        answer.read()
        if answer.status_code != 200:
            self.refused = answer.text.strip()[:300] or f"status {answer.status_code}"
            return  # this answer is the caller's: RegistryClient reports it
        try:
            token = str(answer.json()["token"])
        except (ValueError, KeyError, TypeError):
            return
        with self._lock:
            self._tokens[challenge.scope] = token
        request.headers["Authorization"] = f"Bearer {token}"
        yield request
