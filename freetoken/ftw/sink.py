"""The threads behind ftw.writer.Writer: shard bytes written, hashed and checksummed while the
caller reads and assembles the next tensors.

A create is bound by the disk only if nothing else runs in series with it. Measured on a
16 GB checkpoint (16 cores, a 1.4 GB/s disk), one thread that wrote then hashed each piece,
and a caller that computed each tensor's CRC-32 itself, took 1.7-2x the time to read and
write the bytes, the converter's start-up aside. So each job has a thread of its own: the
writer (the disk), the hashers (SHA-256 of each file) and a small pool for the tensors'
CRC-32s, which are independent of one another. File writes, hashlib and zlib release the
GIL for buffers of this size, so the threads run in parallel.

One file's SHA-256 is a sequential chain, and one core hashes at about the speed of a
fast disk or slower (1.2 GB/s on a development VM with SHA extensions): a single hasher
then sets the pace. So each file goes to the next of a few hashers in turn, whose queue
may fall up to HASH_BACKLOG bytes behind the writer: within a shard the writer runs ahead
of its hasher, which catches up while the next shard's bytes go to another.

The writer also asks the kernel to start writing back what it has written (and to drop it
from the page cache) every WRITEBACK bytes, and the rest of each file as it closes: the
closing fsync then waits for the last stretch only, not for gigabytes held dirty in memory.
A file's tail left dirty (up to 2 × WRITEBACK) waited for that fsync: with 2 GiB shards, a
16 GB model's eight tails were gigabytes written only after the last shard, in series.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import sys
import threading
import zlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

WRITEBACK = 256 << 20
HASHERS = 4  # files hashed at once (the shards of a large model, DEFAULT_SHARD_LIMIT each)
HASH_BACKLOG = 512 << 20  # bytes a hasher may hold behind the writer (its tensors kept alive)
_LINUX = sys.platform.startswith("linux")  # where posix_fadvise starts writeback
_STOP = ("stop", None)


class _Worker:
    """One thread taking (op, arg) jobs in order: at most `depth` wait besides the one it
    runs, and (with `budget`) at most that many bytes of buffers in all, so a caller ahead
    of it holds a bounded amount in memory. A job larger than the budget is taken once
    nothing else is queued."""

    def __init__(self, name: str, handle: Callable[[str, Any], None], depth: int, budget: int = 0):
        self.error: BaseException | None = None
        self._handle = handle
        self._depth, self._budget = depth, budget
        self._jobs: deque[tuple[str, Any]] = deque()
        self._bytes = 0  # of the buffers waiting
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, op: str, arg: Any) -> None:
        n = _size(arg)
        with self._cond:
            while self._jobs and (
                len(self._jobs) > self._depth or (self._budget and self._bytes + n > self._budget)
            ):
                self._cond.wait()
            self._jobs.append((op, arg))
            self._bytes += n
            self._cond.notify_all()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.put(*_STOP)
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                op, arg = self._jobs[0]
            if self.error is None or op == "stop":  # after an error, drain until stopped
                try:
                    self._handle(op, arg)
                except BaseException as e:
                    self.error = e
            with self._cond:  # done with it: only now may its bytes be reused
                self._jobs.popleft()
                self._bytes -= _size(arg)
                self._cond.notify_all()
            if op == "stop":
                return


def _size(arg: Any) -> int:
    return arg.nbytes if isinstance(arg, memoryview) else 0


class _Hasher:
    """SHA-256 of the files given to it, one after another."""

    def __init__(self, name: str):
        self.digests: dict[str, str] = {}
        self._hash: tuple[str, Any] | None = None  # (file name, sha256) being computed
        self.worker = _Worker(name, self._digest, depth=1 << 16, budget=HASH_BACKLOG)

    def _digest(self, op: str, arg: Any) -> None:
        if op in ("open", "stop") and self._hash is not None:
            name, h = self._hash
            self.digests[name] = "sha256:" + h.hexdigest()
            self._hash = None
        if op == "open":
            self._hash = (Path(arg).name, hashlib.sha256())
        elif op == "write":
            assert self._hash is not None
            self._hash[1].update(arg)


class Sink:
    """Opens and writes the shards in order on one thread and hashes them on others, each
    file on one hasher; `digests` names each file once `finish` returns."""

    def __init__(self, depth: int = 2, hashers: int | None = None):
        self._file: BinaryIO | None = None
        self._flushed = 0  # bytes of the open file handed to writeback
        self._writer = _Worker("ftw-writer", self._write, depth)
        n = HASHERS if hashers is None else max(hashers, 1)
        self._hashers = [_Hasher(f"ftw-hasher-{i}") for i in range(n)]
        self._turns = itertools.cycle(self._hashers)  # each file opened goes to the next
        self._hasher = self._hashers[0]

    @property
    def digests(self) -> dict[str, str]:
        return {name: d for h in self._hashers for name, d in h.digests.items()}

    def open(self, path: Path) -> None:
        self._hasher = next(self._turns)
        self._put("open", path)

    def write(self, data: memoryview) -> None:
        self._put("write", data)  # the view keeps its tensor alive until written and hashed

    def stop(self) -> None:
        """Waits for every write and hash, and ends the threads."""
        for w in self._workers:
            w.stop()

    def finish(self) -> None:
        """`stop`, then raises what a thread met."""
        self.stop()
        self._raise()

    @property
    def _workers(self) -> list[_Worker]:
        return [self._writer, *(h.worker for h in self._hashers)]

    def _put(self, op: str, arg: Any) -> None:
        self._raise()
        self._writer.put(op, arg)
        self._hasher.worker.put(op, arg)

    def _raise(self) -> None:
        for w in self._workers:
            if w.error is not None:
                raise w.error

    def _write(self, op: str, arg: Any) -> None:
        if op in ("open", "stop") and self._file is not None:
            self._writeback(self._file, closing=True)
            self._file.close()
            self._file = None
        if op == "open":
            self._file, self._flushed = open(arg, "wb"), 0
        elif op == "write":
            assert self._file is not None
            self._file.write(arg)
            self._writeback(self._file)

    def _writeback(self, f: BinaryIO, closing: bool = False) -> None:
        end = f.tell()
        if (
            not _LINUX
            or end == self._flushed
            or (end - self._flushed < 2 * WRITEBACK and not closing)
        ):
            return
        # while writing, the stretch before the last one: its pages are likely written back
        # already, and the kernel starts on any that are not without waiting for them
        start, self._flushed = self._flushed, end if closing else end - WRITEBACK
        f.flush()
        os.posix_fadvise(f.fileno(), start, self._flushed - start, os.POSIX_FADV_DONTNEED)


class Checksums:
    """Each tensor's CRC-32, computed on a pool while the caller goes on; `resolve` writes
    them into their index entries. At most `depth` wait, each holding its tensor's bytes."""

    def __init__(self, workers: int = 4, depth: int = 4):
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ftw-crc")
        self._pending: deque[tuple[dict[str, Any], Future[int]]] = deque()
        self._depth = depth

    def add(self, entry: dict[str, Any], data: memoryview) -> None:
        self._pending.append((entry, self._pool.submit(zlib.crc32, data)))
        while len(self._pending) > self._depth:
            self._settle()

    def resolve(self) -> None:
        """Every entry's crc32 set; the pool ended."""
        while self._pending:
            self._settle()
        self._pool.shutdown()

    def abort(self) -> None:
        self._pending.clear()
        self._pool.shutdown(cancel_futures=True)

    def _settle(self) -> None:
        entry, crc = self._pending.popleft()
        entry["crc32"] = crc.result()
