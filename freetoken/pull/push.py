"""Pushing a model from the store to a registry, with Ollama's progress objects.

    {"status": "retrieving manifest"}
    {"status": "compressing <12 hex>", ...}   a file over 1 MiB, as it is compressed
    {"status": "pushing <12 hex>", "digest": ..., "total": N, "completed": M}   per blob
    {"status": "pushing manifest"}
    {"status": "success"}

Files larger than 1 MiB travel zstd-compressed as `+zstd` layers, cut into independent
frames whose sizes the layer lists (frames.py: the same bytes, so the same digest, on
every push). Each blob is HEADed first and skipped
when the registry has it; otherwise it is uploaded by POST, PATCH chunks and PUT ?digest=.
Several layers are compressed and sent at once; the manifest goes last, so the registry
never lists a model whose blobs are missing.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import httpx

from freetoken import config
from freetoken.pull.client import RegistryClient, RegistryError, TransientError
from freetoken.pull.downloads import os_error
from freetoken.pull.frames import compress_frames
from freetoken.pull.parts import Cancelled, TransferOptions
from freetoken.pull.wire import ZSTD, WireLayer, WireManifest, locate
from freetoken.store import manifest as mf

if TYPE_CHECKING:
    from freetoken.store.models import Store

__all__ = ["COMPRESS_ABOVE", "PushStats", "push", "push_model"]

COMPRESS_ABOVE = 1 << 20
_POLL_S = 0.1
Progress = dict[str, Any]

# (file digest, frame size) -> (compressed digest, size, frame sizes), learnt by
# compressing: the same bytes always compress the same way, so a push need not compress
# again to know what to ask for.
_zstd_digests: dict[tuple[str, int], tuple[str, int, tuple[int, ...]]] = {}
_plain: set[str] = set()  # files found not worth compressing
WORTH_COMPRESSING = 0.95  # compressed/original above this: the file travels uncompressed


@dataclass
class PushStats:
    name: str = ""
    sent_bytes: int = 0  # bytes uploaded (compressed where compressed)
    skipped_bytes: int = 0  # wire bytes the registry already had
    seconds: float = 0.0


class _Upload:
    """One blob of the model: compressed if it is a large file, then sent unless present."""

    def __init__(
        self,
        store: Store,
        layer: mf.Layer,
        client: RegistryClient,
        repo: str,
        opts: TransferOptions,
    ):
        self.store, self.layer, self.client, self.repo, self.opts = store, layer, client, repo, opts
        self.compress = (
            layer.media_type == mf.FILE
            and layer.size > COMPRESS_ABOVE
            and layer.digest not in _plain
        )
        self.wire: WireLayer | None = None if self.compress else WireLayer.of(layer)
        if self.compress and (known := _zstd_digests.get((layer.digest, opts.frame_size))):
            self.wire = self._framed(*known)
        self.compressing = self.wire is None  # False once done, or when it need not be
        self.compressed = False
        self.completed = 0
        self.sent = 0
        self.skipped = False

    def events(self) -> list[Progress]:
        """The job's state as progress objects: a file compressed here keeps its finished
        `compressing` bar beside the `pushing` one of its compressed blob."""
        layer, wire, out = self.layer, self.wire, []
        if self.compressing or self.compressed:
            done = layer.size if self.compressed else self.completed
            out.append(
                {
                    "status": f"compressing {layer.digest[7:19]}",
                    "digest": layer.digest,
                    "total": layer.size,
                    "completed": done,
                }
            )
        if wire is not None and not self.compressing:
            out.append(
                {
                    "status": f"pushing {wire.digest[7:19]}",
                    "digest": wire.digest,
                    "total": wire.size,
                    "completed": self.completed,
                }
            )
        return out

    def run(self, cancelled: threading.Event) -> None:
        source = self.store.blobs.path(self.layer.digest)
        tmp: Path | None = None
        try:
            # A file compressed before (in this process) is known by its compressed digest,
            # so a blob the registry has costs one HEAD and no compression.
            if self.wire is not None and self.client.has_blob(self.repo, self.wire.digest):
                self.skipped = True
                self.completed = self.wire.size
                return
            if self.compress:
                tmp = self._compressed(source, cancelled)
                source = tmp or source  # None: not worth it, the file goes as it is
                if self.client.has_blob(self.repo, self.wire.digest):
                    self.skipped = True
                    self.completed = self.wire.size
                    return
            self._send(source, cancelled)
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)

    def _compressed(self, source: Path, cancelled: threading.Event) -> Path | None:
        """The file compressed into a temporary file (None if that saves too little); sets
        the wire layer."""
        self.compressing, self.completed = True, 0

        def advance(n: int) -> None:
            if cancelled.is_set():
                raise Cancelled
            self.completed += n  # one thread per upload; readers only compare values

        # Next to the blobs (so the start-up prune removes what a crash leaves behind).
        fd, name = tempfile.mkstemp(dir=self.store.blobs.root, prefix="push-")
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as f:
                digest, size, frames = compress_frames(source, f, self.opts.frame_size, advance)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise os_error(e, f"a compressed copy of {self.layer.name}") from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        layer = self.layer
        if self.completed != layer.size:  # the wire manifest would promise other bytes
            tmp.unlink(missing_ok=True)
            raise RegistryError(
                f"{layer.name} has {self.completed} bytes in the store, but its "
                f"manifest says {layer.size}",
                500,
            )
        self.completed = 0
        self.compressing, self.compressed = False, True
        if size > WORTH_COMPRESSING * layer.size:
            # Nearly incompressible: sent as it is, so a pull only hashes it and can
            # rename the downloaded file into the store instead of decompressing it.
            tmp.unlink(missing_ok=True)
            _plain.add(layer.digest)
            self.wire = WireLayer.of(layer)
            return None
        _zstd_digests[(layer.digest, self.opts.frame_size)] = (digest, size, frames)
        self.wire = self._framed(digest, size, frames)
        return tmp

    def _framed(self, digest: str, size: int, frames: tuple[int, ...]) -> WireLayer:
        layer = self.layer
        return WireLayer(
            ZSTD, digest, size, layer.name, layer.digest, layer.size, self.opts.frame_size, frames
        )

    def _send(self, path: Path, cancelled: threading.Event) -> None:
        failures = 0
        while True:
            try:
                self._send_once(path, cancelled)
                return
            except TransientError as e:
                failures += 1
                if failures > self.opts.retries:
                    raise RegistryError(
                        f"uploading {self.wire and self.wire.digest}: {e}", e.status
                    ) from None
                self.completed = 0
                if cancelled.wait(self.opts.backoff * 2 ** (failures - 1)):
                    raise Cancelled from None

    def _send_once(self, path: Path, cancelled: threading.Event) -> None:
        assert self.wire is not None
        size = self.wire.size
        location = self.client.start_upload(self.repo)
        with open(path, "rb") as f:
            offset = 0
            while offset < size:
                n = min(self.opts.upload_chunk, size - offset)
                chunks = self._chunks(f, n, cancelled)
                location = self.client.upload_chunk(location, chunks, offset, n)
                offset += n
        self.client.finish_upload(location, self.wire.digest)
        self.sent += size

    def _chunks(self, f: BinaryIO, n: int, cancelled: threading.Event) -> Iterator[bytes]:
        left = n
        while left > 0:
            if cancelled.is_set():
                raise Cancelled
            block = f.read(min(1 << 20, left))
            if not block:
                raise RegistryError(
                    f"{f.name} is shorter than its {self.wire and self.wire.size} bytes"
                )
            left -= len(block)
            yield block
            self.completed += len(block)


def push(
    store: Store,
    name: str,
    insecure: bool = False,
    *,
    cfg: Any = None,
    options: TransferOptions | None = None,
    transport: httpx.BaseTransport | None = None,
    stats: PushStats | None = None,
) -> Iterator[Progress]:
    """Pushes `name` from `store`, yielding progress; raises ModelNotFound, RegistryError."""
    cfg = cfg or config.current()
    local, remote = locate(name, cfg.registry, insecure)
    opts = options or TransferOptions.from_config(cfg)
    stats = stats if stats is not None else PushStats()
    yield {"status": "retrieving manifest", "registry": remote.base_url}
    view = store.resolve(local)
    stats.name = view.display
    client = RegistryClient(
        remote.base_url,
        cfg.registry_token,
        transport=transport,
        read_timeout=opts.stall_timeout,
        max_connections=opts.streams + 2,
        key_file=cfg.key,
    )
    try:
        jobs: dict[str, _Upload] = {}
        for layer in (view.manifest.config, *view.manifest.layers):
            jobs.setdefault(layer.digest, _Upload(store, layer, client, remote.repo, opts))
        yield from _run(list(jobs.values()), opts)
        stats.sent_bytes = sum(j.sent for j in jobs.values())
        stats.skipped_bytes = sum(j.wire.size for j in jobs.values() if j.skipped and j.wire)
        wire = WireManifest(
            _wire(jobs, view.manifest.config), tuple(_wire(jobs, x) for x in view.manifest.layers)
        )
        yield {"status": "pushing manifest"}
        client.put_manifest(remote.repo, remote.name.tag, wire.to_bytes())
    finally:
        client.close()
    yield {"status": "success"}


def _wire(jobs: dict[str, _Upload], layer: mf.Layer) -> WireLayer:
    wire = jobs[layer.digest].wire
    assert wire is not None
    return wire


def _run(jobs: list[_Upload], opts: TransferOptions) -> Iterator[Progress]:
    """Runs the uploads `opts.streams` at a time, reporting each as it moves."""
    cancelled = threading.Event()
    reported: dict[str, int] = {}  # status -> bytes last reported
    with ThreadPoolExecutor(max_workers=opts.streams, thread_name_prefix="push") as pool:
        futures = [pool.submit(job.run, cancelled) for job in jobs]
        try:
            while True:
                finished = all(f.done() for f in futures)
                for job in jobs:
                    for ev in job.events():
                        if reported.get(ev["status"]) != ev["completed"]:
                            reported[ev["status"]] = ev["completed"]
                            yield ev
                for f in futures:
                    if f.done() and f.exception() is not None:
                        raise f.exception()  # type: ignore[misc]
                if finished:
                    return
                wait(futures, timeout=_POLL_S, return_when=FIRST_EXCEPTION)
        finally:
            cancelled.set()  # uploads still running stop at their next chunk


def push_model(
    store: Store,
    name: str,
    insecure: bool = False,
    progress: Callable[[Progress], None] | None = None,
    **kw: Any,
) -> PushStats:
    """Runs a push to its end (calling `progress` with each object); returns what it sent."""
    stats = PushStats()
    start = time.perf_counter()
    for event in push(store, name, insecure, stats=stats, **kw):
        if progress is not None:
            progress(event)
    stats.seconds = time.perf_counter() - start
    return stats
