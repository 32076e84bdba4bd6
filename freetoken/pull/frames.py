"""zstd in independent frames: how push compresses a file, and how pull places each frame.

Push cuts a file into frames of `frame_size` bytes and compresses each one on its own
(level 3, one thread, a checksum and the content size in every frame header), so the
same file always gives the same bytes and the same digest. The frames are concatenated:
any zstd reader decodes the whole blob, and one that knows the frame table (the layer's
annotations) decodes any frame alone, from the bytes of its own ranged part.

`Layout` maps a blob's bytes on the wire to its partial file: one to one for a blob that
travels as it is (or as one frame, decoded later), frame by frame for a framed blob.
`FrameQueue` hands decoded frames from the streams that decode them to the thread that
hashes them, in order.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import mmap
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import zstandard

from freetoken.pull.client import TransientError
from freetoken.pull.wire import WireLayer

__all__ = [
    "BLOCK",
    "ZSTD_LEVEL",
    "CorruptFrame",
    "FrameQueue",
    "Layout",
    "aligned_buffer",
    "compress_frames",
    "decode_frame",
]

ZSTD_LEVEL = 3
BLOCK = 4096  # offsets, sizes and buffers of direct I/O are multiples of this

_local = threading.local()  # one decompression context per thread: contexts are not shared


class CorruptFrame(TransientError):
    """A frame that does not decode to its bytes: worth fetching again."""


class Layout:
    """Where the wire bytes of a blob go in its partial file."""

    def __init__(
        self,
        wire_size: int,
        file_size: int | None = None,
        frame_size: int = 0,
        frames: tuple[int, ...] = (),
    ):
        self.wire_size = wire_size
        self.framed = bool(frames)
        self.file_size = file_size if self.framed and file_size is not None else wire_size
        self.frame_size = frame_size
        self.frames = frames
        self.starts = list(itertools.accumulate(frames, initial=0))  # wire offsets, then the end

    @classmethod
    def of(cls, layer: WireLayer) -> Layout:
        if layer.framed:
            return cls(layer.size, layer.uncompressed_size, layer.frame_size or 0, layer.frames)
        return cls(layer.size)

    def frame_at(self, wire_pos: int) -> int:
        """The frame that holds the wire byte at `wire_pos`."""
        return bisect.bisect_right(self.starts, wire_pos) - 1

    def frame_span(self, k: int) -> tuple[int, int]:
        """(offset, size) of frame `k` in the file."""
        offset = k * self.frame_size
        return offset, min(self.frame_size, self.file_size - offset)

    def file_pos(self, wire_pos: int) -> int:
        """How much of the file the first `wire_pos` wire bytes fill (whole frames only)."""
        if not self.framed:
            return wire_pos
        return min(self.frame_at(wire_pos) * self.frame_size, self.file_size)

    def wire_pos(self, file_pos: int) -> int | None:
        """The wire bytes behind the first `file_pos` bytes of the file; None when that is
        not the end of a frame."""
        if not self.framed:
            return file_pos
        if file_pos == self.file_size:
            return self.wire_size
        k, rest = divmod(file_pos, self.frame_size)
        return self.starts[k] if rest == 0 and 0 <= k < len(self.frames) else None

    def align(self, wire_pos: int) -> int:
        """The start of the frame that holds `wire_pos` (any offset when not framed)."""
        return self.starts[self.frame_at(wire_pos)] if self.framed else wire_pos

    def cut(self, target: int) -> list[tuple[int, int]]:
        """(offset, size) of consecutive runs of whole frames, each about `target` wire
        bytes (one frame at least)."""
        out, k, n = [], 0, len(self.frames)
        while k < n:
            j = k + 1
            while j < n and self.starts[j + 1] - self.starts[k] <= target:
                j += 1
            out.append((self.starts[k], self.starts[j] - self.starts[k]))
            k = j
        return out


def decode_frame(frame: memoryview, size: int, out: memoryview) -> None:
    """Decodes one whole frame, which must hold `size` bytes, into `out[:size]`; raises
    CorruptFrame."""
    declared = zstandard.frame_content_size(frame)
    if declared not in (size, -1):
        raise CorruptFrame(f"its header says {declared} bytes, not {size}")
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    got = 0
    try:
        # Straight into the caller's buffer. The last read goes past the data, so the
        # frame's checksum, at its end, is checked too.
        with dctx.stream_reader(frame, read_across_frames=False) as reader:
            while got < size and (n := reader.readinto(out[got:size])):
                got += n
            more = reader.read(1)
    except zstandard.ZstdError as e:
        raise CorruptFrame(str(e)) from None
    if got != size or more:
        raise CorruptFrame(
            f"it decompresses to {'more than ' if more else ''}{got} bytes, not {size}"
        )


class FrameQueue:
    """Decoded frames on their way from the streams to the hash, which takes them in order.

    A stream asks for a buffer before it decodes frame k and waits while k is `window`
    frames or more ahead of the hash, so memory stays bounded when one part stalls and the
    others run ahead; with `window` at least the frames in flight, nobody waits. Buffers
    are page-aligned (direct I/O writes from them) and reused: fresh memory for each frame
    would cost a page fault per 4 KiB.
    """

    def __init__(self, frame_size: int, window: int, streams: int):
        self.size = frame_size
        self.next = 0  # the frame the hash takes next
        self.window = window
        self.limit = window + streams  # enough that the frame the hash waits for gets one
        self.ready: dict[int, mmap.mmap] = {}
        self.free: list[mmap.mmap] = []
        self.made = 0
        self.stopped = False
        self.changed = threading.Condition()

    def buffer(self, k: int) -> mmap.mmap | None:
        """A buffer for frame k; None once the download stops."""
        with self.changed:
            self.changed.wait_for(
                lambda: (
                    self.stopped
                    or (k < self.next + self.window and (self.free or self.made < self.limit))
                )
            )
            if self.stopped:
                return None
            if self.free:
                return self.free.pop()
            self.made += 1
        return aligned_buffer(self.size)

    def put(self, k: int, buffer: mmap.mmap) -> None:
        with self.changed:
            self.ready[k] = buffer
            self.changed.notify_all()

    def reach(self, k: int) -> None:
        """The hash is at frame k (the window moves on)."""
        with self.changed:
            self.next = k
            self.changed.notify_all()

    def take(self, k: int) -> mmap.mmap | None:
        """Frame k's buffer once it is decoded (the hash's side); None once the download
        stops."""
        self.reach(k)
        with self.changed:
            self.changed.wait_for(lambda: self.stopped or k in self.ready)
            return None if self.stopped else self.ready.pop(k)

    def give_back(self, buffer: mmap.mmap) -> None:
        with self.changed:
            self.free.append(buffer)
            self.changed.notify_all()

    def stop(self) -> None:
        with self.changed:
            self.stopped = True
            self.changed.notify_all()


def aligned_buffer(size: int) -> mmap.mmap:
    """A page-aligned buffer (as direct I/O needs) of at least `size` bytes. Private and in
    huge pages where the system has them: first touching shared or 4 KiB pages one by one
    cost more than decoding into them."""
    buffer = mmap.mmap(-1, max(-(-size // BLOCK) * BLOCK, BLOCK), flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return buffer


def compress_frames(
    src: Path, dst: BinaryIO, frame_size: int, on_bytes: Callable[[int], None] | None = None
) -> tuple[str, int, tuple[int, ...]]:
    """Writes `src` to `dst` as independent frames; returns (digest, size, frame sizes).
    `on_bytes` hears of each frame's file bytes (and may raise to stop)."""
    cctx = zstandard.ZstdCompressor(
        level=ZSTD_LEVEL, threads=0, write_checksum=True, write_content_size=True
    )
    digest = hashlib.sha256()
    frames = []
    with open(src, "rb") as f:
        while chunk := f.read(frame_size):
            frame = cctx.compress(chunk)
            digest.update(frame)
            dst.write(frame)
            frames.append(len(frame))
            if on_bytes is not None:
                on_bytes(len(chunk))
    return "sha256:" + digest.hexdigest(), sum(frames), tuple(frames)
