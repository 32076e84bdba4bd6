"""Resumable ranged downloads of one blob: the partial file, its parts and what is verified.

A blob is fetched as parts (byte ranges of the blob on the wire) that are handed out in
order, so its bytes arrive about front to back and can be hashed as they come. A part's
bytes land in `<blobs>/sha256-<hex>-partial` (hex: the wire digest): as they are, or, for a
zstd layer in independent frames, decompressed frame by frame at the file's own offsets,
so that the partial file becomes the file itself. Progress is kept in small JSON files:

  `<partial>-<N>`        a part that has begun: {"N", "Offset", "Size", "Completed"}
                         (Ollama's shape, in wire bytes), rewritten every few MiB and
                         whenever the part stops;
  `<partial>-verified`   {"Offset", "Sha256"}: the running hash state of the file's first
                         Offset bytes, saved only once those bytes are on disk.

A later pull continues each part where it stopped and the hash where it was saved, so what
is verified is neither fetched nor read again; a state that does not fit is ignored (it
costs bytes, never correctness). The state never claims bytes that were not written to
the file first, and the whole file's digest is checked before it is published.
"""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freetoken.pull.client import RegistryClient, RegistryError, TransientError
from freetoken.pull.frames import (
    BLOCK,
    CorruptFrame,
    FrameQueue,
    Layout,
    aligned_buffer,
    decode_frame,
)
from freetoken.pull.options import TransferOptions
from freetoken.pull.sha256 import Sha256

__all__ = [
    "Cancelled",
    "Part",
    "PartialFile",
    "TransferOptions",
    "Verified",
    "fetch_part",
    "open_direct",
    "partial_path",
    "plan_parts",
]

_WRITE_BUFFER = 1 << 20


class Cancelled(Exception):
    """Every pull waiting for this download went away."""


@dataclass(slots=True)
class Part:
    n: int
    offset: int
    size: int
    completed: int = 0

    @property
    def done(self) -> bool:
        return self.completed >= self.size

    @property
    def start(self) -> int:
        return self.offset + self.completed

    @property
    def end(self) -> int:
        return self.offset + self.size

    def to_json(self) -> dict[str, int]:
        return {"N": self.n, "Offset": self.offset, "Size": self.size, "Completed": self.completed}


@dataclass(frozen=True, slots=True)
class Verified:
    """The file's first `offset` bytes are on disk and hash to the SHA-256 `state`."""

    offset: int
    state: bytes


def plan_parts(layout: Layout | int, opts: TransferOptions) -> list[Part]:
    """Parts of at most `part_size` (and about total/streams, so one small blob alone keeps
    every stream busy); a framed blob is cut between frames."""
    if isinstance(layout, int):
        layout = Layout(layout)
    total = layout.wire_size
    if total <= 0:
        return []
    size = max(opts.min_part_size, min(opts.part_size, math.ceil(total / opts.streams)))
    if layout.framed:
        return [Part(n, off, length) for n, (off, length) in enumerate(layout.cut(size))]
    return [Part(n, off, min(size, total - off)) for n, off in enumerate(range(0, total, size))]


def partial_path(blobs_root: Path, digest: str) -> Path:
    return Path(blobs_root) / (digest.replace(":", "-") + "-partial")


class PartialFile:
    """`<blobs>/sha256-<hex>-partial`, its `-<N>` part states and its `-verified` hash state."""

    def __init__(self, blobs_root: Path, digest: str, layout: Layout | int):
        self.path = partial_path(blobs_root, digest)
        self.layout = Layout(layout) if isinstance(layout, int) else layout
        self._fd: int | None = None
        self.direct: int | None = None  # the same file opened for direct I/O, if it can be
        self._state_lock = threading.Lock()

    def state_path(self, n: int) -> Path:
        return self.path.with_name(f"{self.path.name}-{n}")

    @property
    def verified_path(self) -> Path:
        return self.path.with_name(self.path.name + "-verified")

    def _state_files(self) -> list[Path]:
        prefix = self.path.name + "-"
        return [p for p in self.path.parent.glob(prefix + "*") if p.name[len(prefix) :].isdigit()]

    def _saved(self, plan: list[Part]) -> dict[int, int]:
        """Part number -> bytes completed, for the state files that fit the plan."""
        out = {}
        for p in self._state_files():
            try:
                s = json.loads(p.read_text())
                n, offset, size, done = (int(s[k]) for k in ("N", "Offset", "Size", "Completed"))
            except (OSError, ValueError, KeyError, TypeError):
                continue
            fits = 0 <= n < len(plan) and (plan[n].offset, plan[n].size) == (offset, size)
            if fits and p.name == self.state_path(n).name and 0 <= done <= size:
                # A framed part resumes at a frame's start: a frame decodes only whole.
                out[n] = self.layout.align(offset + done) - offset if done < size else done
        return out

    def load_verified(self) -> Verified | None:
        """The saved hash state, if this Python can resume it and it fits the file."""
        if not Sha256.resumable:
            return None
        try:
            s = json.loads(self.verified_path.read_text())
            v = Verified(int(s["Offset"]), bytes.fromhex(s["Sha256"]))
            Sha256(v.state)
        except (OSError, ValueError, KeyError, TypeError):
            return None
        fits = 0 <= v.offset <= self.layout.file_size and self.layout.wire_pos(v.offset) is not None
        return v if fits else None

    def _resume(self, plan: list[Part]) -> Verified | None:
        """Fills in the plan's progress from the saved state; returns the saved hash state."""
        saved = self._saved(plan)
        verified = self.load_verified()
        upto = self.layout.wire_pos(verified.offset) if verified else 0
        for part in plan:
            # The verified bytes are on disk even where a part's state lags behind them.
            part.completed = max(saved.get(part.n, 0), min(part.size, max(0, upto - part.offset)))
        return verified

    def open(self, opts: TransferOptions) -> tuple[list[Part], Verified | None]:
        """Opens (resuming when it can); returns the parts and how far the file is verified.
        Raises OSError (e.g. ENOSPC)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        parts = plan_parts(self.layout, opts)
        verified = None
        if self.path.is_file() and self.path.stat().st_size == self.layout.file_size:
            verified = self._resume(parts)
        else:
            self.discard()  # a file of another size is no partial of this blob
        fresh = not self.path.exists()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if fresh:
            try:
                _allocate(self._fd, self.layout.file_size)
            except OSError:
                self.close()
                self.discard()
                raise
        if self.aligned:
            self.direct = open_direct(self.path, os.O_RDWR)
        return parts, verified

    @property
    def aligned(self) -> bool:
        """Frames start on block boundaries, as direct I/O needs."""
        return self.layout.framed and self.layout.frame_size % BLOCK == 0

    def write(self, offset: int, chunks: list[Any]) -> None:
        """Writes the chunks back to back at `offset`, in one system call when it can."""
        assert self._fd is not None
        views = [memoryview(c) for c in chunks if len(c)]
        while views:
            n = os.pwritev(self._fd, views, offset)
            offset += n
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]

    def write_frame(self, offset: int, data: memoryview) -> None:
        """Writes a decoded frame from an aligned buffer: past the page cache when the file
        allows direct I/O (the store reads it that way too, and a pull of many GB should
        not push everything else out of memory), its last partial block through the cache."""
        whole = len(data) - len(data) % BLOCK if self.direct is not None else 0
        if whole:
            try:
                done = os.pwritev(self.direct, [data[:whole]], offset)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                done, whole = 0, 0  # a device that wants larger blocks: through the cache
            if done != whole:  # direct writes are all or nothing but for errors
                raise OSError(errno.EIO, f"short direct write to {self.path.name}")
        self.write(offset + whole, [data[whole:]])

    def save(self, part: Part) -> None:
        """Writes the part's state atomically (a kill mid-write leaves the old state)."""
        self._replace(self.state_path(part.n), part.to_json())

    def save_verified(self, verified: Verified) -> None:
        """Records a hash state; the caller has made the bytes before it durable."""
        self._replace(
            self.verified_path, {"Offset": verified.offset, "Sha256": verified.state.hex()}
        )

    def _replace(self, path: Path, obj: dict[str, Any]) -> None:
        tmp = path.with_name(path.name + ".tmp")
        with self._state_lock:
            tmp.write_text(json.dumps(obj))
            os.replace(tmp, path)

    def flush(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.direct is not None:
            os.close(self.direct)
            self.direct = None

    def remove_states(self) -> None:
        for p in self._state_files():
            p.unlink(missing_ok=True)
        self.verified_path.unlink(missing_ok=True)

    def discard(self) -> None:
        self.close()
        self.remove_states()
        self.path.unlink(missing_ok=True)


def open_direct(path: Path, flags: int) -> int | None:
    """`path` opened for direct I/O, or None where the system or filesystem (tmpfs) has none."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return None
    try:
        return os.open(path, flags | direct)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        return None


def _allocate(fd: int, size: int) -> None:
    """Reserves the file's space up front, so a full disk fails before the first byte."""
    if size == 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)  # a filesystem without fallocate: sparse, filled as parts land


def state_every(part: Part, opts: TransferOptions) -> int:
    """Bytes between saves of a part's state: `state_every`, and at least four saves a part,
    so a pull killed (no state saved as it dies) loses less than a quarter of each part."""
    return min(opts.state_every, max(part.size // 4, 1 << 16))


def fetch_part(
    client: RegistryClient,
    repo: str,
    digest: str,
    part: Part,
    partial: PartialFile,
    opts: TransferOptions,
    cancelled: threading.Event,
    on_bytes: Callable[[int], None],
    frames: FrameQueue | None = None,
) -> None:
    """Fetches the rest of `part`, retrying a broken, stalled or corrupt stream with backoff;
    the frames of a framed blob are handed to `frames` as they are decoded and written.

    Tries count only while nothing is kept: a part that keeps making progress keeps going.
    Raises Cancelled, RegistryError (retries spent, or a registry that refuses), OSError.
    """
    failures, progressed = 0, time.monotonic()
    try:
        while not part.done:
            if cancelled.is_set():
                raise Cancelled
            before = part.completed
            try:
                _stream_part(client, repo, digest, part, partial, opts, cancelled, on_bytes, frames)
            except TransientError as e:
                if part.completed > before:
                    failures, progressed = 0, time.monotonic()
                else:
                    failures += 1
                wait = opts.backoff * 2 ** (failures - 1) if failures else 0
                idle = time.monotonic() - progressed
                why = f"gave up after {failures} tries"
                if failures and idle + wait + opts.stall_timeout > opts.give_up:
                    why += f", {idle:.0f} s without a byte"  # the next try would end past it
                elif failures <= opts.retries:
                    why = ""
                if why:
                    raise RegistryError(f"downloading {digest}: {e} ({why})", e.status) from None
                if cancelled.wait(wait):
                    raise Cancelled from None
    finally:
        if part.completed:  # a part that never began needs no state file
            partial.save(part)


def _stream_part(
    client: RegistryClient,
    repo: str,
    digest: str,
    part: Part,
    partial: PartialFile,
    opts: TransferOptions,
    cancelled: threading.Event,
    on_bytes: Callable[[int], None],
    frames: FrameQueue | None,
) -> None:
    sink: _PlainSink | _FrameSink
    if partial.layout.framed:
        assert frames is not None, "a framed blob's frames go to the hash through a queue"
        sink = _FrameSink(part, partial, opts, on_bytes, frames)
    else:
        sink = _PlainSink(part, partial, opts, on_bytes)
    try:
        with client.blob_range(repo, digest, part.start, part.end) as response:
            for chunk in response.iter_raw():
                sink.feed(chunk)
                if part.done or cancelled.is_set():
                    break
    finally:
        # What arrived whole before a break or an error is kept, so a retry skips it.
        sink.flush()
    if cancelled.is_set() and not part.done:
        raise Cancelled
    if not part.done:
        raise TransientError(
            f"registry {client.base_url} closed the stream of {digest} "
            f"at byte {part.start} of {part.end}",
            502,
        )


class _PlainSink:
    """Bytes written as they are, about a MiB per system call."""

    def __init__(
        self,
        part: Part,
        partial: PartialFile,
        opts: TransferOptions,
        on_bytes: Callable[[int], None],
    ):
        self.part, self.partial, self.opts, self.on_bytes = part, partial, opts, on_bytes
        self.buffer: list[bytes] = []
        self.pending = 0
        self.saved = part.completed

    def feed(self, chunk: bytes) -> None:
        room = self.part.size - self.part.completed - self.pending
        self.buffer.append(chunk[:room])
        self.pending += min(len(chunk), room)
        if self.pending >= _WRITE_BUFFER or self.pending == self.part.size - self.part.completed:
            self.flush()

    def flush(self) -> None:
        part = self.part
        if self.pending:
            self.partial.write(part.start, self.buffer)
            part.completed += self.pending
            self.on_bytes(self.pending)
            self.buffer, self.pending = [], 0
        if part.completed - self.saved >= state_every(part, self.opts):
            self.partial.save(part)
            self.saved = part.completed


class _FrameSink:
    """Each frame gathered whole, decoded into a buffer of the queue (the GIL is let go
    meanwhile), written at its offset in the file and handed to the hash; a frame that does
    not decode raises CorruptFrame. The bytes of a frame cut short are dropped: a frame
    decodes only whole."""

    def __init__(
        self,
        part: Part,
        partial: PartialFile,
        opts: TransferOptions,
        on_bytes: Callable[[int], None],
        frames: FrameQueue,
    ):
        self.part, self.partial, self.opts, self.on_bytes = part, partial, opts, on_bytes
        self.queue = frames
        self.layout = layout = partial.layout
        self.k = layout.frame_at(part.start)
        self.frame = _frame_buffer(max(layout.frames[self.k : layout.frame_at(part.end - 1) + 1]))
        self.pending = 0  # bytes of frame k gathered so far
        self.saved = part.completed

    def feed(self, chunk: bytes) -> None:
        data = memoryview(chunk)
        while data and not self.part.done:
            take = data[: self.layout.frames[self.k] - self.pending]
            self.frame[self.pending : self.pending + len(take)] = take
            self.pending += len(take)
            data = data[len(take) :]
            if self.pending == self.layout.frames[self.k]:
                self._decode()

    def _decode(self) -> None:
        k, n = self.k, self.pending
        self.pending = 0
        offset, size = self.layout.frame_span(k)
        out = self.queue.buffer(k)
        if out is None:
            raise Cancelled
        try:
            decode_frame(memoryview(self.frame)[:n], size, memoryview(out))
            self.partial.write_frame(offset, memoryview(out)[:size])
        except CorruptFrame as e:
            self.queue.give_back(out)
            start = self.layout.starts[k]
            raise CorruptFrame(
                f"frame {k} (bytes {start}-{start + n - 1}) does not decode: {e}", 502
            ) from None
        except BaseException:
            self.queue.give_back(out)
            raise
        self.queue.put(k, out)
        self.part.completed += n
        self.on_bytes(n)
        self.k += 1
        if self.part.completed - self.saved >= state_every(self.part, self.opts):
            self.partial.save(self.part)
            self.saved = self.part.completed

    def flush(self) -> None:
        pass  # every whole frame is written as it completes


def _frame_buffer(size: int) -> mmap.mmap:
    """A buffer of at least `size` bytes for the compressed frame, kept per thread."""
    buffer = getattr(_buffers, "frame", None)
    if buffer is None or len(buffer) < size:
        buffer = _buffers.frame = aligned_buffer(size)
    return buffer


_buffers = threading.local()
