"""A real registry on loopback (uvicorn in a thread of the test process) and httpx helpers."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from freetoken.registry import create_app

MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class LiveRegistry:
    """One uvicorn server on loopback for the whole session; `serve(root, token)` points it
    at a fresh app, so each test gets its own registry without a server start and stop."""

    def __init__(self) -> None:
        self.root: Path | None = None
        self.app: Any = None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            self._dispatch,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="off",
            interface="asgi3",
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    async def _dispatch(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)

    def serve(self, root: Path, token: str | None = None) -> LiveRegistry:
        self.root = root
        self.app = create_app(root, token)
        return self

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("registry did not start")
            time.sleep(0.005)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def client(self, token: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=10)


@pytest.fixture(scope="session")
def live_registry() -> Iterator[LiveRegistry]:
    server = LiveRegistry()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def registry(live_registry: LiveRegistry, tmp_path: Path) -> LiveRegistry:
    return live_registry.serve(tmp_path / "root")


@pytest.fixture
def client(registry: LiveRegistry) -> Iterator[httpx.Client]:
    with registry.client() as c:
        yield c


def push_blob(client: httpx.Client, repo: str, data: bytes, chunk: int | None = None) -> str:
    """Uploads `data` in chunks of `chunk` bytes (PATCH with Content-Range), then finishes."""
    r = client.post(f"/v2/{repo}/blobs/uploads/")
    assert r.status_code == 202, r.text
    location = r.headers["Location"]
    step = chunk or max(len(data), 1)
    for start in range(0, len(data), step):
        part = data[start : start + step]
        r = client.patch(
            location, content=part, headers={"Content-Range": f"{start}-{start + len(part) - 1}"}
        )
        assert r.status_code == 202, r.text
        assert r.headers["Range"] == f"0-{start + len(part) - 1}"
        location = r.headers["Location"]
    digest = digest_of(data)
    r = client.put(location, params={"digest": digest})
    assert r.status_code == 201, r.text
    assert r.headers["Docker-Content-Digest"] == digest
    return digest


def manifest_for(config: bytes, *layers: bytes) -> bytes:
    def descriptor(media_type: str, data: bytes) -> dict:
        return {"mediaType": media_type, "digest": digest_of(data), "size": len(data)}

    return json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "config": descriptor("application/vnd.docker.container.image.v1+json", config),
            "layers": [descriptor("application/vnd.freetoken.file", x) for x in layers],
        }
    ).encode()


def push_model(client: httpx.Client, repo: str, tag: str, *layers: bytes) -> bytes:
    """Pushes a config, the layers and a manifest naming them; returns the manifest bytes."""
    config = json.dumps({"model_format": "ftw", "repo": repo}).encode()
    for data in (config, *layers):
        push_blob(client, repo, data)
    manifest = manifest_for(config, *layers)
    r = client.put(
        f"/v2/{repo}/manifests/{tag}", content=manifest, headers={"Content-Type": MANIFEST_TYPE}
    )
    assert r.status_code == 201, r.text
    return manifest


def error_code(r: httpx.Response) -> str:
    return r.json()["errors"][0]["code"]
