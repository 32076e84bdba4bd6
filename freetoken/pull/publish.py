"""Verifying a download as it arrives and putting it into the store.

Each download has one publisher thread, which hashes the file front to back as its parts
arrive, and saves the hash state now and then so a later pull goes on from there:
- a zstd blob in independent frames is decoded by the streams, each frame into a buffer
  that is written to the partial file and handed here, so the hash reads nothing back
  (but frames an earlier pull left unhashed);
- a plain blob is read back from the partial file as the parts fill it;
- a zstd blob sent as one frame (as pushes made them before frames) is read back, hashed
  and decompressed in one pass into the file's own blob, committed only when both
  digests check; a resume starts it over.
A file is renamed into the store only once its digest checks.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from typing import TYPE_CHECKING

import zstandard

from freetoken.pull.client import RegistryError
from freetoken.pull.frames import BLOCK, aligned_buffer
from freetoken.pull.parts import Cancelled, PartialFile, Verified, open_direct
from freetoken.pull.sha256 import Sha256
from freetoken.store.blobs import BlobWriter, DigestMismatch, fsync_dir

if TYPE_CHECKING:
    from freetoken.pull.downloads import Download

__all__ = ["mismatch", "publish"]

_READ = 4 << 20


def mismatch(want: str, got: str) -> RegistryError:
    """Ollama's words for a blob whose bytes do not hash to its digest."""
    return RegistryError(f"digest mismatch, file must be downloaded again: want {want}, got {got}")


def publish(d: Download) -> None:
    """Verifies and publishes `d`'s blob; raises Cancelled, RegistryError, OSError."""
    if d.layer.compressed and not d.layer.framed:
        _publish_one_frame(d)
        return
    start = d.verified
    sha = Sha256(start.state) if start else Sha256()
    pos = start.offset if start else 0
    direct = open_direct(d.partial.path, os.O_RDONLY) if d.partial.aligned else None
    fd = direct if direct is not None else os.open(d.partial.path, os.O_RDONLY)
    try:
        with _Checkpoints(d.partial, fd, d.hub.options.verified_every, pos) as saver:
            try:
                if d.frames is not None:
                    pos = _hash_frames(d, fd, sha, pos, saver)
                else:
                    pos = _hash_file(d, fd, sha, pos, saver)
            except Cancelled:
                saver.offer(sha, now=True)  # what is verified stays so for the next pull
                raise
            saver.done()
    finally:
        os.close(fd)
    _rename_if_whole(d, sha)


def _rename_if_whole(d: Download, sha: Sha256) -> None:
    d.all_parts_stopped()
    want = d.layer.local.digest
    got = "sha256:" + sha.hexdigest()
    if got != want:
        d.partial.discard()
        raise mismatch(want, got)
    d.partial.flush()
    d.partial.close()
    os.replace(d.partial.path, d.blobs.path(want))
    fsync_dir(d.blobs.root)
    d.partial.remove_states()


def _hash_file(d: Download, fd: int, sha: Sha256, pos: int, saver: _Checkpoints) -> int:
    """Hashes the partial file from `pos` as its bytes arrive; returns its size."""
    size = d.layout.file_size
    buffer = bytearray(min(_READ, max(size - pos, 1)))
    view = memoryview(buffer)
    while pos < size:
        ready = d.wait_file(pos)
        while pos < ready:
            # Into one reused buffer: fresh memory for each read costs page faults.
            n = os.preadv(fd, [view[: min(len(buffer), ready - pos)]], pos)
            if n <= 0:
                raise OSError(f"{d.partial.path.name} is shorter than its parts say")
            sha.update(view[:n])
            pos += n
            d.reread += n
        saver.offer(sha, pos)
    return pos


def _hash_frames(d: Download, fd: int, sha: Sha256, pos: int, saver: _Checkpoints) -> int:
    """Hashes the frames from the one at `pos` on, as the streams hand them over (or from
    the partial file, those an earlier pull wrote); returns the file's size."""
    layout, queue = d.layout, d.frames
    assert queue is not None
    buffer = aligned_buffer(layout.frame_size) if d.on_disk else None
    first = len(layout.frames) if pos == layout.file_size else pos // layout.frame_size
    for k in range(first, len(layout.frames)):
        offset, size = layout.frame_span(k)
        if k in d.on_disk:
            queue.reach(k)
            assert buffer is not None
            _read_exactly(fd, memoryview(buffer), offset, size)
            sha.update(memoryview(buffer)[:size])
            d.reread += size
        else:
            frame = queue.take(k)
            if frame is None:
                raise Cancelled
            sha.update(memoryview(frame)[:size])
            queue.give_back(frame)
        pos = offset + size
        saver.offer(sha, pos)
    return pos


def _read_exactly(fd: int, view: memoryview, offset: int, size: int) -> None:
    # Rounded up to whole blocks for direct I/O: a read past the end stops at the end.
    want = min(len(view), -(-size // BLOCK) * BLOCK)
    got = 0
    while got < size:
        n = os.preadv(fd, [view[got:want]], offset + got)
        if n <= 0:
            raise OSError(f"the partial file ends inside the frame at {offset}")
        got += n


class _Checkpoints:
    """Saves the hash state in a thread of its own: the bytes it covers are made durable
    first (fdatasync), which waits on the disk while hashing goes on."""

    def __init__(self, partial: PartialFile, fd: int, every: int, pos: int):
        self.partial, self.fd, self.every = partial, fd, every
        self.pos = pos  # how far the hash has gone
        self.last = pos  # the offset of the newest state handed to the thread
        self.pending: Verified | None = None
        self.closing = False
        self.changed = threading.Condition()
        self.thread: threading.Thread | None = None

    def offer(self, sha: Sha256, pos: int | None = None, now: bool = False) -> None:
        """`sha` has hashed the file up to `pos` (where it was, when None); saves that every
        `every` bytes, or `now`."""
        pos = self.pos = self.pos if pos is None else pos
        if pos <= self.last or not (now or pos - self.last >= self.every):
            return
        state = sha.state()
        if state is None:  # this Python cannot resume a hash: nothing worth saving
            return
        self.last = pos
        with self.changed:
            self.pending = Verified(pos, state)
            self.changed.notify()
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, daemon=True, name="checkpoints")
            self.thread.start()

    def done(self) -> None:
        """The whole file is hashed: a state saved now would be removed at once."""
        with self.changed:
            self.pending = None

    def _run(self) -> None:
        while True:
            with self.changed:
                self.changed.wait_for(lambda: self.pending is not None or self.closing)
                verified, self.pending = self.pending, None
            if verified is None:
                return
            try:
                os.fdatasync(self.fd)
                self.partial.save_verified(verified)
            except OSError:
                return  # a state not saved costs a longer resume, never a wrong blob

    def __enter__(self) -> _Checkpoints:
        return self

    def __exit__(self, *exc: object) -> None:
        with self.changed:
            self.closing = True
            self.changed.notify()
        if self.thread is not None:
            self.thread.join()


# -- zstd blobs of one frame --------------------------------------------------------------


def _publish_one_frame(d: Download) -> None:
    """Decompresses into a blob writer while hashing the compressed bytes; the file is
    committed only when both digests check."""
    want = d.layer.digest
    bad: zstandard.ZstdError | None = None
    with _Follower(d) as src, d.blobs.writer(d.layer.uncompressed_digest) as w:
        with _WriteBehind(w) as out:
            try:
                reader = zstandard.ZstdDecompressor().stream_reader(
                    src, read_size=1 << 20, read_across_frames=True, closefd=False
                )
                while chunk := reader.read(_READ):
                    out.write(chunk)
            except zstandard.ZstdError as e:
                bad = e
        got = src.drain()  # the rest of the input, if decompression stopped early
        d.all_parts_stopped()
        if got != want:
            d.partial.discard()
            raise mismatch(want, got)
        if bad is not None:
            d.partial.discard()
            raise RegistryError(f"layer {want} is not valid zstd data: {bad}")
        try:
            w.commit()
        except DigestMismatch as e:
            d.partial.discard()
            raise mismatch(e.expected, e.got) from None
    d.partial.discard()


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
        if self.pos >= self.d.layer.size:
            return b""
        ready = self.d.wait_file(self.pos) - self.pos
        data = os.pread(self.fd, min(n, ready) if n and n > 0 else min(ready, _READ), self.pos)
        self.pos += len(data)
        self.d.reread += len(data)
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
