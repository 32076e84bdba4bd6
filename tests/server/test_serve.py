"""`freetoken.server.serve()` as `freetoken serve` runs it: a real process on a free port."""

import os
import subprocess
import sys
import time

import httpx

from freetoken.store import Store
from tests import procs

from .harness import free_port, tiny_model_dir


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
        procs.wait_answering(f"http://127.0.0.1:{port}/", proc)
        r = httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
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


def _one_spare(server: int, module: str, seconds: float = 30) -> int:
    deadline = time.monotonic() + seconds
    while not (found := procs.children(server, f"freetoken.spare {module}")):
        assert time.monotonic() < deadline, f"no {module} started ahead"
        time.sleep(0.05)
    assert len(found) == 1
    return found[0]


CONVERTER, RUNNER = "freetoken.ftw.convert", "freetoken.runtime.runner"


def test_a_create_and_a_load_take_the_processes_started_ahead(tmp_path):
    """FREETOKEN_WARM_START: the server keeps a converter and a runner waiting; a create runs
    in the first (it is gone after, and another waits), a load in the second (it serves the
    model until unloaded); stopping the server ends the waiting ones."""
    port = free_port()
    env = {**os.environ, "FREETOKEN_MODELS": str(tmp_path / "models")}
    env |= {"FREETOKEN_HOST": f"127.0.0.1:{port}", "FREETOKEN_WARM_START": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "freetoken", "serve"], env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        procs.wait_answering(url, proc)
        first = _one_spare(proc.pid, CONVERTER)
        source = str(tiny_model_dir())
        r = httpx.post(f"{url}/api/create", json={"model": "t", "from": source}, timeout=120)
        assert r.status_code == 200 and r.text.strip().endswith('{"status":"success"}'), r.text
        assert not procs.running(first)  # it ran the conversion and ended
        assert [m["name"] for m in httpx.get(f"{url}/api/tags").json()["models"]] == ["t:latest"]
        runner = _one_spare(proc.pid, RUNNER)
        r = httpx.post(f"{url}/api/generate", json={"model": "t"}, timeout=300)  # a load
        assert r.status_code == 200 and r.json()["done_reason"] == "load", r.text
        # it is the runner now (its command line still the spare's), and another waits
        deadline = time.monotonic() + 30
        while len(now := procs.children(proc.pid, f"freetoken.spare {RUNNER}")) < 2:
            assert time.monotonic() < deadline, "no runner started ahead after the load"
            time.sleep(0.05)
        assert runner in now and len(now) == 2
        r = httpx.post(f"{url}/api/generate", json={"model": "t", "keep_alive": 0}, timeout=60)
        assert r.status_code == 200
        procs.wait_gone(runner)
        waiting = [_one_spare(proc.pid, m) for m in (CONVERTER, RUNNER)]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    for pid in waiting:  # ended by the server, or by their input's end
        procs.wait_gone(pid)
