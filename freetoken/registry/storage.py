"""The registry's files under one root directory.

    <root>/blobs/sha256-<hex>                   content-addressed, as in the local store
    <root>/manifests/<namespace>/<model>/<tag>  the manifest bytes exactly as pushed
    <root>/uploads/<id>                         an upload in progress

Nothing is published half-written: an upload is renamed into blobs/ only once its sha256
matches the digest the client named, and a manifest goes to a temporary file beside its tag
first. Every name part is checked against the store's grammar before it becomes a path, so
no request can reach outside the root. Blobs are shared by all repositories.

Methods that fsync or touch many bytes are blocking; the app calls them from a thread. The
table of uploads is only touched from the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

from freetoken.store.blobs import BlobStore, DigestMismatch, fsync_dir
from freetoken.store.names import DEFAULT_TAG, InvalidName, Name, parse_digest

__all__ = ["Storage", "Upload", "check_repo", "check_tag", "manifest_digest"]

_UPLOAD_ID = re.compile(r"[0-9a-f]{32}")
# A leading dot is never a legal tag, so a temporary manifest is never listed or served.
_TEMP_PREFIX = ".partial-"


def check_repo(namespace: str, model: str) -> None:
    """Raises InvalidName unless both parts follow the store's name grammar."""
    Name(namespace=namespace, model=model, tag=DEFAULT_TAG).validate(f"{namespace}/{model}")


def check_tag(tag: str) -> None:
    Name(model="m", tag=tag).validate(tag)


def manifest_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _child(parent: Path, part: str) -> Path:
    """`parent/part`, or an existing entry spelled with other case: names match
    case-insensitively, as they do in the local store."""
    exact = parent / part
    if exact.exists() or not parent.is_dir():
        return exact
    folded = part.lower()
    return next((p for p in parent.iterdir() if p.name.lower() == folded), exact)


class Upload:
    """A blob arriving over one or more requests; its sha256 runs as the bytes arrive, so
    finishing a large upload does not read it back."""

    def __init__(self, upload_id: str, path: Path, repo: str):
        self.id = upload_id
        self.path = path
        self.repo = repo
        self.size = 0
        self.closed = False
        # Requests on one upload take turns; each needs the offset the previous one left.
        self.lock = asyncio.Lock()
        # Appends run in worker threads; file, size and hash change together or not at all.
        self._io = threading.Lock()
        self._hash = hashlib.sha256()

    def append(self, data: bytes | bytearray) -> None:
        with self._io, open(self.path, "ab") as f:
            f.write(data)
            self._hash.update(data)
            self.size += len(data)

    def mark(self) -> tuple[int, Any]:
        with self._io:
            return self.size, self._hash.copy()

    def rollback(self, mark: tuple[int, Any]) -> None:
        """Back to `mark`: a chunk that did not arrive whole leaves no trace."""
        with self._io:
            size, hash_state = mark
            os.truncate(self.path, size)
            self.size = size
            self._hash = hash_state

    @property
    def digest(self) -> str:
        return "sha256:" + self._hash.hexdigest()


class Storage:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.blobs = BlobStore(self.root / "blobs")
        self.manifests = self.root / "manifests"
        self.uploads = self.root / "uploads"
        self._open: dict[str, Upload] = {}

    def prepare(self) -> None:
        """Creates the layout and drops what a previous process left half-done."""
        for path in (self.blobs.root, self.manifests, self.uploads):
            path.mkdir(parents=True, exist_ok=True)
        for path in self.uploads.iterdir():
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        for path in self.manifests.glob(f"*/*/{_TEMP_PREFIX}*"):
            path.unlink(missing_ok=True)

    # -- blobs ---------------------------------------------------------------------------

    def blob(self, digest: str) -> Path | None:
        """The blob's file, or None when it is not here; raises InvalidName for a bad digest."""
        path = self.blobs.path(digest)
        return path if path.is_file() else None

    # -- uploads -------------------------------------------------------------------------

    def start_upload(self, repo: str) -> Upload:
        upload_id = uuid.uuid4().hex
        path = self.uploads / upload_id
        path.touch(exist_ok=False)
        upload = Upload(upload_id, path, repo)
        self._open[upload_id] = upload
        return upload

    def upload(self, upload_id: str, repo: str) -> Upload | None:
        """An open upload started under `repo` (the id is opaque, but not across repos)."""
        if not _UPLOAD_ID.fullmatch(upload_id):
            return None
        upload = self._open.get(upload_id)
        return upload if upload and upload.repo == repo else None

    def close(self, upload: Upload) -> None:
        """Takes the upload out of the table; later requests for it find nothing."""
        upload.closed = True
        self._open.pop(upload.id, None)

    def discard(self, upload: Upload) -> None:
        self.close(upload)
        upload.path.unlink(missing_ok=True)

    def publish(self, upload: Upload, digest: str) -> bool:
        """Moves a closed upload into blobs/ if it hashes to `digest`, else deletes it and
        raises DigestMismatch. Returns False when the blob was already there."""
        assert upload.closed
        try:
            expected = parse_digest(digest)
            if upload.digest != expected:
                raise DigestMismatch(expected, upload.digest)
            with open(upload.path, "rb+") as f:
                os.fsync(f.fileno())
            target = self.blobs.path(expected)
            # Two uploads of one blob may finish together; the bytes are the same, so the
            # later one keeps the published file and drops its own.
            if target.exists():
                upload.path.unlink()
                return False
            os.replace(upload.path, target)
            fsync_dir(self.blobs.root)
            return True
        except BaseException:
            upload.path.unlink(missing_ok=True)
            raise

    # -- manifests -----------------------------------------------------------------------

    def _repo_dir(self, namespace: str, model: str) -> Path:
        check_repo(namespace, model)
        return _child(_child(self.manifests, namespace), model)

    def _tags(self, repo_dir: Path) -> dict[str, Path]:
        if not repo_dir.is_dir():
            return {}
        out = {}
        for path in sorted(repo_dir.iterdir()):
            try:
                check_tag(path.name)
            except InvalidName:
                continue
            if path.is_file():
                out[path.name] = path
        return out

    def manifest(self, namespace: str, model: str, reference: str) -> bytes | None:
        """The manifest bytes by tag or by digest, or None."""
        repo_dir = self._repo_dir(namespace, model)
        # A tag never holds a colon, so `sha256:<hex>` is always a digest.
        if ":" in reference:
            wanted = parse_digest(reference)
            for path in self._tags(repo_dir).values():
                data = path.read_bytes()
                if manifest_digest(data) == wanted:
                    return data
            return None
        check_tag(reference)
        path = _child(repo_dir, reference)
        return path.read_bytes() if path.is_file() else None

    def put_manifest(self, namespace: str, model: str, tag: str, data: bytes) -> str:
        """Publishes the manifest bytes under the tag (atomically); returns their digest."""
        check_tag(tag)
        # A repository keeps the spelling it was first pushed with; a tag takes the new one.
        repo_dir = self._repo_dir(namespace, model)
        old = _child(repo_dir, tag)
        target = repo_dir / tag
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=_TEMP_PREFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        fsync_dir(target.parent)
        # The name matched a tag spelled with other case: the new spelling replaces it.
        if old != target and old.is_file():
            self._remove_manifest(old)
        return manifest_digest(data)

    def _remove_manifest(self, path: Path) -> None:
        path.unlink(missing_ok=True)
        parent = path.parent
        while parent != self.manifests and parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()
            parent = parent.parent

    def tags(self, namespace: str, model: str) -> tuple[str, list[str]] | None:
        """(`namespace/model` as stored, its tags), or None for an unknown repository."""
        repo_dir = self._repo_dir(namespace, model)
        tags = list(self._tags(repo_dir))
        if not tags:
            return None
        return f"{repo_dir.parent.name}/{repo_dir.name}", tags

    def catalog(self) -> list[str]:
        out = []
        for repo_dir in sorted(self.manifests.glob("*/*")):
            try:
                check_repo(repo_dir.parent.name, repo_dir.name)
            except InvalidName:
                continue
            if self._tags(repo_dir):
                out.append(f"{repo_dir.parent.name}/{repo_dir.name}")
        return out
