"""The real registry on loopback (in a thread, or as its own process that a test can kill),
and httpx transports that count or slow down what a pull fetches from it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from tests.server.harness import free_port


def _wait_up(url: str, alive: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("registry exited during start-up")
        try:
            if httpx.get(url + "/v2/", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError("registry did not start")


class ThreadRegistry:
    """`with ThreadRegistry(root) as reg:` serves `root` at `reg.url` (host `reg.host`)."""

    def __init__(self, root: Path, token: str | None = None, challenge=None):
        from freetoken.registry import create_app

        self.root = root
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.host}"
        config = uvicorn.Config(
            create_app(root, token, challenge),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> ThreadRegistry:
        self._thread.start()
        _wait_up(self.url, self._thread.is_alive)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


class ProcessRegistry:
    """`python -m freetoken.registry serve` as a child process; `kill` is SIGKILL, `start` starts it
    again on the same port and root."""

    def __init__(self, root: Path, token: str | None = None):
        self.root = root
        self.token = token
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.host}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ProcessRegistry:
        cmd = [
            sys.executable,
            "-m",
            "freetoken.registry",
            "serve",
            "--root",
            str(self.root),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        if self.token:
            cmd += ["--token", self.token]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        proc = self.proc
        _wait_up(self.url, lambda: proc.poll() is None)
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ProcessRegistry:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()


class _CountedStream(httpx.SyncByteStream):
    def __init__(self, inner: httpx.SyncByteStream, owner: CountingTransport, key: str, start: int):
        self.inner, self.owner, self.key, self.pos = inner, owner, key, start

    def __iter__(self):
        for chunk in self.inner:
            with self.owner.lock:
                self.owner.bytes[self.key] = self.owner.bytes.get(self.key, 0) + len(chunk)
                chunk = self.owner.damage(self.key, self.pos, chunk)
            self.pos += len(chunk)
            if self.owner.delay:
                time.sleep(self.owner.delay)
            yield chunk

    def close(self) -> None:
        self.inner.close()


class CountingTransport(httpx.BaseTransport):
    """A real HTTP transport that records every request and the body bytes per blob digest,
    optionally sleeping `delay` seconds per chunk received (a slow link) and flipping the
    byte at each offset of `flip` {digest: [offset, ...]} the first time it passes (a link
    that corrupts data once)."""

    def __init__(self, delay: float = 0.0, flip: dict[str, list[int]] | None = None):
        self.inner = httpx.HTTPTransport()
        self.delay = delay
        self.flip = {k: list(v) for k, v in (flip or {}).items()}
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, Range
        self.bytes: dict[str, int] = {}

    def damage(self, key: str, pos: int, chunk: bytes) -> bytes:
        offsets = self.flip.get(key, [])
        for offset in [x for x in offsets if pos <= x < pos + len(chunk)]:
            offsets.remove(offset)
            i = offset - pos
            chunk = chunk[:i] + bytes([chunk[i] ^ 0xFF]) + chunk[i + 1 :]
        return chunk

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            self.requests.append((request.method, request.url.path, request.headers.get("range")))
        response = self.inner.handle_request(request)
        key = request.url.path.rsplit("/", 1)[-1]
        start = int(response.headers.get("content-range", "bytes 0-").split()[1].split("-")[0])
        assert isinstance(response.stream, httpx.SyncByteStream)
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_CountedStream(response.stream, self, key, start),
            extensions=response.extensions,
        )

    def ranges(self, digest: str) -> list[tuple[int, int]]:
        """(start, end inclusive) of every ranged GET of the blob."""
        out = []
        for method, path, rng in self.requests:
            if method == "GET" and path.endswith("/blobs/" + digest) and rng:
                a, b = rng.removeprefix("bytes=").split("-")
                out.append((int(a), int(b)))
        return out

    def close(self) -> None:
        self.inner.close()
