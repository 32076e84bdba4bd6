"""Which models are loaded: one runner per model, keep_alive, eviction and the request cap.

Everything here runs on the server's event loop and changes state only between awaits, so
no lock is needed: a check and the change it guards never straddle an `await`.

A request takes a `Lease` on a loaded model and releases it when its response ends. While a
model has leases it is never unloaded; once idle it stays for its keep_alive (the last
request's), then its runner is stopped. Loading a model past `max_loaded_models` first
unloads the least recently used idle one, or waits for one to become idle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from freetoken.config_values import MAX_DURATION_S, keep_alive_seconds
from freetoken.server.runner import Runner, RunnerError, RunnerSpec
from freetoken.store.models import ModelView, rfc3339

__all__ = ["Lease", "Residency", "ServerBusy", "default_num_ctx"]

log = logging.getLogger(__name__)

BUSY_MESSAGE = "server busy, please try again.  maximum pending requests exceeded"
_DEFAULT_NUM_CTX = 4096
_DEFAULT_MAX_LOADED = 3
# What /api/ps shows for "forever": Go's largest duration from now, as Ollama does.
_FOREVER_S = MAX_DURATION_S

StartRunner = Callable[..., Awaitable[Runner]]


class ServerBusy(RuntimeError):
    """More requests are pending than `max_queue` allows."""

    def __init__(self) -> None:
        super().__init__(BUSY_MESSAGE)


def default_num_ctx(requested: int | None, model_max: int | None, configured: int) -> int:
    """The context window to load with: the request's (or Modelfile's), else the setting's,
    else 4096; never more than the model was trained for."""
    n = requested or configured or _DEFAULT_NUM_CTX
    return min(n, model_max) if model_max else n


@dataclass(eq=False)
class _Entry:
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
    stopping: asyncio.Task[None] | None = None
    load_progress: tuple[int, int] = (0, 0)  # bytes read, bytes to read
    load_started: float = field(default_factory=time.monotonic)

    @property
    def loaded(self) -> bool:
        return self.ready.done() and not self.ready.cancelled() and self.ready.exception() is None

    @property
    def dead(self) -> bool:
        return self.runner is not None and not self.runner.alive


@dataclass(eq=False)
class Lease:
    """One request's hold on a loaded model; `release` exactly once (it is idempotent)."""

    residency: Residency
    entry: _Entry
    keep_alive: float
    load_duration: float  # seconds spent waiting for the model
    released: bool = False

    @property
    def runner(self) -> Runner:
        assert self.entry.runner is not None
        return self.entry.runner

    def release(self) -> None:
        self.residency._release(self)


class Residency:
    def __init__(self, cfg: Any, *, start_runner: StartRunner = Runner.start):
        self.cfg = cfg
        self._start_runner = start_runner
        self._models: dict[tuple[str, ...], _Entry] = {}
        self._changed = asyncio.Event()
        self._pending = 0
        self._tasks: set[asyncio.Future[Any]] = set()
        self._loads: set[asyncio.Future[Any]] = set()
        self._stopping: set[_Entry] = set()

    @property
    def max_loaded(self) -> int:
        return self.cfg.max_loaded_models or _DEFAULT_MAX_LOADED

    @property
    def pending(self) -> int:
        """Requests holding or waiting for a lease (what `max_queue` caps)."""
        return self._pending

    @property
    def connections(self) -> int:
        """Connections a runner's client may open: every request the queue admits may be
        in flight to one runner, beside the sequences each loaded model decodes."""
        return self.cfg.num_parallel * self.max_loaded + self.cfg.max_queue

    def default_keep_alive(self) -> float:
        return keep_alive_seconds(float(self.cfg.keep_alive))

    # -- leases --------------------------------------------------------------------------

    async def acquire(self, view: ModelView, spec: RunnerSpec, keep_alive: float | None) -> Lease:
        """Waits until `view` is loaded with a runner that fits `spec`; raises ServerBusy,
        or RunnerError when the model cannot be loaded."""
        if self._pending >= self.cfg.max_queue:
            raise ServerBusy()
        self._pending += 1
        started = time.monotonic()
        try:
            entry = await self._entry_for(view, spec)
        except BaseException:
            self._pending -= 1
            raise
        ka = self.default_keep_alive() if keep_alive is None else keep_alive_seconds(keep_alive)
        entry.refs += 1
        entry.keep_alive = ka  # the latest request's keep_alive wins, as in Ollama
        entry.drop_when_idle = False
        entry.expires_at = None
        if entry.timer:
            entry.timer.cancel()
            entry.timer = None
        return Lease(self, entry, ka, time.monotonic() - started)

    def _release(self, lease: Lease) -> None:
        if lease.released:
            return
        lease.released = True
        self._pending -= 1
        entry = lease.entry
        entry.refs -= 1
        entry.last_used = time.monotonic()
        entry.keep_alive = lease.keep_alive
        if entry.refs == 0 and self._models.get(entry.key) is entry:
            if entry.retiring or entry.drop_when_idle or entry.keep_alive == 0 or entry.dead:
                self._spawn(self._unload(entry))
            elif entry.keep_alive > 0:
                entry.expires_at = time.time() + entry.keep_alive
                loop = asyncio.get_running_loop()
                entry.timer = loop.call_later(entry.keep_alive, self._expire, entry)
        self._notify()

    def _fits(self, entry: _Entry, view: ModelView, spec: RunnerSpec) -> bool:
        if entry.view.digest != view.digest or spec.num_ctx > entry.spec.num_ctx:
            return False
        return all(entry.spec.options.get(k) == v for k, v in spec.options.items())

    async def _entry_for(self, view: ModelView, spec: RunnerSpec) -> _Entry:
        key = view.name.key
        while True:
            entry = self._models.get(key)
            if entry is not None and entry.dead:
                await self._unload(entry)
                continue
            if entry is not None and not entry.retiring and self._fits(entry, view, spec):
                if entry.loaded:
                    return entry
                await asyncio.shield(entry.ready)  # raises if the load fails
                continue
            if entry is not None:
                entry.retiring = True
                if entry.refs == 0 and entry.ready.done():
                    await self._unload(entry)
                else:
                    await self._wait_changed()
                continue
            # A runner still stopping holds its memory, so it still takes a place.
            if len(self._models) + len(self._stopping) >= self.max_loaded:
                victim = self._idlest()
                if victim is not None:
                    await self._unload(victim)
                else:
                    await self._wait_changed()
                continue
            self._begin_load(key, view, spec)

    def _idlest(self) -> _Entry | None:
        idle = [e for e in self._models.values() if e.refs == 0 and e.ready.done()]
        return min(idle, key=lambda e: e.last_used, default=None)

    # -- loading and unloading -----------------------------------------------------------

    def _begin_load(self, key: tuple[str, ...], view: ModelView, spec: RunnerSpec) -> None:
        # The load runs as its own task: a client that gives up waiting must not abort a
        # load other requests are waiting for.
        entry = _Entry(key, view, spec, asyncio.get_running_loop().create_future())
        entry.ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._models[key] = entry
        task = self._spawn(self._load(entry))
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)

    async def _load(self, entry: _Entry) -> None:
        log.info("loading %s (num_ctx %d)", entry.view.display, entry.spec.num_ctx)

        last_logged = [0.0]

        def progress(done: int, total: int) -> None:
            entry.load_progress = (done, total)
            now = time.monotonic()
            if now - last_logged[0] >= 2.0 or done == total:
                last_logged[0] = now
                rate = done / max(now - entry.load_started, 1e-9) / 1e9
                log.info(
                    "loading %s: %.2f/%.2f GB (%.2f GB/s)",
                    entry.view.display,
                    done / 1e9,
                    total / 1e9,
                    rate,
                )

        try:
            runner = await self._start_runner(
                entry.spec,
                python=self.cfg.runner_python,
                load_timeout=float(self.cfg.load_timeout),
                on_progress=progress,
                max_connections=self.connections,
            )
        except asyncio.CancelledError:
            self._forget(entry)
            entry.ready.cancel()
            raise
        except Exception as e:
            self._forget(entry)
            entry.ready.set_exception(e)
            return
        if self._models.get(entry.key) is not entry:  # unloaded (shutdown) while loading
            await runner.stop()
            entry.ready.set_exception(
                RunnerError(f"{entry.view.display} was unloaded while loading")
            )
            return
        entry.runner = runner
        runner.exited.add_done_callback(lambda _: self._on_exit(entry))
        log.info("loaded %s in %.1fs", entry.view.display, time.monotonic() - runner.started_at)
        entry.ready.set_result(None)
        self._notify()

    def _forget(self, entry: _Entry) -> None:
        if self._models.get(entry.key) is entry:
            del self._models[entry.key]
        self._notify()

    def _on_exit(self, entry: _Entry) -> None:
        if entry.stopping is None:
            log.warning("runner for %s exited unexpectedly", entry.view.display)
            self._spawn(self._unload(entry))

    def _expire(self, entry: _Entry) -> None:
        entry.timer = None
        if entry.refs == 0 and self._models.get(entry.key) is entry:
            self._spawn(self._unload(entry))

    async def _unload(self, entry: _Entry) -> None:
        """Forgets the entry and stops its runner; waits until the process is gone."""
        if self._models.get(entry.key) is entry:
            del self._models[entry.key]
        if entry.timer:
            entry.timer.cancel()
            entry.timer = None
        if entry.stopping is None:
            entry.stopping = asyncio.ensure_future(self._stop(entry))
        await asyncio.shield(entry.stopping)

    async def _stop(self, entry: _Entry) -> None:
        self._stopping.add(entry)
        try:
            if entry.runner is not None:
                await entry.runner.stop()
                log.info("unloaded %s", entry.view.display)
        finally:
            self._stopping.discard(entry)
            self._notify()

    async def unload(self, view: ModelView) -> None:
        """Unloads now if idle, else as soon as the requests in flight finish."""
        entry = self._models.get(view.name.key)
        if entry is None:
            return
        if entry.refs == 0 and entry.ready.done():
            await self._unload(entry)
        else:
            entry.drop_when_idle = True

    async def shutdown(self) -> None:
        """Stops every runner, loaded or loading, and waits for them to exit."""
        await asyncio.gather(
            *(self._unload(e) for e in list(self._models.values())), return_exceptions=True
        )
        # Loads still starting are cancelled (which stops their process); unloads finish.
        for task in list(self._loads):
            task.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=10)

    # -- plumbing ------------------------------------------------------------------------

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Future[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_changed(self) -> None:
        await self._changed.wait()

    # -- reporting -----------------------------------------------------------------------

    def loading(self) -> list[dict[str, Any]]:
        """Models whose runner is still reading weights, with byte progress and speed."""
        out = []
        for e in self._models.values():
            if e.ready.done():
                continue
            done, total = e.load_progress
            elapsed = max(time.monotonic() - e.load_started, 1e-9)
            out.append(
                {
                    "name": e.view.display,
                    "completed": done,
                    "total": total,
                    "gbps": done / elapsed / 1e9,
                    "seconds": elapsed,
                }
            )
        return out

    def ps(self) -> list[dict[str, Any]]:
        """/api/ps entries, the longest remaining time first."""
        now = time.time()
        rows = []
        for e in self._models.values():
            if not e.loaded or e.runner is None:
                continue
            if e.expires_at is not None:
                expires = e.expires_at
            elif e.keep_alive < 0:
                expires = now + _FOREVER_S
            else:  # in use: the clock starts when the last request ends
                expires = now + e.keep_alive
            info = e.runner.info
            size = int(info.get("size") or e.view.manifest.size)
            on_gpu = str(info.get("device", "")).startswith("cuda")
            rows.append(
                (
                    expires,
                    {
                        "name": e.view.display,
                        "model": e.view.display,
                        "size": size,
                        "digest": e.view.digest,
                        "details": e.view.details,
                        "expires_at": rfc3339(expires),
                        "size_vram": int(info.get("size_vram") or (size if on_gpu else 0)),
                        "context_length": e.spec.num_ctx,
                        # FreeToken's own: how the one VRAM budget is split
                        "kv_cache_bytes": int(info.get("kv_cache_bytes") or 0),
                        "expert_cache_bytes": int(info.get("expert_cache_bytes") or 0),
                    },
                )
            )
        rows.sort(key=lambda r: r[0], reverse=True)
        return [r[1] for r in rows]

    def runners(self) -> dict[str, Runner]:
        """Loaded runners by model name (for tests and diagnostics)."""
        return {e.view.display: e.runner for e in self._models.values() if e.runner is not None}
