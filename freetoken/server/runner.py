"""One runner process per loaded model, spoken to over HTTP on a Unix socket.

The protocol is in docs/architecture.md. The server never shares memory with a runner, so a
runner that dies (a CUDA fault, the OOM killer) costs the requests it was serving an error
and nothing else: `completion` raises `RunnerError`, and whoever owns the runner drops it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from freetoken.protocol import CompletionRequest
from freetoken.spare import AsyncSpare

__all__ = ["ADAPTIVE_MARK", "Runner", "RunnerError", "RunnerRequestError", "RunnerSpec"]

log = logging.getLogger(__name__)
# how adaptive's placement decisions begin in a runner's log (moe/tuning.py)
ADAPTIVE_MARK = " adaptive: "
# runner log lines the server log shows without FREETOKEN_DEBUG
_SHOWN = (" runner WARNING ", " doctor: ", " CPU experts: ", ADAPTIVE_MARK)

_POLL_S = 0.05
_TAIL_LINES = 40
_STOP_GRACE_S = 5.0
# How long to wait for the exit status after the socket breaks, to report it.
_EXIT_WAIT_S = 2.0
_DEFAULT_CONNECTIONS = 100
_KEEPALIVE = 64


class RunnerError(RuntimeError):
    """The runner could not load the model, or died while serving."""


class RunnerRequestError(RunnerError):
    """The runner refused a request (a 4xx answer), e.g. a prompt too long with truncate off."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RunnerSpec:
    """The runner's SPEC.json."""

    name: str
    files: dict[str, str]
    num_ctx: int
    num_parallel: int
    options: dict[str, Any] = field(default_factory=dict)


def _error_text(body: bytes) -> str:
    try:
        obj = json.loads(body)
        if isinstance(obj, dict) and obj.get("error"):
            return str(obj["error"])
    except ValueError:
        pass
    return body.decode(errors="replace").strip() or "runner error"


def refusal(status: int, body: bytes) -> RunnerError:
    """The error for a runner's non-200 answer: a 4xx is the request's fault, the rest
    the runner's."""
    text = _error_text(body)
    return RunnerRequestError(status, text) if 400 <= status < 500 else RunnerError(text)


MODULE = "freetoken.runtime.runner"
SPAWN: dict[str, Any] = {
    "stdout": asyncio.subprocess.PIPE,
    "stderr": asyncio.subprocess.STDOUT,
    # Its own session: a Ctrl-C at the server's terminal is the server's to handle.
    "start_new_session": True,
}


class Runner:
    """A started runner process. Use `Runner.start`; then `completion`, and `stop` at the end."""

    def __init__(
        self,
        spec: RunnerSpec,
        proc: asyncio.subprocess.Process,
        workdir: Path,
        max_connections: int = _DEFAULT_CONNECTIONS,
    ):
        self.spec = spec
        self.proc = proc
        self.workdir = workdir
        self.socket = workdir / "runner.sock"
        self.info: dict[str, Any] = {}
        self.started_at = time.monotonic()
        self.ahead = False  # started ahead of its job (AsyncSpare)
        self.answered = False  # its /health has answered at least once
        self._tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        # One connection per request in flight: the residency's queue cap is the
        # backpressure (a 503 past it), so a request never waits here for a connection,
        # and a wait here would end in a pool timeout the client saw as a lost runner.
        # (A transport given to a client keeps its own limits: they are set on it.)
        limits = httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=min(max_connections, _KEEPALIVE),
        )
        self._client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=str(self.socket), limits=limits),
            base_url="http://runner",
            timeout=httpx.Timeout(10.0, read=None, pool=None),
        )
        self._reader = asyncio.create_task(self._read_output())
        self.exited = asyncio.create_task(self._wait_exit())

    @classmethod
    async def start(
        cls,
        spec: RunnerSpec,
        *,
        python: str = "",
        load_timeout: float = 300.0,
        on_progress: Callable[[int, int], None] | None = None,
        max_connections: int = _DEFAULT_CONNECTIONS,
        spare: AsyncSpare | None = None,
    ) -> Runner:
        """Starts the process (or hands `spare`'s waiting one the job) and waits until it
        reports the model loaded; `max_connections` bounds the requests that can be in
        flight to it at once. A runner started ahead that never answers (it had ended while
        it waited: killed, out of memory) is replaced by one started now."""
        python = python or sys.executable
        try:
            for source in (spare, None) if spare is not None else (None,):
                runner = await cls._launch(spec, python, max_connections, source)
                try:
                    await runner._wait_ready(load_timeout, on_progress)
                    return runner
                except RunnerError:
                    await runner.stop()
                    if not runner.ahead or runner.answered:
                        raise
                    log.warning(
                        "the runner started ahead for %s had ended; starting one", spec.name
                    )
                except BaseException:
                    await runner.stop()
                    raise
            raise AssertionError("a runner started now is never retried")
        finally:
            if spare is not None:  # the next one's imports, now that this load's are done
                await spare.refill()

    @classmethod
    async def _launch(
        cls, spec: RunnerSpec, python: str, max_connections: int, spare: AsyncSpare | None
    ) -> Runner:
        """The process for `spec`: `spare`'s waiting one where it has one, else a new one."""
        workdir = Path(tempfile.mkdtemp(prefix="freetoken-runner-"))
        spec_path = workdir / "spec.json"
        spec_path.write_text(json.dumps(asdict(spec)))
        # --parent-pid: the runner exits when this process is gone, however it went.
        args = ["--socket", str(workdir / "runner.sock"), "--spec", str(spec_path)]
        args += ["--parent-pid", str(os.getpid())]
        proc = spare.take(args, python) if spare is not None else None
        ahead = proc is not None
        if proc is None:
            proc = await asyncio.create_subprocess_exec(
                python, "-m", MODULE, *args, stdin=asyncio.subprocess.DEVNULL, **SPAWN
            )
        runner = cls(spec, proc, workdir, max_connections)
        runner.ahead = ahead
        log.info(
            "runner for %s started (pid %d)%s",
            spec.name,
            proc.pid,
            " (started ahead)" if ahead else "",
        )
        return runner

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    def output_tail(self) -> str:
        return "\n".join(self._tail)

    async def _read_output(self) -> None:
        # Read in chunks, not lines: an overlong line must not stop the reading, or the
        # runner would block on a full pipe.
        assert self.proc.stdout is not None
        pending = b""
        while chunk := await self.proc.stdout.read(1 << 16):
            *lines, pending = (pending + chunk).split(b"\n")
            if len(pending) > 1 << 16:
                lines, pending = [*lines, pending], b""
            for raw in lines:
                self._output_line(raw)
        if pending:
            self._output_line(pending)

    def _output_line(self, raw: bytes) -> None:
        line = raw.decode(errors="replace").rstrip()
        self._tail.append(line)
        # the load's judgement, the CPU kernel's status, adaptive's decisions (a few a load)
        # and warnings are for the operator
        shown = any(mark in line for mark in _SHOWN)
        log.log(logging.INFO if shown else logging.DEBUG, "runner %d: %s", self.proc.pid, line)

    async def _wait_exit(self) -> int:
        code = await self.proc.wait()
        # A grandchild may hold the pipe open; the last lines matter only for messages.
        await asyncio.wait({self._reader}, timeout=1.0)
        return code

    def _died(self, doing: str) -> RunnerError:
        code = self.proc.returncode
        last = next((x for x in reversed(self._tail) if x.strip()), "")
        why = f"exit status {code}" if code is not None else "connection lost"
        msg = f"model runner {doing} ({why})"
        if last:
            msg += f": {last}"
        log.error("%s\n%s", msg, self.output_tail())
        return RunnerError(msg)

    async def _wait_ready(
        self, stall_timeout: float, on_progress: Callable[[int, int], None] | None
    ) -> None:
        # The timeout counts time without progress, so a large model that keeps reading
        # weights is not killed for being large.
        last_progress, deadline = None, time.monotonic() + stall_timeout
        while True:
            if self.exited.done():
                raise self._died("exited while loading the model")
            if time.monotonic() > deadline:
                raise RunnerError(
                    f"timed out waiting for the model runner to load "
                    f"(no progress for {stall_timeout:g}s)"
                )
            health = await self._health()
            status = health.get("status")
            if status == "ok":
                self.info = health.get("info") or {}
                return
            if status == "error":
                raise RunnerError(f"error loading model: {health.get('error') or 'unknown error'}")
            progress = health.get("progress") or {}
            key = (progress.get("completed"), progress.get("total"))
            if status == "loading" and key != last_progress:
                last_progress, deadline = key, time.monotonic() + stall_timeout
                if on_progress and isinstance(key[0], int) and isinstance(key[1], int):
                    on_progress(key[0], key[1])
            await asyncio.wait({self.exited}, timeout=_POLL_S)

    async def _health(self) -> dict[str, Any]:
        try:
            r = await self._client.get("/health", timeout=5.0)
            self.answered = True
            data = r.json()
            return data if isinstance(data, dict) else {}
        except (httpx.TransportError, ValueError):
            return {}  # not listening yet

    async def stats(self) -> dict[str, Any]:
        r = await self._client.get("/stats")
        return r.json()

    async def resize(self, body: dict[str, Any]) -> dict[str, Any]:
        """Resizes the runner's expert cache; a refusal raises RunnerRequestError (400)."""
        try:
            r = await self._client.post(
                "/resize", json=body, timeout=httpx.Timeout(10.0, read=120.0)
            )
        except httpx.TransportError as e:
            raise RunnerError(f"lost the connection to the model runner: {e}") from None
        if r.status_code != 200:
            raise refusal(r.status_code, r.content)
        await self.refresh_info()  # /api/ps shows the sizes the new cache gives
        return r.json()

    async def refresh_info(self) -> None:
        """Reads the runner's current sizes again (what /api/ps and the room for another
        model count): a resized expert cache, by hand or by its VRAM watcher, changes them."""
        health = await self._health()
        if health.get("status") == "ok" and isinstance(health.get("info"), dict):
            self.info = health["info"]

    async def completion(
        self, request: CompletionRequest | dict[str, Any]
    ) -> AsyncIterator[dict[str, Any]]:
        """Streams the runner's events for one request (a dict is sent as the protocol's raw
        JSON); raises RunnerError on any failure.

        Closing the iterator early closes the connection, which cancels the request in the
        runner.
        """
        if not self.alive:
            raise self._died("is not running")
        try:
            body = request.to_json() if isinstance(request, CompletionRequest) else request
            async with self._client.stream("POST", "/completion", json=body) as r:
                if r.status_code != 200:
                    raise refusal(r.status_code, await r.aread())
                async for line in r.aiter_lines():
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event.get("error"):
                        raise RunnerError(str(event["error"]))
                    yield event
                    if event.get("done"):
                        return
        except (httpx.TransportError, ValueError) as e:
            await asyncio.wait({self.exited}, timeout=_EXIT_WAIT_S)
            if self.alive:
                raise RunnerError(f"lost the connection to the model runner: {e}") from None
            raise self._died("has unexpectedly stopped") from None
        await asyncio.wait({self.exited}, timeout=_EXIT_WAIT_S)
        raise self._died("has unexpectedly stopped")

    async def stop(self, grace: float = _STOP_GRACE_S) -> None:
        """Terminates the process (SIGTERM, then SIGKILL after `grace` seconds)."""
        try:
            if self.alive:
                self.proc.terminate()
                done, _ = await asyncio.wait({self.exited}, timeout=grace)
                if not done and self.alive:
                    self.proc.kill()
        except ProcessLookupError:
            pass
        await asyncio.gather(self.exited, return_exceptions=True)
        await asyncio.wait({self._reader}, timeout=1.0)
        self._reader.cancel()
        await self._client.aclose()
        shutil.rmtree(self.workdir, ignore_errors=True)
        log.info(
            "runner for %s stopped (pid %d, exit status %s)",
            self.spec.name,
            self.proc.pid,
            self.proc.returncode,
        )
