"""Residency through the real server: reloads, eviction, keep_alive, the queue cap."""

import os
import threading
import time
from datetime import UTC, datetime, timedelta

import httpx
import ollama

from freetoken.server.residency import BUSY_MESSAGE, default_num_ctx
from freetoken.store import Store

from .harness import LiveServer, add_model, make_config

HI = [{"role": "user", "content": "hi"}]


def serve(tmp_path, names=("a",), **env) -> LiveServer:
    store = Store(tmp_path / "models")
    for name in names:
        add_model(store, name)
    return LiveServer(make_config(store.root, **env))


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is not alive
        return f.read().split()[2] != "Z"


def test_default_num_ctx():
    assert default_num_ctx(None, None, 0) == 4096
    assert default_num_ctx(None, 512, 0) == 512  # never past the trained context
    assert default_num_ctx(None, None, 8192) == 8192
    assert default_num_ctx(2048, 40960, 8192) == 2048


def test_reload_eviction_and_expiry(tmp_path):
    # One scenario, three runner starts: a runner is the expensive part of these tests.
    env = {"FREETOKEN_MAX_LOADED_MODELS": "1", "FREETOKEN_CONTEXT_LENGTH": "128"}
    with serve(tmp_path, ("a", "b"), **env) as srv:
        c = ollama.Client(host=srv.url)
        c.chat("a", messages=HI, options={"num_predict": 1}, keep_alive=-1)
        first = srv.runner_pid("a:latest")
        [ps] = c.ps().models
        assert ps.context_length == 128
        assert ps.expires_at > datetime.now(UTC) + timedelta(days=3650)

        # A bigger num_ctx than the loaded runner's reloads it; a smaller one reuses it.
        c.chat("a", messages=HI, options={"num_predict": 1, "num_ctx": 256}, keep_alive=-1)
        second = srv.runner_pid("a:latest")
        assert second != first and c.ps().models[0].context_length == 256
        c.chat("a", messages=HI, options={"num_predict": 1, "num_ctx": 64}, keep_alive=-1)
        assert srv.runner_pid("a:latest") == second
        assert not alive(first)

        # Past max_loaded_models the least recently used idle model makes room.
        c.generate("b", prompt="x", options={"num_predict": 1}, keep_alive="1s")
        assert [m.model for m in c.ps().models] == ["b:latest"]
        assert not alive(second)
        [ps] = c.ps().models
        assert ps.expires_at < datetime.now(UTC) + timedelta(seconds=2)
        b = srv.runner_pid("b:latest")
        wait_for(lambda: c.ps().models == [], timeout=5)
        wait_for(lambda: not alive(b))


def test_queue_cap_and_load_timeout(tmp_path):
    # A "python" that never starts a runner: the first request waits on its load, holding
    # the only queue slot, until the load times out.
    hung = tmp_path / "python"
    hung.write_text("#!/bin/sh\necho still loading\nexec sleep 30\n")
    hung.chmod(0o755)
    env = {
        "FREETOKEN_MAX_QUEUE": "1",
        "FREETOKEN_LOAD_TIMEOUT": "1s",
        "FREETOKEN_RUNNER_PYTHON": str(hung),
    }
    with serve(tmp_path, **env) as srv:
        first: list[httpx.Response] = []
        t = threading.Thread(
            target=lambda: first.append(
                httpx.post(f"{srv.url}/api/chat", json={"model": "a", "messages": HI}, timeout=30)
            )
        )
        t.start()
        wait_for(lambda: srv.services.residency.pending == 1)
        r = httpx.post(f"{srv.url}/api/generate", json={"model": "a", "prompt": "x"}, timeout=30)
        assert r.status_code == 503 and r.json() == {"error": BUSY_MESSAGE}
        t.join()
        assert first[0].status_code == 500
        assert "timed out waiting for the model runner to load" in first[0].json()["error"]
        assert srv.services.residency.ps() == [] and srv.services.residency.pending == 0


FAKE_LOADING_RUNNER = r"""
import json, socketserver, sys, time
from http.server import BaseHTTPRequestHandler

sock = sys.argv[sys.argv.index("--socket") + 1]
start = time.monotonic()

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        elapsed = time.monotonic() - start
        done = int(elapsed * 1e9)
        state = {"status": "loading", "progress": {"completed": done, "total": 10**11}}
        body = json.dumps(state if elapsed < 3 else {"status": "ok", "info": {}}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

    def address_string(self):
        return "runner"

socketserver.UnixStreamServer(sock, Health).serve_forever()
"""


def test_loading_progress_is_visible_while_a_model_loads(tmp_path):
    import sys

    script = tmp_path / "fake_runner.py"
    script.write_text(FAKE_LOADING_RUNNER)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    python.chmod(0o755)
    with serve(tmp_path, FREETOKEN_RUNNER_PYTHON=str(python), FREETOKEN_LOAD_TIMEOUT="60s") as srv:
        loaded: list[httpx.Response] = []
        t = threading.Thread(
            target=lambda: loaded.append(
                httpx.post(f"{srv.url}/api/generate", json={"model": "a"}, timeout=30)
            )
        )
        t.start()

        def progressed():
            rows = httpx.get(f"{srv.url}/api/loading").json()["models"]
            return rows and rows[0]["completed"] > 0 and rows[0]["total"] == 10**11

        wait_for(progressed)
        [row] = httpx.get(f"{srv.url}/api/loading").json()["models"]
        assert row["name"] == "a:latest" and row["gbps"] > 0
        assert httpx.get(f"{srv.url}/api/ps").json() == {"models": []}  # not loaded yet
        t.join()
        assert loaded[0].json()["done_reason"] == "load"
        assert httpx.get(f"{srv.url}/api/loading").json() == {"models": []}


FAKE_SLOW_RUNNER = r"""
import json, socketserver, sys, time
from http.server import BaseHTTPRequestHandler

sock = sys.argv[sys.argv.index("--socket") + 1]
HOLD = float(sys.argv[sys.argv.index("--hold") + 1])

class Runner(BaseHTTPRequestHandler):
    def _send(self, body, close=False):
        self.send_response(200)
        if not close:
            self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(json.dumps({"status": "ok", "info": {}}).encode())

    def do_POST(self):
        self.rfile.read(int(self.headers["content-length"]))
        self.close_connection = True
        self._send(b'{"content": "x"}\n', close=True)
        self.wfile.flush()
        time.sleep(HOLD)  # the server closes the connection first: its client left

    def log_message(self, *args):
        pass

    def address_string(self):
        return "runner"

class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True
    request_queue_size = 512

Server(sock, Runner).serve_forever()
"""


async def _hold_streams(url: str, n: int) -> tuple[list[int], httpx.Response]:
    """`n` streams held open at once (each past its first event), then one request more;
    returns the streams' statuses and the answer to the one more."""
    import asyncio

    started, release = asyncio.Semaphore(0), asyncio.Event()
    limits = httpx.Limits(max_connections=n + 10)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def hold() -> int:
            body = {"model": "a", "prompt": "x"}
            async with client.stream("POST", "/api/generate", json=body) as r:
                lines = r.aiter_lines()  # held: a dropped iterator closes the stream
                await anext(lines)  # the runner's first event came through
                started.release()
                await release.wait()
                return r.status_code

        streams = [asyncio.create_task(hold()) for _ in range(n)]
        for _ in range(n):  # all of them at once: none waits for a connection to the runner
            await asyncio.wait_for(started.acquire(), 30)
        over = await client.post("/api/generate", json={"model": "a", "prompt": "x"})
        release.set()
        return list(await asyncio.gather(*streams)), over


def test_more_streams_than_a_connection_pool_queue_or_get_503(tmp_path):
    """Issue 22: past 100 concurrent streams, requests waited for a connection to their
    runner until the pool gave up, and failed as a lost runner (500). Now every request the
    queue admits has its connection at once; past the queue it is Ollama's 503."""
    import asyncio
    import sys

    script = tmp_path / "fake_runner.py"
    script.write_text(FAKE_SLOW_RUNNER)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {script} --hold 60 "$@"\n')
    python.chmod(0o755)
    env = {"FREETOKEN_RUNNER_PYTHON": str(python), "FREETOKEN_MAX_QUEUE": "120"}
    with serve(tmp_path, **env) as srv:
        httpx.post(f"{srv.url}/api/generate", json={"model": "a"}, timeout=30)  # loaded
        statuses, over = asyncio.run(_hold_streams(srv.url, 120))
        assert statuses == [200] * 120
        assert over.status_code == 503 and over.json() == {"error": BUSY_MESSAGE}
        wait_for(lambda: srv.services.residency.pending == 0)
