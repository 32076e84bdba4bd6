import hashlib
from pathlib import Path

import pytest

from freetoken.store import BlobStore, DigestMismatch, InvalidName


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.fixture
def blobs(tmp_path: Path) -> BlobStore:
    return BlobStore(tmp_path / "blobs")


def test_put_stream_publishes_under_its_digest(blobs):
    d, created = blobs.put_stream([b"hel", b"lo"], expected=digest(b"hello"))
    assert (d, created) == (digest(b"hello"), True)
    assert blobs.has(d) and blobs.path(d).name == "sha256-" + d[7:]
    assert blobs.read_bytes(d) == b"hello" and blobs.size(d) == 5
    assert blobs.put_stream([b"hello"]) == (d, False)
    assert [p.name for p in blobs.root.iterdir()] == [blobs.path(d).name]


def test_digest_mismatch_leaves_nothing_behind(blobs):
    wrong = digest(b"other")
    with pytest.raises(DigestMismatch) as e:
        blobs.put_stream([b"hello"], expected=wrong)
    assert str(e.value) == f'digest mismatch, expected "{wrong}", got "{digest(b"hello")}"'
    assert list(blobs.root.iterdir()) == []


def test_abandoned_writer_is_never_visible(blobs):
    with blobs.writer() as w:
        w.write(b"half a blob")
        assert blobs.digests() == set()  # only a temporary file exists so far
    assert list(blobs.root.iterdir()) == []


def test_a_crashed_write_leaves_a_partial_that_prune_removes(blobs):
    w = blobs.writer()
    w.write(b"interrupted")  # the process dies here: no commit, no abort
    keep = blobs.put_bytes(b"kept")
    drop = blobs.put_bytes(b"unreferenced")
    assert blobs.digests() == {keep, drop}
    removed = blobs.prune({keep})
    assert len(removed) == 2 and blobs.digests() == {keep}
    assert [p.name for p in blobs.root.iterdir()] == [blobs.path(keep).name]


def test_put_file_reports_progress(blobs, tmp_path):
    src = tmp_path / "f.bin"
    src.write_bytes(b"x" * 3_000_000)
    seen = []
    d, created = blobs.put_file(src, progress=seen.append)
    assert created and d == digest(src.read_bytes()) and sum(seen) == 3_000_000


@pytest.mark.parametrize("bad", ["sha256:xyz", "md5:" + "0" * 64, "sha256:" + "0" * 63, "../etc"])
def test_bad_digests_are_rejected(blobs, bad):
    with pytest.raises(InvalidName):
        blobs.path(bad)


def test_dash_and_colon_forms_name_the_same_blob(blobs):
    d = blobs.put_bytes(b"a")
    assert blobs.has(d.replace(":", "-")) and blobs.has(d.upper().replace("SHA256", "sha256"))


def test_a_linked_file_is_published_under_its_digest_once(blobs, tmp_path):
    src = tmp_path / "weights.bin"
    src.write_bytes(b"w" * 10_000)
    staged, how = blobs.stage_link(src)
    assert how in ("reflink", "hard link") and staged.parent == blobs.root
    assert blobs.digests() == set()  # a temporary name until published
    d = digest(src.read_bytes())
    assert blobs.publish(staged, d) and blobs.read_bytes(d) == src.read_bytes()
    again, _ = blobs.stage_link(src)
    assert not blobs.publish(again, d) and not again.exists()
    assert [p.name for p in blobs.root.iterdir()] == [blobs.path(d).name]


def test_adopt_takes_a_digest_computed_while_writing(blobs, tmp_path):
    blobs.ensure()
    f = blobs.root / "converted"
    f.write_bytes(b"ftw shard")
    d, size, created = blobs.adopt(f, digest(b"ftw shard"))
    assert (d, size, created) == (digest(b"ftw shard"), 9, True) and not f.exists()
