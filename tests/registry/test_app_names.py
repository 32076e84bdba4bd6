"""Hostile names and digests: every request is refused or stays inside the root.

Requests go over a raw socket so that dot segments and percent escapes reach the server
exactly as written (an HTTP client would normalise them away).
"""

from __future__ import annotations

import hashlib
import random
import socket
from pathlib import Path

from tests.registry.conftest import digest_of, manifest_for, push_blob

SECRET = b"TOP-SECRET-OUTSIDE-THE-ROOT"
SECRET_HEX = hashlib.sha256(SECRET).hexdigest()

HOSTILE_NAMES = [
    "..",
    ".",
    "...",
    "%2e%2e",
    "%2E%2E",
    "%2e",
    "..%2f..",
    "..%2F..%2Fsecret",
    "%2f",
    "a%2fb",
    "..%5c..",
    "a%5cb",
    "%00",
    "a%00b",
    "~",
    ".hidden",
    "-lead",
    ".-",
    "a%20b",
    "%c3%a9",
    "a" * 81,
    "a:b",
    "a@b",
    "a;b",
    "%2a",
    "a%3fb",
    "a%23b",
    "%0d%0aX-Evil:%201",
]
HOSTILE_DIGESTS = [
    "..",
    "sha256:..",
    "sha256:%2e%2e%2fsecret",
    "sha256-" + "a" * 63,
    "sha256:" + "a" * 65,
    "sha256:" + "g" * 64,
    "sha512:" + "a" * 128,
    "md5:" + "a" * 32,
    "sha256:" + "a" * 64 + "%2f..",
    "sha256%3a" + "a" * 64 + "%00",
    "%2e%2e%2f%2e%2e%2fsecret",
    "sha256:%20" + "a" * 64,
    "..%2f..%2fblobs%2fsha256-" + SECRET_HEX,
]


def raw_request(port: int, method: str, target: str, body: bytes = b"") -> tuple[int, bytes]:
    head = (
        f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(head.encode("latin-1") + body)
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
    return int(data.split(b" ", 2)[1]), data


def plant_secrets(base: Path) -> None:
    """Files just outside the root, where a path escape would land."""
    (base / "secret").write_bytes(SECRET)
    for rel in (f"blobs/sha256-{SECRET_HEX}", "manifests/ns/m/latest", "ns/m/latest", "latest"):
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / rel).write_bytes(SECRET)


def snapshot(base: Path, root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in base.rglob("*")
        if root not in (p, *p.parents)
    }


def requests_for(part: str, digest: str, manifest: bytes) -> list[tuple[str, str, bytes]]:
    """The routes with `part` in every name position and `digest` in every digest one."""
    out = []
    for ns, model in ((part, "m"), ("ns", part), (part, part)):
        repo = f"/v2/{ns}/{model}"
        out += [
            ("GET", f"{repo}/manifests/latest", b""),
            ("PUT", f"{repo}/manifests/latest", manifest),
            ("GET", f"{repo}/tags/list", b""),
            ("HEAD", f"{repo}/blobs/{digest_of(SECRET)}", b""),
            ("POST", f"{repo}/blobs/uploads/", b""),
        ]
    return out + [
        ("GET", f"/v2/ns/m/manifests/{part}", b""),
        ("HEAD", f"/v2/ns/m/manifests/{part}", b""),
        ("PUT", f"/v2/ns/m/manifests/{part}", manifest),
        ("PATCH", f"/v2/ns/m/blobs/uploads/{part}", b"x"),
        ("PUT", f"/v2/ns/m/blobs/uploads/{part}?digest={digest_of(b'x')}", b"x"),
        ("GET", f"/v2/ns/m/blobs/{digest}", b""),
        ("HEAD", f"/v2/ns/m/blobs/{digest}", b""),
        ("GET", f"/v2/ns/m/manifests/{digest}", b""),
        ("POST", f"/v2/ns/m/blobs/uploads/?digest={digest}", b"x"),
        ("POST", f"/v2/ns/m/blobs/uploads/?mount={digest}&from=..%2f..", b""),
    ]


def _setup(registry, client) -> tuple[bytes, Path]:
    base = registry.root.parent
    plant_secrets(base)
    config = b"{}"
    push_blob(client, "ns/m", config)
    return manifest_for(config), base


def test_hostile_names_and_digests_are_refused(registry, client):
    manifest, base = _setup(registry, client)
    before = snapshot(base, registry.root)
    for part, digest in zip(HOSTILE_NAMES, HOSTILE_DIGESTS * 3):
        for method, target, body in requests_for(part, digest, manifest):
            status, answer = raw_request(registry.port, method, target, body)
            assert 400 <= status < 500, (method, target, status, answer)
            assert SECRET not in answer, (method, target)
    for digest in HOSTILE_DIGESTS:
        for method, target, body in requests_for("ok", digest, manifest)[-6:]:
            status, answer = raw_request(registry.port, method, target, body)
            assert 400 <= status < 500, (method, target, status, answer)
    assert snapshot(base, registry.root) == before
    assert list((registry.root / "manifests").rglob("*")) == []
    assert list((registry.root / "uploads").iterdir()) == []
    assert client.get("/v2/_catalog").json() == {"repositories": []}


def test_random_names_never_escape_the_root(registry, client):
    manifest, base = _setup(registry, client)
    before = snapshot(base, registry.root)
    rng = random.Random(1234)
    pieces = [
        "..",
        ".",
        "/",
        "%2e",
        "%2f",
        "%5c",
        "%00",
        "a",
        "B",
        "_",
        "-",
        ":",
        "@",
        "sha256",
        "~",
        "%20",
        "latest",
        SECRET_HEX[:8],
    ]
    for _ in range(60):
        part = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 5)))
        digest = rng.choice([*HOSTILE_DIGESTS, "sha256:" + part, part])
        for method, target, body in requests_for(part, digest, manifest):
            status, answer = raw_request(registry.port, method, target, body)
            assert status < 500, (method, target, status, answer)
            assert SECRET not in answer, (method, target)
    assert snapshot(base, registry.root) == before
    # Whatever a random name did create is a manifest at a legal place under the root.
    for path in (registry.root / "manifests").rglob("*"):
        rel = path.relative_to(registry.root / "manifests").parts
        assert path.is_dir() or len(rel) == 3, path
        assert all(p[0].isalnum() or p[0] == "_" for p in rel), path
