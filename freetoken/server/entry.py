"""One model in the residency: its runner, its leases' count, its keep_alive clock, and what
it reports (/api/ps, /api/loading) and holds (for the room judged for another model)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from freetoken.config_values import MAX_DURATION_S
from freetoken.server.room import Footprint, Held
from freetoken.server.runner import Runner, RunnerSpec
from freetoken.store.models import ModelView, rfc3339

__all__ = ["Entry"]

# What /api/ps shows for "forever": Go's largest duration from now, as Ollama does.
_FOREVER_S = MAX_DURATION_S


@dataclass(eq=False)
class Entry:
    """A model loading, loaded or stopping (residency.py changes it, on the event loop)."""

    key: tuple[str, ...]
    view: ModelView
    spec: RunnerSpec
    ready: asyncio.Future[None]
    runner: Runner | None = None
    refs: int = 0
    keep_alive: float = 0.0
    expires_at: float | None = None  # wall clock; None while in use or kept forever
    last_used: float = field(default_factory=time.monotonic)
    timer: asyncio.TimerHandle | None = None
    retiring: bool = False  # takes no new leases (being replaced by a bigger runner)
    drop_when_idle: bool = False  # an unload request came while it was busy
    stopping: asyncio.Future[None] | None = None
    load_progress: tuple[int, int] = (0, 0)  # bytes read, bytes to read
    load_started: float = field(default_factory=time.monotonic)
    need: Footprint = field(default_factory=Footprint)  # the estimate it was loaded on

    def held(self) -> Held:
        """What it holds for the room judged for another model: what its runner reports
        once loaded, else its estimate (the part not yet read still to come)."""
        info = self.runner.info if self.runner is not None else {}
        if self.loaded and "host_bytes" in info:
            vram = int(info.get("size_vram") or 0)
            holds = Footprint(int(info["host_bytes"]), vram)
            return Held(self.key, holds, idle=self.idle, last_used=self.last_used)
        if self.ready.done():
            return Held(self.key, self.need, idle=self.idle, last_used=self.last_used)
        done, total = self.load_progress
        got = self.need.scaled(done / total if total else 0.0)
        return Held(self.key, got, self.need - got)

    @property
    def idle(self) -> bool:
        return self.refs == 0 and self.ready.done() and self.stopping is None

    @property
    def loaded(self) -> bool:
        return self.ready.done() and not self.ready.cancelled() and self.ready.exception() is None

    @property
    def dead(self) -> bool:
        return self.runner is not None and not self.runner.alive

    def loading_row(self) -> dict[str, Any]:
        """/api/loading's entry: bytes read so far, and how fast."""
        done, total = self.load_progress
        elapsed = max(time.monotonic() - self.load_started, 1e-9)
        return {
            "name": self.view.display,
            "completed": done,
            "total": total,
            "gbps": done / elapsed / 1e9,
            "seconds": elapsed,
        }

    def ps_row(self, now: float) -> tuple[float, dict[str, Any]]:
        """(expiry, /api/ps entry) from the runner's sizes as last read."""
        if self.expires_at is not None:
            expires = self.expires_at
        elif self.keep_alive < 0:
            expires = now + _FOREVER_S
        else:  # in use: the clock starts when the last request ends
            expires = now + self.keep_alive
        info = self.runner.info if self.runner is not None else {}
        size = int(info.get("size") or self.view.manifest.size)
        on_gpu = str(info.get("device", "")).startswith("cuda")
        return expires, {
            "name": self.view.display,
            "model": self.view.display,
            "size": size,
            "digest": self.view.digest,
            "details": self.view.details,
            "expires_at": rfc3339(expires),
            "size_vram": int(info.get("size_vram") or (size if on_gpu else 0)),
            "context_length": self.spec.num_ctx,
            # FreeToken's own: how the one VRAM budget is split
            "kv_cache_bytes": int(info.get("kv_cache_bytes") or 0),
            "expert_cache_bytes": int(info.get("expert_cache_bytes") or 0),
        }
