"""`freetoken.server.serve()` as `freetoken serve` runs it: a real process on a free port."""

import os
import subprocess
import sys
import time

import httpx

from freetoken.store import Store

from .harness import free_port


def test_serve_prunes_then_answers(tmp_path):
    store = Store(tmp_path / "models")
    stray = store.blobs.put_bytes(b"referenced by no manifest")
    partial = store.blobs.writer()
    partial.write(b"an upload cut short")
    port = free_port()
    env = {**os.environ, "FREETOKEN_MODELS": str(store.root), "FREETOKEN_HOST": f"127.0.0.1:{port}"}
    env.pop("FREETOKEN_NOPRUNE", None)
    env.pop("OLLAMA_NOPRUNE", None)
    code = "from freetoken.server import serve; serve()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.05)
        assert r.text == "Ollama is running"
        assert httpx.get(f"http://127.0.0.1:{port}/api/tags").json() == {"models": []}
        assert list(store.blobs.root.iterdir()) == []
        assert not store.blobs.has(stray)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0 or proc.returncode == -15, err
    assert "pruned 2 unused or partial files" in err


def test_a_second_server_on_a_busy_port_says_so_and_never_listening(tmp_path):
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    env = {
        **os.environ,
        "FREETOKEN_MODELS": str(tmp_path / "models"),
        "FREETOKEN_HOST": f"127.0.0.1:{port}",
    }
    try:
        r = subprocess.run(
            [sys.executable, "-m", "freetoken", "serve"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        busy.close()
    assert r.returncode == 1
    assert f"Error: listen tcp 127.0.0.1:{port}: bind: address already in use" in r.stderr
    assert "listening on" not in r.stderr
