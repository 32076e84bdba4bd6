"""`python -m freetoken.registry serve` as a real process: start, push, pull, stop."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.registry.conftest import free_port, push_blob, push_model

ROOT = Path(__file__).resolve().parents[2]


def test_serve_subprocess(tmp_path):
    root = tmp_path / "root"
    (root / "uploads").mkdir(parents=True)
    (root / "uploads" / "stale").write_bytes(b"left by a crash")
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "freetoken.registry",
            "serve",
            "--root",
            str(root),
            "--port",
            str(port),
            "--token",
            "t0k",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(url + "/v2/", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "registry did not start"
            time.sleep(0.05)
        assert not (root / "uploads" / "stale").exists()
        with httpx.Client(base_url=url, timeout=10) as anon:
            assert anon.post("/v2/library/demo/blobs/uploads/").status_code == 401
        with httpx.Client(base_url=url, headers={"Authorization": "Bearer t0k"}, timeout=10) as c:
            manifest = push_model(c, "library/demo", "latest", b"weights")
            assert c.get("/v2/library/demo/manifests/latest").content == manifest
            digest = push_blob(c, "library/demo", b"0123456789")
            r = c.get(f"/v2/library/demo/blobs/{digest}", headers={"Range": "bytes=2-4"})
            assert r.status_code == 206 and r.content == b"234"
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    # uvicorn re-raises the signal it caught once it has shut down cleanly.
    assert proc.returncode in (0, -15), out.decode()
    assert b"Traceback" not in out, out.decode()


def test_help():
    r = subprocess.run(
        [sys.executable, "-m", "freetoken.registry", "serve", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0
    for flag in ("--root", "--host", "--port", "--token"):
        assert flag in r.stdout
