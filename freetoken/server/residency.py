"""Which models are loaded: one runner per model, keep_alive, eviction and the request cap.

Everything here runs on the server's event loop and changes state only between awaits, so
no lock is needed: a check and the change it guards never straddle an `await`.

A request takes a `Lease` on a loaded model and releases it when its response ends. While a
model has leases it is never unloaded; once idle it stays for its keep_alive (the last
request's), then its runner is stopped. Loading a model past `max_loaded_models` first
unloads the least recently used idle one, or waits for one to become idle.

Before a load the model's needs (the doctor's estimate: host memory for its banks, GPU
memory for its dense weights, KV cache and smallest expert cache) are set against what is
free, less what loads under way will still take (server/room.py). A model that cannot fit
even alone is refused with the numbers (`ModelTooLarge`); one that fits once idle models
are gone has them unloaded first, least recently used first, as Ollama does; where busy
models hold the memory, the load waits for them.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freetoken import doctor
from freetoken.config_values import keep_alive_seconds
from freetoken.doctor.memory import MemoryProbe, SystemMemory
from freetoken.server import runner as runner_mod
from freetoken.server.entry import Entry
from freetoken.server.room import Room, TooLarge, make_room
from freetoken.server.runner import Runner, RunnerError, RunnerSpec
from freetoken.spare import AsyncSpare
from freetoken.store.models import ModelView

__all__ = ["Lease", "ModelTooLarge", "Residency", "ServerBusy", "default_num_ctx"]

log = logging.getLogger(__name__)

BUSY_MESSAGE = "server busy, please try again.  maximum pending requests exceeded"
_DEFAULT_NUM_CTX = 4096
_DEFAULT_MAX_LOADED = 3

StartRunner = Callable[..., Awaitable[Runner]]


class ServerBusy(RuntimeError):
    """More requests are pending than `max_queue` allows."""

    def __init__(self) -> None:
        super().__init__(BUSY_MESSAGE)


ModelTooLarge = TooLarge  # a model that does not fit this machine even alone


def default_num_ctx(requested: int | None, model_max: int | None, configured: int) -> int:
    """The context window to load with: the request's (or Modelfile's), else the setting's,
    else 4096; never more than the model was trained for."""
    n = requested or configured or _DEFAULT_NUM_CTX
    return min(n, model_max) if model_max else n


@dataclass(eq=False)
class _Waiter:
    """A request waiting in its model's line for a runner that fits it."""

    view: ModelView
    spec: RunnerSpec


@dataclass(eq=False)
class Lease:
    """One request's hold on a loaded model; `release` exactly once (it is idempotent)."""

    residency: Residency
    entry: Entry
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
    def __init__(
        self,
        cfg: Any,
        *,
        start_runner: StartRunner = Runner.start,
        memory: MemoryProbe | None = None,
    ):
        self.cfg = cfg
        self._start_runner = start_runner
        # a runner started ahead, its imports done (FREETOKEN_WARM_START; `start_spare`)
        self.spare = AsyncSpare(runner_mod.MODULE, **runner_mod.SPAWN)
        self._memory = memory or SystemMemory(cfg)
        self._facts: dict[str, doctor.ModelFacts | None] = {}  # by manifest digest
        self._models: dict[tuple[str, ...], Entry] = {}
        # Bumped whenever a model starts or ends loading or stopping: a judgement of the room
        # for a load that awaited (measuring memory) sees whether it is stale.
        self._generation = 0
        self._changed = asyncio.Event()
        self._pending = 0
        self._tasks: set[asyncio.Future[Any]] = set()
        self._loads: set[asyncio.Future[Any]] = set()
        self._stopping: set[Entry] = set()
        # Each model's requests still waiting for a runner, in arrival order (see _entry_for)
        self._waiting: dict[tuple[str, ...], list[_Waiter]] = {}

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

    def _fits(self, entry: Entry, view: ModelView, spec: RunnerSpec) -> bool:
        if entry.view.digest != view.digest or spec.num_ctx > entry.spec.num_ctx:
            return False
        return all(entry.spec.options.get(k) == v for k, v in spec.options.items())

    async def _entry_for(self, view: ModelView, spec: RunnerSpec) -> Entry:
        """The entry to lease, in turn: a model's requests are served in arrival order, as
        Ollama queues them. Only the first in line may replace the current runner, and a
        request the runner can serve waits while an earlier one needs a different runner
        (else a stream of requests with the loaded options, or the races during a
        replacement's awaits, could pass a waiting request forever)."""
        key = view.name.key
        me = _Waiter(view, spec)
        queue = self._waiting.setdefault(key, [])
        queue.append(me)
        try:
            return await self._entry_in_turn(key, me, queue)
        finally:
            queue.remove(me)
            if not queue and self._waiting.get(key) is queue:
                del self._waiting[key]
            self._notify()  # the next in line may go now

    async def _entry_in_turn(
        self, key: tuple[str, ...], me: _Waiter, queue: list[_Waiter]
    ) -> Entry:
        view, spec = me.view, me.spec
        while True:
            entry = self._models.get(key)
            if entry is not None and entry.dead:
                await self._unload(entry)
                continue
            if entry is not None and not entry.retiring and self._fits(entry, view, spec):
                if not entry.loaded:
                    await asyncio.shield(entry.ready)  # raises if the load fails
                elif any(not self._serves(entry, w) for w in queue[: queue.index(me)]):
                    await self._wait_changed()  # an earlier request needs another runner
                else:
                    return entry
                continue
            if queue[0] is not me:  # only the first in line replaces the runner
                await self._wait_changed()
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
            room = await self._room_for(view, spec)
            if room is None:
                continue  # something changed while memory was measured: judge again
            if room.wait:
                await self._wait_changed()
                continue
            if not all(k in self._models and self._models[k].idle for k in room.victims):
                continue  # a request took one of them meanwhile
            self._begin_load(key, view, spec, room)

    def _serves(self, entry: Entry, waiter: _Waiter) -> bool:
        return not entry.retiring and self._fits(entry, waiter.view, waiter.spec)

    def _idlest(self) -> Entry | None:
        idle = [e for e in self._models.values() if e.refs == 0 and e.ready.done()]
        return min(idle, key=lambda e: e.last_used, default=None)

    # -- memory --------------------------------------------------------------------------

    async def _room_for(self, view: ModelView, spec: RunnerSpec) -> Room | None:
        """The room for loading `view` (raises ModelTooLarge); None when the models changed
        while it was measured, so the caller judges again."""
        generation = self._generation
        facts = await self._model_facts(view, spec)
        if facts is not None:
            await self.refresh()
            free = await asyncio.to_thread(self._memory.free)
        if generation != self._generation:
            return None
        if facts is None:
            return Room()  # a model without an FTW index: nothing to judge it on
        needs = doctor.needs(facts, spec.num_ctx, self.cfg, free.gpu, spec.num_parallel)
        held = [e.held() for e in (*self._models.values(), *self._stopping)]
        return make_room(view.display, needs, free, held)

    async def _model_facts(self, view: ModelView, spec: RunnerSpec) -> doctor.ModelFacts | None:
        if view.digest not in self._facts:
            files = {name: Path(path) for name, path in spec.files.items()}
            try:
                facts = await asyncio.to_thread(doctor.from_files, view.display, files)
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.debug("no memory estimate for %s: %s", view.display, e)
                facts = None
            self._facts[view.digest] = facts
        return self._facts[view.digest]

    async def refresh(self) -> None:
        """Asks every loaded runner for its current sizes (an expert cache resized by hand
        or by its own watcher changes them)."""
        runners = [e.runner for e in self._models.values() if e.loaded and e.runner is not None]
        if runners:
            await asyncio.gather(*(r.refresh_info() for r in runners), return_exceptions=True)

    # -- loading and unloading -----------------------------------------------------------

    def _begin_load(
        self, key: tuple[str, ...], view: ModelView, spec: RunnerSpec, room: Room
    ) -> None:
        # The load runs as its own task: a client that gives up waiting must not abort a
        # load other requests are waiting for. It is registered, and its victims taken off,
        # before anything is awaited: a load judged meanwhile counts them as they will be.
        entry = Entry(key, view, spec, asyncio.get_running_loop().create_future())
        entry.ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        entry.need = room.need
        self._generation += 1
        victims = [self._models[k] for k in room.victims]
        for victim in victims:
            log.info("unloading %s to make room for %s", victim.view.display, view.display)
            self._begin_unload(victim)
        self._models[key] = entry
        task = self._spawn(self._load(entry, victims))
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)

    async def _load(self, entry: Entry, after: Sequence[Entry] = ()) -> None:
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
            # the memory of the models unloaded for it is free once their processes are gone
            stopped = [v.stopping for v in after if v.stopping is not None]
            await asyncio.gather(*map(asyncio.shield, stopped), return_exceptions=True)
            runner = await self._start_runner(
                entry.spec,
                python=self.cfg.runner_python,
                load_timeout=float(self.cfg.load_timeout),
                on_progress=progress,
                max_connections=self.connections,
                spare=self.spare,
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
        self._generation += 1
        self._notify()

    def _forget(self, entry: Entry) -> None:
        if self._models.get(entry.key) is entry:
            del self._models[entry.key]
        self._generation += 1
        self._notify()

    def _on_exit(self, entry: Entry) -> None:
        if entry.stopping is None:
            log.warning("runner for %s exited unexpectedly", entry.view.display)
            self._spawn(self._unload(entry))

    def _expire(self, entry: Entry) -> None:
        entry.timer = None
        if entry.refs == 0 and self._models.get(entry.key) is entry:
            self._spawn(self._unload(entry))

    async def _unload(self, entry: Entry) -> None:
        """Forgets the entry and stops its runner; waits until the process is gone."""
        await asyncio.shield(self._begin_unload(entry))

    def _begin_unload(self, entry: Entry) -> asyncio.Future[None]:
        """Forgets the entry and starts stopping its runner, now (nothing awaited)."""
        if self._models.get(entry.key) is entry:
            del self._models[entry.key]
        if entry.timer:
            entry.timer.cancel()
            entry.timer = None
        if entry.stopping is None:
            self._generation += 1
            self._stopping.add(entry)  # it holds its memory until the process is gone
            entry.stopping = asyncio.ensure_future(self._stop(entry))
        return entry.stopping

    async def _stop(self, entry: Entry) -> None:
        try:
            if entry.runner is not None:
                await entry.runner.stop()
                log.info("unloaded %s", entry.view.display)
        finally:
            self._stopping.discard(entry)
            self._generation += 1
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

    async def start_spare(self) -> None:
        """Keeps a runner started ahead from now on (each load then skips the imports)."""
        await self.spare.start(self.cfg.runner_python or sys.executable)

    async def shutdown(self) -> None:
        """Stops every runner, loaded or loading, and waits for them to exit."""
        await self.spare.close()
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
        return [e.loading_row() for e in self._models.values() if not e.ready.done()]

    def ps(self) -> list[dict[str, Any]]:
        """/api/ps entries, the longest remaining time first (as last refreshed)."""
        now = time.time()
        rows = [e.ps_row(now) for e in self._models.values() if e.loaded and e.runner]
        rows.sort(key=lambda r: r[0], reverse=True)
        return [r[1] for r in rows]

    def runners(self) -> dict[str, Runner]:
        """Loaded runners by model name (for tests and diagnostics)."""
        return {e.view.display: e.runner for e in self._models.values() if e.runner is not None}
