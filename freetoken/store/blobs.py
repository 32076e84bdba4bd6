"""Content-addressed blobs: `<store>/blobs/sha256-<hex>`.

Bytes go to a temporary file in the blobs directory and are hashed as they are written; the
file is fsynced and renamed to its digest's name only once the digest checks out. A reader
therefore sees a blob either whole or not at all. Beside the blobs live the partial files
of interrupted pulls (`<blob>-partial`, with the saved state that lets a later pull resume
them: `-partial-<N>` per part, `-partial-verified` for the hash); anything else is a
leftover that `prune` may remove.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from freetoken.store.names import parse_digest

__all__ = ["BlobStore", "BlobWriter", "DigestMismatch", "digest_of_file"]

_BLOB_NAME = re.compile(r"sha256-[0-9a-f]{64}")
# A pull's partial file and its saved states (freetoken.pull.parts writes them).
_PARTIAL = re.compile(r"(sha256-[0-9a-f]{64}-partial)(?:-(?:\d+|verified))?")
_TEMP_PREFIX = "partial-"
_CHUNK = 1 << 20


class DigestMismatch(ValueError):
    """The bytes written do not hash to the digest they were sent under."""

    def __init__(self, expected: str, got: str):
        super().__init__(f'digest mismatch, expected "{expected}", got "{got}"')
        self.expected = expected
        self.got = got


def fsync_dir(path: Path) -> None:
    # The rename is only durable once the directory entry is on disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def digest_of_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


class BlobWriter:
    """One blob being written; `commit` verifies and publishes it, `abort` discards it."""

    def __init__(self, store: BlobStore, expected: str | None):
        self._store = store
        self._expected = parse_digest(expected) if expected else None
        self._hash = hashlib.sha256()
        fd, tmp = tempfile.mkstemp(dir=store.root, prefix=_TEMP_PREFIX)
        self._file = os.fdopen(fd, "wb")
        self._tmp = Path(tmp)
        self.size = 0

    def write(self, data: bytes) -> None:
        self._hash.update(data)
        self._file.write(data)
        self.size += len(data)

    def commit(self) -> tuple[str, bool]:
        """Publishes the blob; returns (digest, created) where created is False if it existed."""
        digest = "sha256:" + self._hash.hexdigest()
        try:
            if self._expected and digest != self._expected:
                raise DigestMismatch(self._expected, digest)
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            target = self._store.path(digest)
            if target.exists():
                self._tmp.unlink()
                return digest, False
            os.replace(self._tmp, target)
            fsync_dir(self._store.root)
            return digest, True
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> BlobWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        # Without a commit the temporary file must not outlive the writer.
        if self._tmp.exists():
            self.abort()


class BlobStore:
    def __init__(self, root: Path):
        self.root = Path(root)

    def ensure(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, digest: str) -> Path:
        """Where a digest's blob lives (whether or not it exists); raises InvalidName."""
        return self.root / parse_digest(digest).replace(":", "-")

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def size(self, digest: str) -> int:
        return self.path(digest).stat().st_size

    def read_bytes(self, digest: str) -> bytes:
        return self.path(digest).read_bytes()

    def writer(self, expected: str | None = None) -> BlobWriter:
        self.ensure()
        return BlobWriter(self, expected)

    def put_stream(self, chunks: Iterable[bytes], expected: str | None = None) -> tuple[str, bool]:
        with self.writer(expected) as w:
            for chunk in chunks:
                w.write(chunk)
            return w.commit()

    def put_bytes(self, data: bytes) -> str:
        return self.put_stream([data])[0]

    def put_file(
        self, path: Path, progress: Callable[[int], None] | None = None
    ) -> tuple[str, bool]:
        """Copies a file into the store in one pass (hash while copying)."""

        def chunks() -> Iterable[bytes]:
            with open(path, "rb") as f:
                while chunk := f.read(_CHUNK):
                    yield chunk
                    if progress:
                        progress(len(chunk))

        return self.put_stream(chunks())

    def adopt(self, path: Path) -> tuple[str, int, bool]:
        """Moves a finished file on the same filesystem into the store under its digest.

        Returns (digest, size, created). Large converted weights are renamed, not copied.
        """
        digest = digest_of_file(path)
        size = path.stat().st_size
        target = self.path(digest)
        if target.exists():
            path.unlink()
            return digest, size, False
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        os.replace(path, target)
        fsync_dir(self.root)
        return digest, size, True

    def digests(self) -> set[str]:
        if not self.root.is_dir():
            return set()
        return {"sha256:" + p.name[7:] for p in self.root.iterdir() if _BLOB_NAME.fullmatch(p.name)}

    def remove(self, digest: str) -> None:
        self.path(digest).unlink(missing_ok=True)

    def prune(self, keep: set[str]) -> list[str]:
        """Removes every file that is not a blob in `keep` nor part of a pull that can be
        resumed (a partial file with saved state); returns the names removed."""
        if not self.root.is_dir():
            return []
        files = {p.name for p in self.root.iterdir() if p.is_file()}
        keep_names = {parse_digest(d).replace(":", "-") for d in keep} | _resumable(files)
        removed = []
        for name in sorted(files - keep_names):
            (self.root / name).unlink(missing_ok=True)
            removed.append(name)
        return removed


def _resumable(names: set[str]) -> set[str]:
    """The partial files that a pull can resume, with their states: a partial file whose
    progress was saved (a part's state or the hash state). A partial without any state
    holds nothing known to be good, and states without their file resume nothing."""
    groups: dict[str, list[str]] = {}
    for name in names:
        if m := _PARTIAL.fullmatch(name):
            groups.setdefault(m.group(1), []).append(name)
    return {n for base, group in groups.items() if base in names and len(group) > 1 for n in group}
