import hashlib
import os
import threading
import zlib

import pytest

from freetoken.ftw import sink
from freetoken.ftw.sink import Checksums, Sink


def _pieces(n: int, size: int) -> list[bytes]:
    return [os.urandom(size + 17 * i) for i in range(n)]


def test_files_written_and_hashed_in_order(tmp_path):
    s = Sink(depth=1)
    files = {"a.bin": _pieces(5, 3000), "b.bin": _pieces(3, 100), "c.bin": []}
    for name, pieces in files.items():
        s.open(tmp_path / name)
        for p in pieces:
            s.write(memoryview(p))
    s.finish()
    for name, pieces in files.items():
        data = b"".join(pieces)
        assert (tmp_path / name).read_bytes() == data
        assert s.digests[name] == "sha256:" + hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("hashers", [1, 2, 3])
def test_files_spread_over_hashers_keep_their_own_digests(tmp_path, monkeypatch, hashers):
    monkeypatch.setattr(sink, "HASH_BACKLOG", 5000)  # a hasher holds a piece or two at most
    s = Sink(hashers=hashers)
    files = {f"{i}.bin": _pieces(4 + i % 3, 2000 + 300 * i) for i in range(7)}
    for name, pieces in files.items():
        s.open(tmp_path / name)
        for p in pieces:
            s.write(memoryview(p))
    s.finish()
    assert set(s.digests) == set(files)
    for name, pieces in files.items():
        data = b"".join(pieces)
        assert (tmp_path / name).read_bytes() == data
        assert s.digests[name] == "sha256:" + hashlib.sha256(data).hexdigest()


def test_a_worker_holds_at_most_its_budget_of_bytes():
    release, seen, most = threading.Event(), [], [0]

    def handle(op, arg):
        release.wait()
        seen.append(op)

    w = sink._Worker("t", handle, depth=100, budget=250)
    w.put("write", memoryview(b"x" * 400))  # larger than the budget: taken with nothing queued
    blocked = threading.Thread(target=lambda: w.put("write", memoryview(b"y" * 10)))
    blocked.start()
    blocked.join(0.2)
    assert blocked.is_alive()  # 400 bytes held: the next waits for them
    most[0] = w._bytes
    release.set()
    blocked.join(5)
    assert not blocked.is_alive()
    w.stop()
    assert most[0] == 400 and seen == ["write", "write", "stop"] and w._bytes == 0


def test_writeback_is_started_behind_the_writer(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(sink, "WRITEBACK", 4096)
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, start, n, advice: calls.append((start, n)))
    s = Sink()
    s.open(tmp_path / "a.bin")
    pieces = _pieces(40, 1000)
    for p in pieces:
        s.write(memoryview(p))
    s.finish()
    total = sum(map(len, pieces))
    assert (tmp_path / "a.bin").read_bytes() == b"".join(pieces)
    # contiguous stretches from the start, each ending a stretch behind the bytes written,
    # then the rest as the file closes
    assert calls and calls[0][0] == 0
    for (s0, n0), (s1, _) in zip(calls, calls[1:], strict=False):
        assert s0 + n0 == s1
    assert 0 < calls[-2][0] + calls[-2][1] <= total - 4096
    assert calls[-1][0] + calls[-1][1] == total


def test_each_file_is_handed_to_writeback_whole_as_it_closes(tmp_path, monkeypatch):
    """A shard's tail is not left dirty for the final fsync, after every other shard."""
    calls = []
    monkeypatch.setattr(sink, "WRITEBACK", 1 << 20)  # no file here reaches a stretch
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, start, n, advice: calls.append((start, n)))
    s = Sink()
    sizes = {"a.bin": 5000, "b.bin": 0, "c.bin": 7000}
    for name, n in sizes.items():
        s.open(tmp_path / name)
        if n:
            s.write(memoryview(os.urandom(n)))
    s.finish()
    assert calls == [(0, 5000), (0, 7000)]  # an empty file has nothing to hand over


def test_a_failed_write_is_raised_and_later_writes_refused(tmp_path):
    s = Sink()
    s.open(tmp_path / "missing" / "a.bin")  # the writer thread cannot open it
    with pytest.raises(FileNotFoundError):
        s.finish()
    with pytest.raises(FileNotFoundError):
        s.write(memoryview(b"x"))


def test_checksums_fill_their_entries():
    c = Checksums(workers=3, depth=2)
    pieces = _pieces(12, 5000)
    entries = [{"name": str(i)} for i in range(len(pieces))]
    for e, p in zip(entries, pieces, strict=True):
        c.add(e, memoryview(p))
    c.resolve()
    assert [e["crc32"] for e in entries] == [zlib.crc32(p) for p in pieces]


def test_checksums_aborted_leave_the_pool_ended():
    c = Checksums(workers=2, depth=8)
    entries = [{} for _ in range(6)]
    for e in entries:
        c.add(e, memoryview(os.urandom(1 << 16)))
    c.abort()
    assert all(set(e) <= {"crc32"} for e in entries)
    with pytest.raises(RuntimeError):  # no new work after the pool ended
        c.add({}, memoryview(b"x"))
