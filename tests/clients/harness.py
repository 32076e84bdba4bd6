"""Helpers for the real-client tests: installing npm packages into a cache folder, an
isolated environment for a client, and a recording of what the server saw."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.server.harness import LiveServer

HERE = Path(__file__).parent
MCP_PROBE = HERE / "mcp_probe.mjs"

# -- installing clients ----------------------------------------------------------------------


def _tail(text: str, n: int = 1500) -> str:
    return text[-n:].strip()


def _npm_error(text: str) -> str:
    """npm's error code and message, without its stack dump and advice."""
    skip = ("syscall", "errno", "}", "A complete log", "If you are behind", "Note that")
    lines = [
        line[len("npm error ") :].strip()
        for line in text.splitlines()
        if line.startswith("npm error ") and not line.startswith("npm error  ")
    ]
    lines = [line for line in lines if line and not line.startswith(skip)]
    return "; ".join(lines[:2]) or _tail(text, 500)


def node_path() -> str:
    """The system `node` (for ollama-js and the MCP probe); a skip when there is none."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("Node.js is not installed (no `node` on PATH)")
    return node


def node_major(node: str) -> int:
    out = subprocess.run(
        [node, "--version"], check=False, capture_output=True, text=True, timeout=30
    )
    return int(out.stdout.strip().lstrip("v").split(".")[0])


# All four installs take about a minute from nothing (400 MB of downloads); one that runs past
# this is stuck on the network, and the test skips rather than holding up the suite.
INSTALL_TIMEOUT = 300.0


class _Registry:
    """What this session found out about the npm registry. Without network, npm retries each
    request for about 70 s an install; a ping first, and no more tries after a stuck install,
    make such a machine skip every client test within seconds."""

    checked = False
    down: str | None = None  # why installs are skipped


def _run_group(
    cmd: list[str], *, cwd: Path | None, env: dict[str, str], timeout: float
) -> tuple[int | None, str, str]:
    """(exit status, or None past `timeout`; stdout; stderr). Past the timeout the whole
    process group is killed: a child left behind (an install script, a client's MCP server)
    would keep the pipes open and the wait going."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


def _check_registry(npm: str, env: dict[str, str]) -> None:
    if not _Registry.checked:
        _Registry.checked = True
        code, out, err = _run_group(
            [npm, "ping", "--fetch-retries=0", "--fetch-timeout=10000"],
            cwd=None,
            env=env,
            timeout=20,
        )
        if code != 0:
            why = "no answer in 20 s" if code is None else _npm_error(err or out)
            _Registry.down = f"the npm registry cannot be reached ({why})"
    if _Registry.down:
        pytest.skip(_Registry.down)


def npm_install(
    root: Path,
    name: str,
    specs: list[str],
    *,
    node_bin: Path | None = None,
    timeout: float = INSTALL_TIMEOUT,
) -> Path:
    """`npm install --prefix root/name specs` once (a stamp names what is there); later calls
    reuse it. `node_bin` goes first on PATH, so install scripts run under that Node."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed")
    prefix = root / name
    stamp = prefix / ".freetoken-installed"
    want = " ".join(specs)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one install at a time, also across sessions
        if stamp.exists() and stamp.read_text() == want:
            return prefix
        env = dict(os.environ)
        if node_bin is not None:
            env["PATH"] = f"{node_bin}{os.pathsep}{env.get('PATH', '')}"
        _check_registry(npm, env)
        shutil.rmtree(prefix, ignore_errors=True)
        prefix.mkdir(parents=True)
        cmd = [
            npm,
            "install",
            "--prefix",
            str(prefix),
            "--no-audit",
            "--no-fund",
            "--loglevel=error",
            *specs,
        ]
        code, out, err = _run_group(cmd, cwd=None, env=env, timeout=timeout)
        if code is None:
            _Registry.down = f"`npm install {want}` took more than {timeout:.0f} s"
            pytest.skip(_Registry.down)
        if code != 0:
            pytest.skip(f"`npm install {want}` failed (exit {code}): {_npm_error(err or out)}")
        stamp.write_text(want)
    return prefix


def isolated_env(home: Path, **extra: str) -> dict[str, str]:
    """An environment whose HOME and XDG folders are all under `home`, so a client reads no
    configuration, credentials or state of the machine's user and leaves none behind."""
    dirs = {
        "XDG_CONFIG_HOME": ".config",
        "XDG_DATA_HOME": ".local/share",
        "XDG_CACHE_HOME": ".cache",
        "XDG_STATE_HOME": ".local/state",
    }
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "TMPDIR": str(home / "tmp"),
    }
    for var, sub in dirs.items():
        env[var] = str(home / sub)
        (home / sub).mkdir(parents=True, exist_ok=True)
    (home / "tmp").mkdir(exist_ok=True)
    return {**env, **extra}


# -- the server and what it saw ----------------------------------------------------------------


@dataclass
class Exchange:
    """One HTTP request the server handled, and its response."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    status: int = 0
    response: bytes = b""

    def json(self) -> Any:
        return json.loads(self.body)

    def ndjson(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.response.decode().splitlines() if line.strip()]

    def sse(self) -> list[dict[str, Any]]:
        """The JSON `data:` payloads of a server-sent event stream (without `[DONE]`)."""
        out = []
        for line in self.response.decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[len("data: ") :]))
        return out


@dataclass
class Log:
    exchanges: list[Exchange] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, ex: Exchange) -> None:
        with self.lock:
            self.exchanges.append(ex)

    def clear(self) -> None:
        with self.lock:
            self.exchanges.clear()

    def on(self, path: str) -> list[Exchange]:
        with self.lock:
            return [e for e in self.exchanges if e.path == path]

    def paths(self) -> list[str]:
        with self.lock:
            return [f"{e.method} {e.path}" for e in self.exchanges]


class Recorder:
    """ASGI middleware that logs each request with its whole response body."""

    def __init__(self, app: Any, log: Log):
        self.app = app
        self.log = log

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        ex = Exchange(scope["method"], scope["path"], headers, b"")

        async def recv() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                ex.body += message.get("body", b"")
            return message

        async def snd(message: Any) -> None:
            if message["type"] == "http.response.start":
                ex.status = message["status"]
            elif message["type"] == "http.response.body":
                ex.response += message.get("body", b"")
            await send(message)

        try:
            await self.app(scope, recv, snd)
        finally:
            self.log.add(ex)


class AnswersAfterTools:
    """ASGI middleware that sends `tool_choice: "none"` with a chat request whose last message
    is a tool result.

    A trained model answers once it has its tool's result; a random-weight one, free to call
    under "auto", sometimes opens another call, and an agent loop (OpenCode's repeated-call
    guard, OpenClaw's turn) then goes on. This makes each client turn one call and one
    answer, as the tests assert; the recorder outside it keeps what the client sent."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        body = _answer_after_tool(scope["path"], body)
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        sent = False

        async def recv() -> Any:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app({**scope, "headers": headers}, recv, send)


def _answer_after_tool(path: str, body: bytes) -> bytes:
    try:
        req = json.loads(body)
    except ValueError:
        return body
    messages = req.get("messages") if isinstance(req, dict) else None
    if not (isinstance(messages, list) and messages and isinstance(messages[-1], dict)):
        return body
    if messages[-1].get("role") != "tool":
        return body
    if path == "/api/chat":  # Ollama's API takes it as an option
        options = req.get("options") if isinstance(req.get("options"), dict) else {}
        return json.dumps({**req, "options": {**options, "tool_choice": "none"}}).encode()
    return json.dumps({**req, "tool_choice": "none"}).encode()


@dataclass
class Served:
    server: LiveServer
    log: Log

    @property
    def url(self) -> str:
        return self.server.url


def run(
    cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float
) -> subprocess.CompletedProcess[str]:
    """Runs a client; a hang fails the test with what it had written so far."""
    code, out, err = _run_group(cmd, cwd=cwd, env=env, timeout=timeout)
    if code is None:
        pytest.fail(
            f"{cmd[0]} ran past {timeout:.0f} s\nstdout: {_tail(out)}\nstderr: {_tail(err)}"
        )
    return subprocess.CompletedProcess(cmd, code, out, err)


def probe_calls(path: Path) -> list[dict[str, Any]]:
    """The calls the MCP probe tool logged."""
    with contextlib.suppress(FileNotFoundError):
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return []
