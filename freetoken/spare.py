"""Interpreters started ahead of their job, so the job does not wait for the imports.

A conversion is a Python process that imports torch before it reads a byte: seconds on a
machine with CUDA's libraries, each time, which a 16 GB create cannot hide. The server keeps
one such process started ahead, its imports done, waiting for its arguments:

    python -m freetoken.spare MODULE

imports MODULE, then reads one line on stdin: a JSON list of arguments, with which it runs
MODULE's `main(argv)` as `python -m MODULE ARGS...` would. End of input before that line
(the server closing, or gone: the pipe's writer was the server) ends it, having run
nothing, so a spare never outlives its server.

`Spare` is the server's side; this module imports nothing heavy, so the server (which never
imports torch) holds it, and the child imports only what MODULE does.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["AsyncSpare", "Spare", "main"]

log = logging.getLogger("freetoken.spare")


class Spare:
    """At most one interpreter waiting for `module`'s next job (thread-safe).

    Off until `start()`; each `take()` hands the waiting one its job, and `refill()` (called
    once the job is done, so its imports never compete with the job for the cores) starts the
    next. `popen` holds Popen's pipes and options for the job's process; stdin is the job
    line's."""

    def __init__(self, module: str, **popen: Any) -> None:
        self.module = module
        self.popen = popen
        self._lock = threading.Lock()
        self._python = ""
        self._waiting: subprocess.Popen | None = None

    @property
    def on(self) -> bool:
        return bool(self._python)

    @property
    def pid(self) -> int | None:
        """The waiting interpreter's process id (None where none is waiting)."""
        with self._lock:
            proc = self._waiting
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self, python: str) -> None:
        """Keeps one interpreter of `python` waiting from now on."""
        with self._lock:
            self._python = python
        self.refill()

    def refill(self) -> None:
        """Starts a waiting interpreter if none is (and the spare is on)."""
        with self._lock:
            if not self._python or (self._waiting and self._waiting.poll() is None):
                return
            cmd = [self._python, "-m", __name__, self.module]
            self._waiting = subprocess.Popen(cmd, stdin=subprocess.PIPE, **self.popen)
            log.debug("a spare %s is starting (pid %d)", self.module, self._waiting.pid)

    def take(self, argv: Sequence[str], python: str) -> subprocess.Popen | None:
        """The waiting interpreter, now running `module` with `argv`; None if there is none
        of `python` alive (the caller then starts a process of its own)."""
        with self._lock:
            proc, self._waiting = self._waiting, None
        if proc is None:
            return None
        if python != self._python or proc.poll() is not None:
            _end(proc)
            return None
        try:
            assert proc.stdin is not None
            # bytes whatever the pipes' mode (text=True or not): one line, then end of input
            os.write(proc.stdin.fileno(), (json.dumps(list(argv)) + "\n").encode())
            proc.stdin.close()
            proc.stdin = None  # as if started without one: communicate() and wait() as usual
        except OSError:  # it died between the look and the write
            _end(proc)
            return None
        return proc

    def close(self) -> None:
        """Off: the waiting interpreter (if any) ends without a job."""
        with self._lock:
            proc, self._waiting, self._python = self._waiting, None, ""
        if proc is not None:
            _end(proc)


class AsyncSpare:
    """`Spare` on an event loop: the waiting interpreter is an asyncio process, whose pipes
    the loop reads (runners). Use it from the loop's thread only."""

    def __init__(self, module: str, **spawn: Any) -> None:
        self.module = module
        self.spawn = spawn
        self._python = ""
        self._waiting: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        proc = self._waiting
        return proc.pid if proc is not None and proc.returncode is None else None

    async def start(self, python: str) -> None:
        self._python = python
        await self.refill()

    async def refill(self) -> None:
        if not self._python or self.pid is not None:
            return
        cmd = [self._python, "-m", __name__, self.module]
        self._waiting = await asyncio.create_subprocess_exec(
            *cmd, stdin=asyncio.subprocess.PIPE, **self.spawn
        )
        log.debug("a spare %s is starting (pid %d)", self.module, self._waiting.pid)

    def take(self, argv: Sequence[str], python: str) -> asyncio.subprocess.Process | None:
        """As `Spare.take`."""
        proc, self._waiting = self._waiting, None
        if proc is None:
            return None
        if python != self._python or proc.returncode is not None:
            _discard(proc)
            return None
        assert proc.stdin is not None
        proc.stdin.write((json.dumps(list(argv)) + "\n").encode())
        proc.stdin.close()
        return proc

    async def close(self) -> None:
        proc, self._waiting, self._python = self._waiting, None, ""
        if proc is None:
            return
        _discard(proc)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(proc.wait(), 5)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()


def _discard(proc: asyncio.subprocess.Process) -> None:
    """End of input: a waiting spare ends as soon as its imports are done."""
    if proc.stdin is not None:
        proc.stdin.close()


def _end(proc: subprocess.Popen) -> None:
    """Ends a spare: end of input first (it exits between imports and its job), then a kill."""
    with contextlib.suppress(OSError):
        if proc.stdin is not None:
            proc.stdin.close()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m freetoken.spare MODULE")
    name = sys.argv[1]
    module = importlib.import_module(name)
    line = sys.stdin.readline()
    if not line.strip():
        return
    argv = json.loads(line)
    sys.argv = [name, *argv]
    module.main(argv)


if __name__ == "__main__":
    main()
