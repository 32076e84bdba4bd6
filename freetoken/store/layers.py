"""Bytes becoming layers of a model being created, with Ollama-style progress objects: a file
of this machine linked in (or copied), and the small layers (template, parameters, ...)."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

from freetoken.store import manifest as mf
from freetoken.store.blobs import BlobStore, hash_file

__all__ = ["copy_file", "link_file", "small_layer"]

_PROGRESS_EVERY = 64 << 20


def link_file(blobs: BlobStore, path: Path, name: str) -> Iterator[dict[str, Any]]:
    """A file of this machine as a blob: linked in and hashed in place, copied only where
    no link can be made."""
    staged = blobs.stage_link(path)
    if staged is None:
        return (yield from copy_file(blobs, path, name))
    tmp, _ = staged
    try:
        total = tmp.stat().st_size
        status = f"linking file {name}"
        yield {"status": status, "total": total, "completed": 0}
        digest = yield from _throttled(hash_file(tmp), status, total)
        created = blobs.publish(tmp, digest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    yield {"status": status, "digest": digest, "total": total, "completed": total}
    yield {"status": f"{'creating new' if created else 'using existing'} layer {digest}"}
    return mf.Layer(mf.FILE, digest, total, name)


def _throttled(
    steps: Generator[int, None, str], status: str, total: int
) -> Generator[dict[str, Any], None, str]:
    """Progress objects for a generator of bytes done, one every _PROGRESS_EVERY; returns
    what it returns."""
    reported = 0
    while True:
        try:
            done = next(steps)
        except StopIteration as end:
            return end.value
        if done - reported >= _PROGRESS_EVERY:
            reported = done
            yield {"status": status, "total": total, "completed": done}


def copy_file(blobs: BlobStore, path: Path, name: str) -> Iterator[dict[str, Any]]:
    total = path.stat().st_size
    status = f"copying file {name}"
    yield {"status": status, "total": total, "completed": 0}
    done = reported = 0
    with blobs.writer() as w, open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            w.write(chunk)
            done += len(chunk)
            if done - reported >= _PROGRESS_EVERY:
                reported = done
                yield {"status": status, "total": total, "completed": done}
        digest, created = w.commit()
    yield {"status": status, "digest": digest, "total": total, "completed": total}
    yield {"status": f"{'creating new' if created else 'using existing'} layer {digest}"}
    return mf.Layer(mf.FILE, digest, total, name)


def small_layer(blobs: BlobStore, media_type: str, text: str) -> Iterator[dict[str, Any]]:
    data = text.encode()
    digest, created = blobs.put_stream([data])
    yield {"status": f"{'creating new' if created else 'using existing'} layer {digest}"}
    return mf.Layer(media_type, digest, len(data))
