"""Resumable ranged downloads of one blob: the partial file, its parts and their state.

A blob is fetched as parts (byte ranges) written at their offsets into
`<blobs>/sha256-<hex>-partial`. Each part's progress is kept in a small JSON file,
`<partial>-<N>` = `{"N", "Offset", "Size", "Completed"}` (Ollama's shape), rewritten
atomically every few MiB and whenever a part stops. A later pull that finds the partial
and consistent state files continues each part where it stopped; anything inconsistent is
thrown away and fetched again. The state never claims bytes that were not written to the
file first, and the blob's sha256 is checked before it is published, so a crash can cost
bytes but never correctness.
"""

from __future__ import annotations

import errno
import json
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from freetoken.pull.client import RegistryClient, RegistryError, TransientError

__all__ = ["Cancelled", "Part", "PartialFile", "TransferOptions", "fetch_part", "plan_parts"]

_WRITE_BUFFER = 1 << 20


class Cancelled(Exception):
    """Every pull waiting for this download went away."""


@dataclass(frozen=True, slots=True)
class TransferOptions:
    """How pulls and pushes use the network; `from_config` reads the settings."""

    streams: int = 8  # ranged GETs in flight (pull), layers sent at once (push)
    part_size: int = 64 << 20  # the largest part of a blob
    min_part_size: int = 1 << 20  # a blob is cut into parts no smaller than this
    stall_timeout: float = 30.0  # seconds without a byte before a part is tried again
    retries: int = 6  # tries of one part after the first, without progress in between
    backoff: float = 1.0  # seconds before the first retry; doubles with each
    state_every: int = 8 << 20  # bytes between writes of a part's state file
    upload_chunk: int = 64 << 20  # bytes per PATCH of an upload

    @classmethod
    def from_config(cls, cfg: Any) -> TransferOptions:
        return cls(streams=cfg.max_transfer_streams)


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


def plan_parts(total: int, opts: TransferOptions) -> list[Part]:
    """Parts of about total/streams bytes, so one blob alone keeps every stream busy."""
    if total <= 0:
        return []
    size = max(opts.min_part_size, min(opts.part_size, math.ceil(total / opts.streams)))
    return [Part(n, off, min(size, total - off)) for n, off in enumerate(range(0, total, size))]


class PartialFile:
    """`<blobs>/sha256-<hex>-partial` and its `-<N>` state files."""

    def __init__(self, blobs_root: Path, digest: str, total: int):
        self.path = Path(blobs_root) / (digest.replace(":", "-") + "-partial")
        self.total = total
        self._fd: int | None = None
        self._state_lock = threading.Lock()

    def state_path(self, n: int) -> Path:
        return self.path.with_name(f"{self.path.name}-{n}")

    def _state_files(self) -> list[Path]:
        prefix = self.path.name + "-"
        return [p for p in self.path.parent.glob(prefix + "*") if p.name[len(prefix):].isdigit()]

    def _load(self) -> list[Part] | None:
        """The saved parts, if they exactly tile the partial file; else None."""
        if not self.path.is_file() or self.path.stat().st_size != self.total:
            return None
        parts = []
        for p in self._state_files():
            try:
                s = json.loads(p.read_text())
                part = Part(int(s["N"]), int(s["Offset"]), int(s["Size"]), int(s["Completed"]))
            except (OSError, ValueError, KeyError, TypeError):
                return None
            if p.name != self.state_path(part.n).name or not 0 <= part.completed <= part.size:
                return None
            parts.append(part)
        parts.sort(key=lambda x: x.offset)
        pos = 0
        for i, part in enumerate(parts):
            if part.n != i or part.offset != pos or part.size <= 0:
                return None
            pos += part.size
        return parts if pos == self.total else None

    def open(self, opts: TransferOptions) -> list[Part]:
        """Opens (resuming when it can) and returns the parts; raises OSError (e.g. ENOSPC)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        parts = self._load() if self.total else []
        if parts is None:
            self.discard()
            parts = plan_parts(self.total, opts)
        fresh = not self.path.exists()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if fresh:
            try:
                _allocate(self._fd, self.total)
            except OSError:
                self.close()
                self.discard()
                raise
            for part in parts:
                self.save(part)
        return parts

    def write(self, offset: int, chunks: list[bytes]) -> None:
        """Writes the chunks back to back at `offset`, in one system call when it can."""
        assert self._fd is not None
        views = [memoryview(c) for c in chunks if c]
        while views:
            n = os.pwritev(self._fd, views, offset)
            offset += n
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if views and n:
                views[0] = views[0][n:]

    def save(self, part: Part) -> None:
        """Writes the part's state atomically (a kill mid-write leaves the old state)."""
        path = self.state_path(part.n)
        tmp = path.with_name(path.name + ".tmp")
        with self._state_lock:
            tmp.write_text(json.dumps(part.to_json()))
            os.replace(tmp, path)

    def flush(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def remove_states(self) -> None:
        for p in self._state_files():
            p.unlink(missing_ok=True)

    def discard(self) -> None:
        self.close()
        self.remove_states()
        self.path.unlink(missing_ok=True)


def _allocate(fd: int, size: int) -> None:
    """Reserves the blob's space up front, so a full disk fails before the first byte."""
    if size == 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
        os.ftruncate(fd, size)  # a filesystem without fallocate: sparse, filled as parts land


def fetch_part(
    client: RegistryClient,
    repo: str,
    digest: str,
    part: Part,
    partial: PartialFile,
    opts: TransferOptions,
    cancelled: threading.Event,
    on_bytes: Callable[[int], None],
) -> None:
    """Fetches the rest of `part`, retrying a broken or stalled stream with backoff.

    Tries count only while no byte arrives: a part that keeps making progress keeps going.
    Raises Cancelled, RegistryError (retries spent, or a registry that refuses), OSError.
    """
    failures = 0
    while not part.done:
        if cancelled.is_set():
            raise Cancelled
        before = part.completed
        try:
            _stream_part(client, repo, digest, part, partial, opts, cancelled, on_bytes)
        except TransientError as e:
            partial.save(part)
            failures = 0 if part.completed > before else failures + 1
            if failures > opts.retries:
                raise RegistryError(f"downloading {digest}: {e} (gave up after {failures} tries)",
                                    e.status) from None
            if cancelled.wait(opts.backoff * 2 ** (failures - 1) if failures else 0):
                raise Cancelled from None
    partial.save(part)


def _stream_part(client: RegistryClient, repo: str, digest: str, part: Part, partial: PartialFile,
                 opts: TransferOptions, cancelled: threading.Event,
                 on_bytes: Callable[[int], None]) -> None:
    buffer: list[bytes] = []
    buffered = 0
    saved = part.completed

    def flush() -> None:
        nonlocal buffer, buffered, saved
        if buffered:
            partial.write(part.start, buffer)
            part.completed += buffered
            on_bytes(buffered)
            buffer, buffered = [], 0
        if part.completed - saved >= opts.state_every:
            partial.save(part)
            saved = part.completed

    try:
        with client.blob_range(repo, digest, part.start, part.end) as response:
            for chunk in response.iter_raw():
                room = part.size - part.completed - buffered
                buffer.append(chunk[:room])
                buffered += min(len(chunk), room)
                if buffered >= _WRITE_BUFFER or buffered == part.size - part.completed:
                    flush()
                    if part.done:
                        break
                if cancelled.is_set():
                    break
    finally:
        # Bytes that arrived before a break or an error are kept, so a retry skips them.
        flush()
    if cancelled.is_set() and not part.done:
        raise Cancelled
    if not part.done:
        raise TransientError(f"registry {client.base_url} closed the stream of {digest} "
                             f"at byte {part.start} of {part.end}", 502)
