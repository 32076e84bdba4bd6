"""Progress for pull, push and create: one status line per step, one bar per digest.

On a terminal every line is redrawn in place (at most ten times a second); elsewhere each
line is printed once, when it first appears (status) or finishes (bar), so logs stay short.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from freetoken.cli.display import go_duration, human_size

__all__ = ["Progress"]

_REDRAW_S = 0.1
_SPEED_WINDOW_S = 5.0


class _Status:
    def __init__(self, text: str) -> None:
        self.text = text
        self.done = True

    def render(self, width: int) -> str:
        return self.text


class _Bar:
    """Bytes of one digest; `percent_only` draws `label 45%` as `create` does."""

    def __init__(
        self, label: str, total: int, percent_only: bool, clock: Callable[[], float]
    ) -> None:
        self.label, self.total, self.percent_only = label, total, percent_only
        self.completed = 0
        self.clock = clock
        self.samples: deque[tuple[float, int]] = deque()

    @property
    def done(self) -> bool:
        return self.total > 0 and self.completed >= self.total

    def update(self, completed: int, total: int) -> None:
        now = self.clock()
        self.completed, self.total = completed, max(total, self.total)
        self.samples.append((now, completed))
        while len(self.samples) > 2 and now - self.samples[0][0] > _SPEED_WINDOW_S:
            self.samples.popleft()

    def speed(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        (t0, c0), (t1, c1) = self.samples[0], self.samples[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else 0.0

    def percent(self) -> int:
        return min(100, int(self.completed * 100 / self.total)) if self.total else 0

    def render(self, width: int) -> str:
        pct = self.percent()
        if self.percent_only:
            # Shorten the digest rather than lose the percentage off the end of the line.
            room = width - len(f" {pct}%") - 1
            label = self.label if len(self.label) <= room else self.label[: max(room - 1, 1)] + "…"
            return f"{label} {pct}%"
        prefix = f"{self.label}: {pct:3d}% "
        if self.done:
            suffix = f" {human_size(self.total)}"
        else:
            suffix = f" {human_size(self.completed)}/{human_size(self.total)}"
            speed = self.speed()
            if speed > 0:
                eta = int((self.total - self.completed) / speed)
                suffix += f"  {human_size(speed)}/s  {go_duration(eta * 1_000_000_000)}"
        cells = max(10, min(50, width - len(prefix) - len(suffix) - 3))
        filled = cells * pct // 100
        return f"{prefix}▕{'█' * filled}{' ' * (cells - filled)}▏{suffix}"


class Progress:
    def __init__(
        self,
        out: TextIO | None = None,
        *,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # Like Ollama, progress goes to stderr so that stdout carries only results.
        self.out = out or sys.stderr
        self.tty = self.out.isatty() if tty is None else tty
        self.clock = clock
        self._lines: dict[str, _Status | _Bar] = {}
        self._printed: set[str] = set()
        self._drawn = 0
        self._frozen = 0
        self._last_draw = float("-inf")

    def status(self, text: str) -> None:
        key = "status:" + text
        if key not in self._lines:
            self._lines[key] = _Status(text)
            self._draw(force=True)

    def bar(
        self, key: str, label: str, completed: int, total: int, *, percent_only: bool = False
    ) -> None:
        line = self._lines.get(key)
        if not isinstance(line, _Bar):
            line = self._lines[key] = _Bar(label, total, percent_only, self.clock)
        was_done = line.done
        line.label = label
        line.update(completed, total)
        self._draw(force=line.done and not was_done)

    def event(self, ev: Mapping[str, Any]) -> None:
        """One ProgressResponse object of a pull, push or create stream."""
        status = str(ev.get("status", ""))
        if ev.get("registry"):
            # the first line of a pull or push says where it goes
            status = f"{status} ({ev['registry']})"
        if ev.get("digest") and ev.get("total"):
            self.bar(str(ev["digest"]), status, int(ev.get("completed") or 0), int(ev["total"]))
        elif status:
            self.status(status)

    def close(self) -> None:
        self._draw(force=True, final=True)

    def _draw(self, *, force: bool = False, final: bool = False) -> None:
        if self.tty:
            now = self.clock()
            if force or now - self._last_draw >= _REDRAW_S:
                self._last_draw = now
                self._redraw()
            return
        # Logs are not a screen: nothing is shortened to fit one.
        width = 1 << 16
        for key, line in self._lines.items():
            if key not in self._printed and (line.done or final):
                self._printed.add(key)
                self.out.write(line.render(width) + "\n")
        self.out.flush()

    def _redraw(self) -> None:
        width = shutil.get_terminal_size().columns
        lines = list(self._lines.values())
        parts = [f"\x1b[{self._drawn}F"] if self._drawn else []
        for line in lines[self._frozen :]:
            # A line longer than the terminal would wrap and break the cursor arithmetic.
            parts.append("\x1b[2K" + line.render(width)[: max(1, width - 1)] + "\n")
        # Finished lines at the top never change again; leaving them out of later redraws
        # keeps the redrawn block short, since the cursor cannot go back above the screen.
        while self._frozen < len(lines) and lines[self._frozen].done:
            self._frozen += 1
        self._drawn = len(lines) - self._frozen
        self.out.write("".join(parts))
        self.out.flush()
