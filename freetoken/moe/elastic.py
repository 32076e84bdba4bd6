"""Automatic sizing of the expert cache while other programs share the GPU.

The cache keeps `headroom` bytes of VRAM free. When another program takes memory and free
VRAM falls under half the headroom, the cache shrinks at once (down to its floor) to give
the headroom back. When memory frees up, it grows back towards its ceiling (the size the
budget or the last manual resize asked for) only after free memory has stayed high for a
while, so a program that frees and re-allocates does not make it flap.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

GROW_AFTER_S = 3.0
POLL_S = 0.25


def target(
    capacity: int,
    floor: int,
    ceiling: int,
    free: int,
    headroom: int,
    expert_bytes: int,
    grow_ok: bool,
) -> int | None:
    """The slot count to resize to now, or None to stay."""
    if free < headroom // 2 and capacity > floor:
        drop = -(-(headroom - free) // expert_bytes)
        return max(floor, capacity - drop)
    if grow_ok and free > 2 * headroom and capacity < ceiling:
        add = int((free - 1.5 * headroom) // expert_bytes)
        if add > 0:
            return min(ceiling, capacity + add)
    return None


class Watcher:
    """Polls free VRAM on a thread and asks for resizes through `resize(slots)`."""

    def __init__(
        self,
        free_bytes: Callable[[], int],
        capacity: Callable[[], int],
        floor: int,
        ceiling: Callable[[], int],
        headroom: int,
        expert_bytes: int,
        resize: Callable[[int], object],
    ):
        self.free_bytes, self.capacity, self.floor, self.ceiling = (
            free_bytes,
            capacity,
            floor,
            ceiling,
        )
        self.headroom, self.expert_bytes, self.resize = headroom, expert_bytes, resize
        self._stop = threading.Event()
        self._high_since: float | None = None
        self.thread = threading.Thread(target=self._run, name="vram-watcher", daemon=True)

    def start(self) -> Watcher:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def tick(self, now: float) -> int | None:
        free = self.free_bytes()
        high = free > 2 * self.headroom
        self._high_since = (self._high_since or now) if high else None
        grow_ok = self._high_since is not None and now - self._high_since >= GROW_AFTER_S
        want = target(
            self.capacity(),
            self.floor,
            self.ceiling(),
            free,
            self.headroom,
            self.expert_bytes,
            grow_ok,
        )
        if want is not None and want != self.capacity():
            log.info(
                "free VRAM %.2f GiB: resizing the expert cache to %d slots", free / 2**30, want
            )
            self.resize(want)
            self._high_since = None
            return want
        return None

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.tick(time.monotonic())
            except Exception:  # a failed resize must not stop the watching
                log.exception("automatic cache resize failed")
