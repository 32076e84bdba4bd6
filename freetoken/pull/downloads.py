"""Blob downloads shared by every pull in the process, over one pool of streams.

`Transfers.acquire` returns the download of a blob, starting one only if no pull is
fetching that blob already; later pulls of the same digest wait on it and report its
progress. Parts of all downloads wait in one FIFO queue served by up to `streams` worker
threads, so a model's first layers finish first and one large blob alone keeps every
stream busy. When the last pull waiting on a download goes away, the download stops and
leaves its partial file to be resumed.

Each download has a publisher thread that reads the partial file front to back as the
parts fill it, so checking overlaps fetching: a plain blob is hashed, and renamed into the
store once whole; a `+zstd` blob is hashed and decompressed in the same pass into the
file's own blob, committed only when both digests check. Nothing reaches the store before
its digest is verified.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import queue
import threading
from collections import deque
from pathlib import Path
from typing import Any

import httpx
import zstandard

from freetoken.pull.client import RegistryClient, RegistryError
from freetoken.pull.parts import Cancelled, Part, PartialFile, TransferOptions, fetch_part
from freetoken.pull.wire import WireLayer
from freetoken.store.blobs import BlobStore, BlobWriter, DigestMismatch, fsync_dir

__all__ = ["Download", "Transfers", "shared_transfers"]

_READ = 4 << 20

log = logging.getLogger(__name__)


def mismatch(want: str, got: str) -> RegistryError:
    """Ollama's words for a blob whose bytes do not hash to its digest."""
    return RegistryError(f"digest mismatch, file must be downloaded again: want {want}, got {got}")


def os_error(e: OSError, what: str) -> RegistryError:
    """A failed write as the user should read it (a full disk is 507 Insufficient Storage)."""
    if e.errno == errno.ENOSPC:
        return RegistryError(f"no space left on device while writing {what}", 507)
    return RegistryError(f"writing {what}: {e.strerror or e}")


class Download:
    """One blob being fetched into `<blobs>/<digest>-partial`, then published."""

    def __init__(self, hub: Transfers, blobs: BlobStore, layer: WireLayer, client: RegistryClient,
                 repo: str):
        self.hub = hub
        self.blobs = blobs
        self.layer = layer
        self.client = client
        self.repo = repo
        self.partial = PartialFile(blobs.root, layer.digest, layer.size)
        self.parts: list[Part] = []
        self.subscribers = 0
        self.received = 0  # bytes fetched over the network by this download
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

    # -- lifecycle (called by the hub and its workers) ------------------------------------

    def _start(self) -> None:
        """Opens or resumes the partial file, queues the missing parts and starts the
        publisher, which hashes (and decompresses) the blob as its bytes arrive."""
        try:
            if self.blobs.has(self.layer.local.digest):
                self.published = True  # stored meanwhile by someone else
                self._stop()
                return
            self.parts = self.partial.open(self.hub.options)
        except OSError as e:
            self._fail(os_error(e, self.partial.path.name))
            self._stop()
            return
        todo = [p for p in self.parts if not p.done]
        self._parts_left = len(todo)
        self._pending = len(todo) + 1
        threading.Thread(target=self._publish, daemon=True,
                         name=f"publish-{self.layer.digest[7:19]}").start()
        if todo:
            self.hub._enqueue(self, todo)

    def _run_part(self, part: Part) -> None:
        try:
            if not self.cancelled.is_set():
                fetch_part(self.client, self.repo, self.layer.digest, part, self.partial,
                           self.hub.options, self.cancelled, self._on_bytes)
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

    def _fail(self, e: BaseException) -> None:
        with self.hub.lock:
            if self.error is None:
                self.error = e
            self.cancelled.set()
            self.hub.changed.notify_all()
        self._cancel_queued()
        self._wake()

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
            with _Follower(self) as src:
                if self.layer.compressed:
                    self._publish_compressed(src)
                else:
                    self._publish_plain(src)
            self.published = True
        except Cancelled:
            pass  # the partial stays; a later pull goes on from it
        except OSError as e:
            self._fail(os_error(e, self.layer.local.digest))
        except Exception as e:
            self._fail(e)
        finally:
            self._release()

    def _all_parts_stopped(self) -> None:
        """Waits until no worker touches the partial or its state files any more."""
        with self._data:
            self._data.wait_for(lambda: self._parts_left == 0)
        if self.cancelled.is_set():
            raise Cancelled

    def _publish_plain(self, src: _Follower) -> None:
        want = self.layer.digest
        got = src.drain()
        self._all_parts_stopped()
        if got != want:
            self.partial.discard()
            raise mismatch(want, got)
        self.partial.flush()
        self.partial.close()
        os.replace(self.partial.path, self.blobs.path(want))
        fsync_dir(self.blobs.root)
        self.partial.remove_states()

    def _publish_compressed(self, src: _Follower) -> None:
        """Decompresses into a blob writer while hashing the compressed bytes; the file is
        committed only when both digests check."""
        want = self.layer.digest
        bad: zstandard.ZstdError | None = None
        with self.blobs.writer(self.layer.uncompressed_digest) as w:
            with _WriteBehind(w) as out:
                try:
                    reader = zstandard.ZstdDecompressor().stream_reader(
                        src, read_size=1 << 20, read_across_frames=True, closefd=False)
                    while chunk := reader.read(_READ):
                        out.write(chunk)
                except zstandard.ZstdError as e:
                    bad = e
            got = src.drain()  # the rest of the input, if decompression stopped early
            self._all_parts_stopped()
            if got != want:
                self.partial.discard()
                raise mismatch(want, got)
            if bad is not None:
                self.partial.discard()
                raise RegistryError(f"layer {want} is not valid zstd data: {bad}")
            try:
                w.commit()
            except DigestMismatch as e:
                self.partial.discard()
                raise mismatch(e.expected, e.got) from None
        self.partial.discard()


class _Follower:
    """The partial file read front to back as its bytes arrive, and hashed on the way;
    a read waits for the parts ahead of it and raises Cancelled when the download stops."""

    def __init__(self, d: Download):
        self.d = d
        # Unbuffered reads at explicit offsets: a buffered reader would read ahead into
        # bytes that have not arrived yet, and keep them.
        self.fd = os.open(d.partial.path, os.O_RDONLY)
        self.pos = 0
        self.hash = hashlib.sha256()

    def __enter__(self) -> _Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)

    def read(self, n: int = -1) -> bytes:
        d = self.d
        with d._data:
            while (ready := d._frontier() - self.pos) <= 0 and self.pos < d.layer.size:
                if d.cancelled.is_set():
                    raise Cancelled
                d._data.wait(1.0)
        if d.cancelled.is_set():
            raise Cancelled
        data = os.pread(self.fd, min(n, ready) if n and n > 0 else min(ready, _READ), self.pos)
        self.pos += len(data)
        self.hash.update(data)
        return data

    def drain(self) -> str:
        """Reads what is left; returns the digest of all the bytes."""
        while self.read(_READ):
            pass
        return "sha256:" + self.hash.hexdigest()


class _WriteBehind:
    """Hands chunks to a thread that hashes and writes them, so decompressing (this thread)
    and hashing plus writing (that one) run side by side; a write error is raised on exit."""

    def __init__(self, w: BlobWriter):
        self.w = w
        self.chunks: queue.Queue[bytes | None] = queue.Queue(maxsize=8)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="write-behind")
        self.thread.start()

    def _run(self) -> None:
        while (chunk := self.chunks.get()) is not None:
            if self.error is None:
                try:
                    self.w.write(chunk)
                except BaseException as e:  # kept, and the queue drained so the producer ends
                    self.error = e

    def write(self, chunk: bytes) -> None:
        if self.error is not None:
            raise self.error
        self.chunks.put(chunk)

    def __enter__(self) -> _WriteBehind:
        return self

    def __exit__(self, *exc: object) -> None:
        self.chunks.put(None)
        self.thread.join()
        if self.error is not None and exc[0] is None:
            raise self.error




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

    def client(self, base_url: str, token: str, transport: httpx.BaseTransport | None = None
               ) -> RegistryClient:
        """A pooled client per registry; downloads outlive the pull that started them."""
        key = (base_url, token, transport)
        with self.lock:
            if key not in self._clients:
                self._clients[key] = RegistryClient(
                    base_url, token, transport=transport, read_timeout=self.options.stall_timeout,
                    max_connections=self.options.streams + 4)
            return self._clients[key]

    def acquire(self, blobs: BlobStore, layer: WireLayer, client: RegistryClient,
                repo: str) -> Download:
        """The download of `layer` into `blobs`, shared with any pull already fetching it."""
        key = PartialFile(blobs.root, layer.digest, layer.size).path
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
            d._cancel_queued()
            d._wake()  # the publisher may be waiting for bytes that will not come now

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
