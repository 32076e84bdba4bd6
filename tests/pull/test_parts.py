"""Part bookkeeping and resume logic, against httpx.MockTransport (no network).

The loopback tests (test_pull.py) cover the same behaviour against the real registry.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading

import httpx
import pytest

from freetoken.pull.client import RegistryClient, RegistryError
from freetoken.pull.downloads import Transfers
from freetoken.pull.parts import (
    Part,
    PartialFile,
    TransferOptions,
    Verified,
    fetch_part,
    plan_parts,
)
from freetoken.pull.sha256 import Sha256
from freetoken.pull.wire import WireLayer
from freetoken.store import manifest as mf
from freetoken.store.blobs import BlobStore

OPTS = TransferOptions(
    streams=4, part_size=1000, min_part_size=100, retries=2, backoff=0.0, state_every=1
)
DATA = os.urandom(3500)
DIGEST = "sha256:" + hashlib.sha256(DATA).hexdigest()


class Blobs:
    """A registry that serves DATA with Range support, recording each range asked for;
    `break_after` cuts the next responses short with a read error."""

    def __init__(self, data: bytes = DATA, error: type[httpx.TransportError] = httpx.ReadError):
        self.data = data
        self.error = error
        self.ranges: list[tuple[int, int]] = []
        self.break_after: list[int] = []
        self.lock = threading.Lock()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        a, b = map(int, request.headers["range"].removeprefix("bytes=").split("-"))
        with self.lock:
            self.ranges.append((a, b))
            cut = self.break_after.pop(0) if self.break_after else None
        body = self.data[a : b + 1]

        def stream():
            if cut is None:
                yield body
                return
            yield body[:cut]
            raise self.error("connection reset or stalled")

        headers = {"Content-Range": f"bytes {a}-{b}/{len(self.data)}"}
        return httpx.Response(206, headers=headers, content=stream())


def client(server: Blobs) -> RegistryClient:
    return RegistryClient("http://reg.test", transport=httpx.MockTransport(server))


def test_parts_tile_the_blob():
    assert plan_parts(0, OPTS) == []
    parts = plan_parts(3500, OPTS)
    assert [(p.offset, p.size) for p in parts] == [(0, 875), (875, 875), (1750, 875), (2625, 875)]
    big = plan_parts(10_000, OPTS)  # capped at part_size
    assert len(big) == 10 and sum(p.size for p in big) == 10_000
    small = plan_parts(150, OPTS)  # never below min_part_size
    assert [(p.offset, p.size) for p in small] == [(0, 100), (100, 50)]


def test_saved_parts_are_resumed(tmp_path):
    f = PartialFile(tmp_path, DIGEST, len(DATA))
    parts, verified = f.open(OPTS)
    assert verified is None and [p.completed for p in parts] == [0, 0, 0, 0]
    assert list(tmp_path.glob("*-partial-*")) == []  # a part's state is written once it begins
    parts[1].completed = 500
    start = parts[1].offset
    f.write(start, [DATA[start : start + 200], DATA[start + 200 : start + 500]])  # one pwritev
    f.save(parts[1])
    f.close()
    again, _ = PartialFile(tmp_path, DIGEST, len(DATA)).open(OPTS)
    assert [p.completed for p in again] == [0, 500, 0, 0]
    state = json.loads((tmp_path / (DIGEST.replace(":", "-") + "-partial-1")).read_text())
    assert state == {"N": 1, "Offset": 875, "Size": 875, "Completed": 500}


def test_the_verified_prefix_counts_as_fetched(tmp_path):
    f = PartialFile(tmp_path, DIGEST, len(DATA))
    parts, _ = f.open(OPTS)
    parts[0].completed = 100  # its state lags behind what was hashed
    f.save(parts[0])
    h = Sha256()
    h.update(DATA[:1000])
    f.save_verified(Verified(1000, h.state()))
    f.close()
    again, verified = PartialFile(tmp_path, DIGEST, len(DATA)).open(OPTS)
    assert verified == Verified(1000, h.state())
    assert [p.completed for p in again] == [875, 125, 0, 0]


@pytest.mark.parametrize("damage", ["other_plan", "garbage", "verified_garbage", "short_file"])
def test_a_state_that_does_not_fit_is_ignored(tmp_path, damage):
    f = PartialFile(tmp_path, DIGEST, len(DATA))
    parts, _ = f.open(OPTS)
    parts[0].completed, parts[2].completed = 875, 10
    f.save(parts[0])
    f.save(parts[2])
    f.close()
    want = [875, 0, 10, 0]
    if damage == "other_plan":  # saved with other options: parts of another size
        f.state_path(2).write_text(
            json.dumps({"N": 2, "Offset": 1750, "Size": 500, "Completed": 10})
        )
        want = [875, 0, 0, 0]
    elif damage == "garbage":
        f.state_path(0).write_text("{")
        want = [0, 0, 10, 0]
    elif damage == "verified_garbage":
        f.verified_path.write_text(json.dumps({"Offset": 3000, "Sha256": "00"}))
    else:
        os.truncate(f.path, 10)
        want = [0, 0, 0, 0]
    again, verified = PartialFile(tmp_path, DIGEST, len(DATA)).open(OPTS)
    assert [p.completed for p in again] == want and verified is None
    assert f.path.stat().st_size == len(DATA)


# A stall is a read that times out (the client's read timeout is the stall timeout).
@pytest.mark.parametrize("error", [httpx.ReadError, httpx.ReadTimeout, httpx.RemoteProtocolError])
def test_a_broken_stream_is_resumed_where_it_stopped(tmp_path, error):
    server = Blobs(error=error)
    server.break_after = [300]  # the first response dies after 300 bytes
    f = PartialFile(tmp_path, DIGEST, len(DATA))
    part = f.open(OPTS)[0][0]
    got = []
    fetch_part(client(server), "library/demo", DIGEST, part, f, OPTS, threading.Event(), got.append)
    assert part.done and sum(got) == part.size
    assert server.ranges == [(0, 874), (300, 874)]  # the 300 bytes were kept
    assert f.path.read_bytes()[:875] == DATA[:875]


def test_a_part_gives_up_after_its_retries(tmp_path):
    server = Blobs()
    server.break_after = [0] * 10
    f = PartialFile(tmp_path, DIGEST, len(DATA))
    part = f.open(OPTS)[0][0]
    with pytest.raises(RegistryError, match="gave up after 3 tries"):
        fetch_part(
            client(server), "library/demo", DIGEST, part, f, OPTS, threading.Event(), lambda n: None
        )
    assert len(server.ranges) == 3  # the first try and two retries


def _layer(data: bytes = DATA) -> WireLayer:
    return WireLayer(mf.FILE, "sha256:" + hashlib.sha256(data).hexdigest(), len(data), "f.bin")


def _run(hub: Transfers, blobs: BlobStore, layer: WireLayer, server: Blobs):
    d = hub.acquire(blobs, layer, client(server), "library/demo")
    d.done.wait(10)
    hub.release(d)
    return d


def test_download_fetches_only_the_missing_parts(tmp_path):
    blobs = BlobStore(tmp_path)
    blobs.ensure()
    f = PartialFile(tmp_path, DIGEST, len(DATA))
    parts, _ = f.open(OPTS)
    for p in parts[:2]:  # an earlier pull finished two parts, then stopped
        f.write(p.offset, [DATA[p.offset : p.end]])
        p.completed = p.size
        f.save(p)
    f.close()
    server = Blobs()
    d = _run(Transfers(OPTS), blobs, _layer(), server)
    assert d.error is None and d.published
    assert sorted(server.ranges) == [(1750, 2624), (2625, 3499)]
    assert blobs.read_bytes(DIGEST) == DATA
    assert sorted(p.name for p in tmp_path.iterdir()) == [DIGEST.replace(":", "-")]


def test_digest_mismatch_stores_nothing(tmp_path):
    blobs = BlobStore(tmp_path)
    blobs.ensure()
    server = Blobs(DATA[:-1] + bytes([DATA[-1] ^ 1]))
    d = _run(Transfers(OPTS), blobs, _layer(), server)
    got = "sha256:" + hashlib.sha256(server.data).hexdigest()
    assert str(d.error) == (
        f"digest mismatch, file must be downloaded again: want {DIGEST}, got {got}"
    )
    assert list(tmp_path.iterdir()) == []


def test_one_download_per_digest(tmp_path):
    blobs = BlobStore(tmp_path)
    blobs.ensure()
    gate = threading.Event()

    class Slow(Blobs):
        def __call__(self, request):
            gate.wait(10)
            return super().__call__(request)

    server = Slow()
    hub = Transfers(OPTS)
    first = hub.acquire(blobs, _layer(), client(server), "library/demo")
    second = hub.acquire(blobs, _layer(), client(server), "library/demo")
    assert first is second and first.subscribers == 2
    hub.release(first)
    assert not first.cancelled.is_set()  # the other pull still waits on it
    gate.set()
    first.done.wait(10)
    hub.release(second)
    assert first.published and len(server.ranges) == 4


def test_the_last_pull_to_leave_stops_the_download(tmp_path):
    blobs = BlobStore(tmp_path)
    blobs.ensure()
    gate = threading.Event()

    class Stuck(Blobs):
        def __call__(self, request):
            gate.wait(10)
            return super().__call__(request)

    hub = Transfers(OPTS)
    d = hub.acquire(blobs, _layer(), client(Stuck()), "library/demo")
    hub.release(d)
    assert d.cancelled.is_set()
    gate.set()
    assert d.done.wait(10) and not d.published
    # The partial stays for the next pull, which fetches what is missing and publishes it.
    assert PartialFile(tmp_path, DIGEST, len(DATA)).path.exists()
    again = _run(hub, blobs, _layer(), Blobs())
    assert again.published and blobs.read_bytes(DIGEST) == DATA


def test_a_part_is_a_range(tmp_path):
    p = Part(3, 100, 50, 20)
    assert (p.start, p.end, p.done) == (120, 150, False)


def test_streams_come_from_the_settings():
    from freetoken import config

    for env in ({"FREETOKEN_MAX_TRANSFER_STREAMS": "3"}, {"OLLAMA_MAX_TRANSFER_STREAMS": "3"}):
        assert TransferOptions.from_config(config.load(env)).streams == 3
    with pytest.raises(config.ConfigError, match="FREETOKEN_MAX_TRANSFER_STREAMS"):
        config.load({"FREETOKEN_MAX_TRANSFER_STREAMS": "0"})


def test_a_stopped_download_does_not_wait_for_busy_streams(tmp_path):
    blobs = BlobStore(tmp_path)
    blobs.ensure()
    gate = threading.Event()

    class Stuck(Blobs):
        def __call__(self, request):
            gate.wait(10)
            return super().__call__(request)

    hub = Transfers(TransferOptions(streams=1, part_size=1000, min_part_size=100))
    other = os.urandom(500)
    busy = hub.acquire(blobs, _layer(other), client(Stuck(other)), "library/demo")
    queued = hub.acquire(blobs, _layer(), client(Blobs()), "library/demo")
    hub.release(queued)  # its parts never got a stream: it ends at once
    assert queued.done.wait(2) and not queued.published
    gate.set()
    assert busy.done.wait(10) and busy.published
    hub.release(busy)
