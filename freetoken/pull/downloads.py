"""Blob downloads shared by every pull in the process, over one pool of streams.

`Transfers.acquire` returns the download of a blob, starting one only if no pull is
fetching that blob already; later pulls of the same digest wait on it and report its
progress. Parts of all downloads wait in one FIFO queue served by up to `streams` worker
threads, so a model's first layers finish first, a blob's parts arrive about in order, and
one large blob alone keeps every stream busy. The streams write (and, for a zstd blob in
frames, decompress) what they receive into the partial file; a publisher thread per
download verifies it as it fills (publish.py). When the last pull waiting on a download
goes away, the download stops and leaves its partial file to be resumed.
"""

from __future__ import annotations

import errno
import logging
import threading
from collections import deque
from pathlib import Path
from typing import Any

import httpx

from freetoken.pull.client import RegistryClient, RegistryError
from freetoken.pull.frames import FrameQueue, Layout
from freetoken.pull.parts import (
    Cancelled,
    Part,
    PartialFile,
    TransferOptions,
    Verified,
    fetch_part,
    partial_path,
)
from freetoken.pull.publish import mismatch, publish
from freetoken.pull.wire import WireLayer
from freetoken.store.blobs import BlobStore

__all__ = ["Download", "Transfers", "mismatch", "os_error", "shared_transfers"]

log = logging.getLogger(__name__)


def os_error(e: OSError, what: str) -> RegistryError:
    """A failed write as the user should read it (a full disk is 507 Insufficient Storage)."""
    if e.errno == errno.ENOSPC:
        return RegistryError(f"no space left on device while writing {what}", 507)
    return RegistryError(f"writing {what}: {e.strerror or e}")


class Download:
    """One blob being fetched into `<blobs>/<digest>-partial`, then published."""

    def __init__(
        self, hub: Transfers, blobs: BlobStore, layer: WireLayer, client: RegistryClient, repo: str
    ):
        self.hub = hub
        self.blobs = blobs
        self.layer = layer
        self.client = client
        self.repo = repo
        self.layout = Layout.of(layer)
        self.partial = PartialFile(blobs.root, layer.digest, self.layout)
        self.parts: list[Part] = []
        self.verified: Verified | None = None  # how far an earlier pull hashed the file
        self.frames: FrameQueue | None = None  # decoded frames on their way to the hash
        self.on_disk: set[int] = set()  # frames an earlier pull wrote but did not hash
        self.subscribers = 0
        self.received = 0  # bytes fetched over the network by this download
        self.reread = 0  # file bytes its publisher read back from disk to hash them
        self.cancelled = threading.Event()
        self.done = threading.Event()  # set once nothing runs for it any more
        self.error: BaseException | None = None
        self.published = False
        self._data = threading.Condition()  # notified as bytes land in the partial file
        self._parts_left = 0  # parts queued or running
        self._pending = 0  # the same, plus the publisher while it runs

    @property
    def key(self) -> Path:
        return self.partial.path

    @property
    def completed(self) -> int:
        if self.published:
            return self.layer.size
        return sum(p.completed for p in self.parts)

    def _frontier(self) -> int:
        """How many bytes from the start of the blob are in the partial file."""
        pos = 0
        for p in self.parts:
            pos += p.completed
            if not p.done:
                break
        return pos

    def wait_file(self, pos: int) -> int:
        """Waits until the partial file holds bytes, in order, past its offset `pos`;
        returns how far they go. Raises Cancelled when the download stops first."""
        with self._data:
            while (ready := self.layout.file_pos(self._frontier())) <= pos:
                if self.cancelled.is_set():
                    raise Cancelled
                self._data.wait(1.0)
        if self.cancelled.is_set():
            raise Cancelled
        return ready

    def all_parts_stopped(self) -> None:
        """Waits until no worker touches the partial or its state files any more."""
        with self._data:
            self._data.wait_for(lambda: self._parts_left == 0)
        if self.cancelled.is_set():
            raise Cancelled

    # -- lifecycle (called by the hub and its workers) ------------------------------------

    def _start(self) -> None:
        """Opens or resumes the partial file, queues the missing parts and starts the
        publisher, which verifies the blob as its bytes arrive."""
        try:
            if self.blobs.has(self.layer.local.digest):
                self.published = True  # stored meanwhile by someone else
                self._stop()
                return
            self.parts, self.verified = self.partial.open(self.hub.options)
        except OSError as e:
            self._fail(os_error(e, self.partial.path.name))
            self._stop()
            return
        todo = [p for p in self.parts if not p.done]
        if self.layout.framed:
            self._queue_frames()
        self._parts_left = len(todo)
        self._pending = len(todo) + 1
        threading.Thread(
            target=self._publish, daemon=True, name=f"publish-{self.layer.digest[7:19]}"
        ).start()
        if todo:
            self.hub._enqueue(self, todo)

    def _queue_frames(self) -> None:
        """The queue that carries frames to the hash, with room for every frame the
        streams can have in flight, and the frames already in the partial file."""
        layout = self.layout
        spans = [
            (layout.frame_at(p.offset), layout.frame_at(p.start), layout.frame_at(p.end))
            for p in self.parts
        ]
        self.on_disk = {k for first, resume, _ in spans for k in range(first, resume)}
        per_part = max((end - first for first, _, end in spans), default=1)
        streams = self.hub.options.streams
        self.frames = FrameQueue(layout.frame_size, streams * per_part + 1, streams)

    def _run_part(self, part: Part) -> None:
        try:
            if not self.cancelled.is_set():
                fetch_part(
                    self.client,
                    self.repo,
                    self.layer.digest,
                    part,
                    self.partial,
                    self.hub.options,
                    self.cancelled,
                    self._on_bytes,
                    self.frames,
                )
        except Cancelled:
            pass
        except OSError as e:
            self._fail(os_error(e, self.partial.path.name))
        except (RegistryError, httpx.HTTPError) as e:
            self._fail(e)
        except Exception as e:  # a bug must still end the download, or pulls wait forever
            log.exception("download of %s failed", self.layer.digest)
            self._fail(e)
        finally:
            self._part_finished()

    def _part_finished(self) -> None:
        with self._data:
            self._parts_left -= 1
            self._data.notify_all()
        self._release()

    def _cancel_queued(self) -> None:
        """Parts still waiting for a stream will not run: account for them now, so a
        stopped download ends without waiting for streams busy with other blobs."""
        for _ in range(self.hub._drop_queued(self)):
            self._part_finished()

    def _on_bytes(self, n: int) -> None:
        # Several workers add at once, and `+=` on an attribute is not atomic.
        with self.hub.count_lock:
            self.received += n
            self.hub.received += n
        self._wake()

    def _wake(self) -> None:
        with self._data:
            self._data.notify_all()

    def _halt(self) -> None:
        """Wakes whatever waits on this download, which has been cancelled."""
        self._cancel_queued()
        if self.frames is not None:
            self.frames.stop()
        self._wake()

    def _fail(self, e: BaseException) -> None:
        with self.hub.lock:
            if self.error is None:
                self.error = e
            self.cancelled.set()
            self.hub.changed.notify_all()
        self._halt()

    def _release(self) -> None:
        """A part or the publisher is through; the last one out stops the download."""
        with self.hub.lock:
            self._pending -= 1
            last = self._pending == 0
            self.hub.changed.notify_all()
        if last:
            self._stop()

    def _stop(self) -> None:
        self.partial.close()
        with self.hub.lock:
            self.done.set()
            if self.hub._active.get(self.key) is self:
                del self.hub._active[self.key]
            self.hub.changed.notify_all()

    # -- publishing ------------------------------------------------------------------------

    def _publish(self) -> None:
        try:
            publish(self)
            self.published = True
        except Cancelled:
            pass  # the partial stays; a later pull goes on from it
        except OSError as e:
            self._fail(os_error(e, self.layer.local.digest))
        except Exception as e:
            self._fail(e)
        finally:
            self._release()


class Transfers:
    """The process's downloads, their shared part queue and its worker threads."""

    def __init__(self, options: TransferOptions | None = None):
        self.options = options or TransferOptions()
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)  # notified as parts and downloads end
        self.received = 0  # bytes fetched by all downloads, for benchmarks
        self.count_lock = threading.Lock()
        self._active: dict[Path, Download] = {}
        self._queue: deque[tuple[Download, Part]] = deque()
        self._workers = 0
        self._clients: dict[tuple[Any, ...], RegistryClient] = {}

    def client(
        self,
        base_url: str,
        token: str,
        transport: httpx.BaseTransport | None = None,
        key_file: Path | None = None,
    ) -> RegistryClient:
        """A pooled client per registry; downloads outlive the pull that started them."""
        key = (base_url, token, transport, key_file)
        with self.lock:
            if key not in self._clients:
                self._clients[key] = RegistryClient(
                    base_url,
                    token,
                    transport=transport,
                    read_timeout=self.options.stall_timeout,
                    max_connections=self.options.streams + 4,
                    key_file=key_file,
                )
            return self._clients[key]

    def acquire(
        self, blobs: BlobStore, layer: WireLayer, client: RegistryClient, repo: str
    ) -> Download:
        """The download of `layer` into `blobs`, shared with any pull already fetching it."""
        key = partial_path(blobs.root, layer.digest)
        with self.lock:
            while (d := self._active.get(key)) is not None and d.cancelled.is_set():
                # A download winding down still writes its partial: let it finish first.
                self.changed.wait(0.1)
            if d is not None:
                d.subscribers += 1
                return d
            d = self._active[key] = Download(self, blobs, layer, client, repo)
            d.subscribers = 1
        d._start()
        return d

    def release(self, d: Download) -> None:
        """A pull stops waiting on `d`; the last one to go stops it."""
        with self.lock:
            d.subscribers -= 1
            stop = d.subscribers == 0 and not d.done.is_set()
            if stop:
                d.cancelled.set()
                self.changed.notify_all()
        if stop:
            d._halt()  # the publisher may be waiting for bytes that will not come now

    def wait(self, timeout: float) -> None:
        with self.lock:
            self.changed.wait(timeout)

    def wait_idle(self, timeout: float) -> bool:
        """Waits until no download runs (each has written its last byte and state)."""
        with self.lock:
            return self.changed.wait_for(lambda: not self._active, timeout)

    def _enqueue(self, d: Download, parts: list[Part]) -> None:
        with self.lock:
            self._queue.extend((d, p) for p in parts)
            start = min(self.options.streams - self._workers, len(self._queue))
            self._workers += max(start, 0)
        for _ in range(start):
            threading.Thread(target=self._work, daemon=True, name="pull-stream").start()

    def _drop_queued(self, d: Download) -> int:
        """Takes `d`'s parts out of the queue; returns how many there were."""
        with self.lock:
            before = len(self._queue)
            self._queue = deque(x for x in self._queue if x[0] is not d)
            return before - len(self._queue)

    def _work(self) -> None:
        while True:
            with self.lock:
                if not self._queue:
                    self._workers -= 1
                    return
                d, part = self._queue.popleft()
            d._run_part(part)

    def close(self) -> None:
        with self.lock:
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()


_shared: Transfers | None = None
_shared_lock = threading.Lock()


def shared_transfers(options: TransferOptions) -> Transfers:
    """The process's hub: one download per digest across all pulls (the first caller's
    options stay in force)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = Transfers(options)
        return _shared
