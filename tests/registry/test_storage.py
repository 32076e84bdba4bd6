"""Storage on its own: publishing uploads, manifests by tag, listings, start-up clean-up."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from freetoken.registry.storage import Storage
from freetoken.store.blobs import DigestMismatch
from freetoken.store.names import InvalidName
from tests.registry.conftest import digest_of


@pytest.fixture
def storage(tmp_path: Path) -> Storage:
    s = Storage(tmp_path / "root")
    s.prepare()
    return s


def upload(storage: Storage, data: bytes, repo: str = "library/demo"):
    up = storage.start_upload(repo)
    up.append(data)
    storage.close(up)
    return up


def test_publish_checks_the_digest(storage):
    up = upload(storage, b"hello")
    assert storage.publish(up, digest_of(b"hello")) is True
    assert storage.blob(digest_of(b"hello")).read_bytes() == b"hello"
    bad = upload(storage, b"hello")
    with pytest.raises(DigestMismatch):
        storage.publish(bad, digest_of(b"other"))
    assert storage.blob(digest_of(b"other")) is None
    assert list(storage.uploads.iterdir()) == []


def test_same_blob_published_from_many_threads(storage):
    data = b"z" * 100_000
    uploads = [upload(storage, data) for _ in range(8)]
    with ThreadPoolExecutor(8) as pool:
        created = list(pool.map(lambda u: storage.publish(u, digest_of(data)), uploads))
    assert created.count(True) >= 1
    assert storage.blob(digest_of(data)).read_bytes() == data
    assert list(storage.uploads.iterdir()) == []


def test_rollback_restores_size_and_hash(storage):
    up = storage.start_upload("library/demo")
    up.append(b"abc")
    mark = up.mark()
    up.append(b"garbage")
    up.rollback(mark)
    up.append(b"def")
    assert up.size == 6 and up.path.read_bytes() == b"abcdef"
    assert up.digest == digest_of(b"abcdef")


def test_uploads_are_bound_to_their_repository(storage):
    up = storage.start_upload("library/demo")
    assert storage.upload(up.id, "library/demo") is up
    assert storage.upload(up.id, "other/demo") is None
    assert storage.upload("../" + up.id, "library/demo") is None
    storage.discard(up)
    assert storage.upload(up.id, "library/demo") is None and not up.path.exists()


def test_manifest_by_tag_and_digest(storage):
    digest = storage.put_manifest("library", "demo", "latest", b'{"a": 1}')
    assert digest == digest_of(b'{"a": 1}')
    assert storage.manifest("library", "demo", "latest") == b'{"a": 1}'
    assert storage.manifest("LIBRARY", "Demo", "LATEST") == b'{"a": 1}'
    assert storage.manifest("library", "demo", digest) == b'{"a": 1}'
    assert storage.manifest("library", "demo", digest_of(b"x")) is None
    assert storage.manifest("library", "other", "latest") is None
    # Only the final file is left: the temporary one was renamed.
    assert [p.name for p in (storage.manifests / "library" / "demo").iterdir()] == ["latest"]


def test_listings_skip_what_is_not_a_manifest(storage):
    storage.put_manifest("library", "demo", "latest", b"{}")
    storage.put_manifest("library", "demo", "7b", b"{}")
    (storage.manifests / "library" / "demo" / ".partial-123").write_bytes(b"{")
    (storage.manifests / "library" / "empty").mkdir()
    (storage.manifests / "bad name" / "x").mkdir(parents=True)
    (storage.manifests / "bad name" / "x" / "latest").write_bytes(b"{}")
    assert storage.catalog() == ["library/demo"]
    assert storage.tags("library", "demo") == ("library/demo", ["7b", "latest"])
    assert storage.tags("library", "empty") is None


@pytest.mark.parametrize(
    "namespace, model, ref",
    [
        ("..", "demo", "latest"),
        ("library", "..", "latest"),
        ("library", "demo", ".."),
        ("a/b", "demo", "latest"),
        ("library", "demo", "x/../../y"),
        ("library", "demo", "sha256:.."),
    ],
)
def test_hostile_parts_raise_before_touching_files(storage, namespace, model, ref):
    with pytest.raises(InvalidName):
        storage.manifest(namespace, model, ref)
    with pytest.raises(InvalidName):
        storage.put_manifest(namespace, model, ref, b"{}")
    assert list(storage.manifests.iterdir()) == []


def test_hostile_digests_raise(storage):
    for digest in ("sha256:../x", "sha256-" + "0" * 63, "../../etc/passwd"):
        with pytest.raises(InvalidName):
            storage.blob(digest)


def test_prepare_drops_leftovers(tmp_path):
    root = tmp_path / "root"
    (root / "uploads" / "d").mkdir(parents=True)
    (root / "uploads" / "f").write_bytes(b"half")
    (root / "manifests" / "ns" / "m").mkdir(parents=True)
    (root / "manifests" / "ns" / "m" / ".partial-1").write_bytes(b"{")
    (root / "manifests" / "ns" / "m" / "latest").write_bytes(b"{}")
    Storage(root).prepare()
    assert list((root / "uploads").iterdir()) == []
    assert [p.name for p in (root / "manifests" / "ns" / "m").iterdir()] == ["latest"]
    assert (root / "blobs").is_dir()


def test_upload_lock_is_usable_from_any_event_loop(storage):
    up = storage.start_upload("library/demo")

    async def use() -> None:
        async with up.lock:
            pass

    asyncio.run(use())
    asyncio.run(use())
