"""zstd frames, their layout and queue, the resumable SHA-256, and the frame table on the
wire, without a network."""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading

import httpx
import pytest
import zstandard

from freetoken.pull.client import RegistryClient
from freetoken.pull.downloads import Transfers
from freetoken.pull.frames import CorruptFrame, FrameQueue, Layout, compress_frames, decode_frame
from freetoken.pull.parts import TransferOptions, plan_parts
from freetoken.pull.sha256 import Sha256
from freetoken.pull.wire import FRAME_SIZE, FRAMES, ZSTD, WireLayer
from freetoken.store import manifest as mf
from freetoken.store.blobs import BlobStore
from tests.pull.test_parts import Blobs

FRAME = 4096
# Compressible but not trivially: frames of a few hundred bytes to a few KB.
DATA = b"".join(os.urandom(200) + bytes(1800) for _ in range(26)) + b"tail"


@pytest.fixture(scope="module")
def framed(tmp_path_factory) -> tuple[bytes, WireLayer]:
    src = tmp_path_factory.mktemp("frames") / "file.bin"
    src.write_bytes(DATA)
    out = io.BytesIO()
    digest, size, frames = compress_frames(src, out, FRAME)
    layer = WireLayer(
        ZSTD,
        digest,
        size,
        "file.bin",
        "sha256:" + hashlib.sha256(DATA).hexdigest(),
        len(DATA),
        FRAME,
        frames,
    )
    return out.getvalue(), layer


def test_frames_decode_alone_and_together(framed):
    blob, layer = framed
    layout = Layout.of(layer)
    assert len(layer.frames) == -(-len(DATA) // FRAME) == 13 and sum(layer.frames) == len(blob)
    out = bytearray(FRAME)
    for k in range(len(layer.frames)):
        offset, size = layout.frame_span(k)
        decode_frame(
            memoryview(blob)[layout.starts[k] : layout.starts[k + 1]], size, memoryview(out)
        )
        assert out[:size] == DATA[offset : offset + size]
    whole = zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True).read()
    assert whole == DATA


def test_the_same_file_compresses_to_the_same_bytes(framed, tmp_path):
    src = tmp_path / "again.bin"
    src.write_bytes(DATA)
    out = io.BytesIO()
    assert compress_frames(src, out, FRAME)[0] == framed[1].digest and out.getvalue() == framed[0]


@pytest.mark.parametrize("damage", ["flip", "truncate", "two frames", "wrong size"])
def test_a_bad_frame_is_corrupt(framed, damage):
    blob, layer = framed
    layout = Layout.of(layer)
    frame = bytearray(blob[layout.starts[1] : layout.starts[2]])
    size = FRAME
    if damage == "flip":
        frame[len(frame) // 2] ^= 1
    elif damage == "truncate":
        frame = frame[:-5]
    elif damage == "two frames":
        frame += blob[layout.starts[2] : layout.starts[3]]
    else:
        size = FRAME - 1
    with pytest.raises(CorruptFrame):
        decode_frame(memoryview(frame), size, memoryview(bytearray(2 * FRAME)))


def test_layout_maps_wire_to_file(framed):
    layout = Layout.of(framed[1])
    starts = layout.starts
    assert layout.file_pos(0) == 0 and layout.file_pos(starts[1] - 1) == 0
    assert layout.file_pos(starts[2]) == 2 * FRAME
    assert layout.file_pos(layout.wire_size) == len(DATA)
    assert (
        layout.wire_pos(2 * FRAME) == starts[2] and layout.wire_pos(len(DATA)) == layout.wire_size
    )
    assert layout.wire_pos(FRAME + 1) is None
    assert layout.align(starts[3] + 5) == starts[3]
    plain = Layout(1000)
    assert (plain.file_pos(500), plain.wire_pos(500), plain.align(7)) == (500, 500, 7)


def test_parts_are_cut_between_frames(framed):
    layout = Layout.of(framed[1])
    opts = TransferOptions(streams=4, part_size=1500, min_part_size=1)
    parts = plan_parts(layout, opts)
    assert [p.offset for p in parts] == sorted({p.offset for p in parts})
    assert sum(p.size for p in parts) == layout.wire_size
    assert all(p.offset in layout.starts and p.end in layout.starts for p in parts)
    assert all(p.size <= 1500 or p.size in layout.frames for p in parts)


def test_the_queue_hands_frames_over_in_order():
    queue = FrameQueue(FRAME, window=2, streams=1)
    got: list[int] = []

    def hash_side():
        for k in range(4):
            buffer = queue.take(k)
            got.append(buffer[0])
            queue.give_back(buffer)

    t = threading.Thread(target=hash_side)
    t.start()
    for k in (1, 0, 3, 2):  # decoded out of order
        buffer = queue.buffer(k)
        buffer[0] = k
        queue.put(k, buffer)
    t.join(5)
    assert got == [0, 1, 2, 3] and queue.made <= queue.limit


def test_the_queue_holds_back_frames_too_far_ahead():
    queue = FrameQueue(FRAME, window=2, streams=1)
    assert queue.buffer(1) is not None
    waited = threading.Event()

    def far_ahead():
        queue.buffer(2)  # two frames past the one the hash waits for
        waited.set()

    t = threading.Thread(target=far_ahead)
    t.start()
    assert not waited.wait(0.2)
    queue.reach(1)
    assert waited.wait(5)
    queue.stop()
    assert queue.buffer(9) is None and queue.take(0) is None
    t.join(5)


def test_sha256_resumes_from_a_saved_state():
    data = os.urandom(100_003)
    first = Sha256()
    first.update(bytearray(data[:70_001]))
    second = Sha256(first.state())
    second.update(memoryview(bytearray(data))[70_001:])
    assert second.hexdigest() == hashlib.sha256(data).hexdigest()
    assert first.hexdigest() == hashlib.sha256(data[:70_001]).hexdigest()  # digest twice
    with pytest.raises(ValueError):
        Sha256(b"short")


def test_the_frame_table_travels_in_annotations(framed):
    layer = framed[1]
    obj = json.loads(json.dumps(layer.to_json()))
    assert obj["annotations"][FRAME_SIZE] == str(FRAME)
    assert obj["annotations"][FRAMES] == ",".join(map(str, layer.frames))
    assert WireLayer.from_json(obj) == layer
    del obj["annotations"]  # a layer pushed as one frame
    old = WireLayer.from_json(obj)
    assert old.compressed and not old.framed and Layout.of(old).file_size == old.size


@pytest.mark.parametrize(
    "table",
    [
        {FRAME_SIZE: "4096", FRAMES: "1,2"},  # frames that do not add up to the blob
        {FRAME_SIZE: "0", FRAMES: "x"},
        {FRAME_SIZE: "4096", FRAMES: "-1"},
        {FRAME_SIZE: str(1 << 40), FRAMES: "10"},  # frames too large to hold
    ],
)
def test_a_bad_frame_table_is_refused(framed, table):
    obj = framed[1].to_json()
    obj["annotations"] = table
    with pytest.raises(mf.ManifestError):
        WireLayer.from_json(obj)


def test_a_framed_download_through_a_mock_registry(framed, tmp_path):
    blob, layer = framed
    blobs = BlobStore(tmp_path)
    blobs.ensure()
    server = Blobs(blob)
    hub = Transfers(TransferOptions(streams=3, part_size=1500, min_part_size=1, backoff=0.0))
    client = RegistryClient("http://reg.test", transport=httpx.MockTransport(server))
    d = hub.acquire(blobs, layer, client, "library/demo")
    assert d.done.wait(10)
    hub.release(d)
    assert d.error is None and d.published and d.reread == 0
    assert blobs.read_bytes(layer.uncompressed_digest) == DATA
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        layer.uncompressed_digest.replace(":", "-")
    ]
