"""Processes the tests start: whether one still runs, its children, waiting for a server."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx


def running(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pid: int, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while running(pid):
        assert time.monotonic() < deadline, f"process {pid} is still running"
        time.sleep(0.05)


def children(pid: int, marker: str) -> list[int]:
    """Running processes whose parent is `pid` and whose command line holds `marker`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == pid and marker in cmdline and running(int(entry.name)):
            found.append(int(entry.name))
    return found


def wait_answering(url: str, proc: subprocess.Popen, seconds: float = 20) -> None:
    """Returns once `url` answers at all; fails if `proc` exits or `seconds` pass first."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.TransportError:
            assert proc.poll() is None, f"{proc.args} exited with {proc.returncode}"
            assert time.monotonic() < deadline, f"{url} did not answer"
            time.sleep(0.05)
