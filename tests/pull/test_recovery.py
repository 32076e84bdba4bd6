"""Pulls that go wrong, against the real registry on loopback: corrupt bytes, killed
registries and pullers, resumes, full disks; for zstd layers in frames and in one frame
(as pushes made them before frames)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import zstandard

from freetoken.pull import RegistryError, pull, pull_model
from freetoken.pull.downloads import Transfers
from freetoken.pull.frames import Layout
from freetoken.pull.parts import PartialFile, plan_parts
from freetoken.pull.wire import ZSTD, WireLayer
from freetoken.store import Store
from tests.pull.conftest import OPTIONS, make_cfg, publish
from tests.pull.harness import CountingTransport, ProcessRegistry
from tests.pull.test_pull import same_files, wire_manifest, wire_shard


def one_frame(registry_root: Path, source: Store, model: str) -> WireLayer:
    """Rewrites the registry's `model` as pushes made it before frames: its compressed
    file one zstd frame, without a frame table. Returns the new wire layer."""
    path = registry_root / "manifests/library" / model / "latest"
    obj = json.loads(path.read_bytes())
    layer = next(x for x in obj["layers"] if x["mediaType"] == ZSTD)
    blob = zstandard.ZstdCompressor(level=3).compress(
        source.blobs.read_bytes(layer["uncompressed_digest"])
    )
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    (registry_root / "blobs" / digest.replace(":", "-")).write_bytes(blob)
    layer.update(digest=digest, size=len(blob))
    del layer["annotations"]
    path.write_bytes(json.dumps(obj).encode())
    return WireLayer.from_json(layer)


def done_ranges(store: Store, layer: WireLayer) -> list[tuple[int, int]]:
    """The wire ranges [a, b) a pull left recorded as fetched: the parts' completed bytes
    and the verified prefix, merged."""
    layout = Layout.of(layer)
    partial = PartialFile(store.blobs.root, layer.digest, layout)
    assert partial.path.exists()
    spans = []
    # a state file being rewritten when the kill came is a .tmp the pull ignores; so do we
    for p in partial.path.parent.glob(partial.path.name + "-*"):
        if p.name.rsplit("-", 1)[1].isdigit():
            s = json.loads(p.read_text())
            spans.append((s["Offset"], s["Offset"] + s["Completed"]))
    if verified := partial.load_verified():
        spans.append((0, layout.wire_pos(verified.offset)))
    merged: list[tuple[int, int]] = []
    for a, b in sorted(x for x in spans if x[1] > x[0]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


def small(registry) -> int:
    """The bytes of wide's blobs but its shard (hashed whole if a pull had not stored them)."""
    return sum(b.size for b in wire_manifest(registry.url, "wide").blobs() if not b.compressed)


def fetched_only_the_rest(
    counted: CountingTransport, layer: WireLayer, done: list[tuple[int, int]]
) -> None:
    """The resumed pull asked for every missing byte once and for no recorded one."""
    assert counted.bytes[layer.digest] == layer.size - sum(b - a for a, b in done)
    for start, end in counted.ranges(layer.digest):
        assert not any(start < b and a <= end for a, b in done), (start, end, done)


# -- corrupt bytes --------------------------------------------------------------------------


@pytest.mark.parametrize("file", ["tokenizer.json", "frames", "one frame"])
def test_a_corrupted_blob_is_not_stored(source, registry, cfg, hub, dest, file):
    publish(source, cfg, "wide")
    if file == "one frame":
        layer = one_frame(registry.root, source, "wide")
    else:
        name = "ftw-00000.bin" if file == "frames" else file
        layer = next(x for x in wire_manifest(registry.url, "wide").layers if x.name == name)
    path = registry.root / "blobs" / layer.digest.replace(":", "-")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(RegistryError) as e:
        pull_model(dest, "wide", cfg=cfg, transfers=hub)
    if file == "frames":  # the frame is fetched again, and again found corrupt
        k = Layout.of(layer).frame_at(len(data) // 2)
        assert str(e.value).startswith(f"downloading {layer.digest}: frame {k} (bytes ")
        assert "does not decode" in str(e.value) and str(e.value).endswith(
            "(gave up after 3 tries)"
        )
    else:
        got = "sha256:" + hashlib.sha256(data).hexdigest()
        assert str(e.value) == (
            f"digest mismatch, file must be downloaded again: want {layer.digest}, got {got}"
        )
    hub.wait_idle(10)
    assert dest.list_models() == []
    assert not (dest.root / "manifests").exists()
    # No file made from the bad blob; other layers may leave resumable partials.
    left = {p.name for p in dest.blobs.root.iterdir()}
    assert not any(layer.local.digest[7:] in n for n in left)
    assert all(len(n) == 71 or "-partial" in n for n in left)


def test_a_frame_corrupted_on_the_way_is_fetched_again(source, registry, cfg, hub, dest):
    publish(source, cfg, "wide")
    layer = wire_shard(registry.url, "wide")
    layout = Layout.of(layer)
    k = len(layer.frames) // 2
    counted = CountingTransport(flip={layer.digest: [layout.starts[k] + 100]})
    pull_model(dest, "wide", cfg=cfg, transfers=hub, transport=counted)
    same_files(source, dest, "wide")
    # One more request, from the bad frame on; what came before it in its part was kept.
    parts = plan_parts(layout, OPTIONS)
    starts = sorted(a for a, _ in counted.ranges(layer.digest))
    assert starts == sorted([p.offset for p in parts] + [layout.starts[k]])
    assert layer.size < counted.bytes[layer.digest] <= layer.size + max(p.size for p in parts)


# -- resume ---------------------------------------------------------------------------------


def test_resume_after_the_registry_is_killed(source, tmp_path, hub, dest):
    with ProcessRegistry(tmp_path / "registry") as reg:
        cfg = make_cfg(tmp_path / "models", reg.url)
        publish(source, cfg, "wide")
        layer = wire_shard(reg.url, "wide")
        slow = CountingTransport(delay=0.02)
        with pytest.raises(RegistryError, match="gave up after"):
            for event in pull(dest, "wide", cfg=cfg, transfers=hub, transport=slow):
                if event.get("digest") == layer.digest and event["completed"] > layer.size * 0.4:
                    reg.kill()
        assert hub.wait_idle(10)
        assert dest.list_models() == []
        done = done_ranges(dest, layer)
        assert 0 < sum(b - a for a, b in done) < layer.size
        reg.start()
        counted = CountingTransport()
        pull_model(dest, "wide", cfg=cfg, transfers=hub, transport=counted)
    same_files(source, dest, "wide")
    fetched_only_the_rest(counted, layer, done)


_PULLER = """
import sys
from freetoken.pull import Transfers, pull
from freetoken.store import Store
from tests.pull.conftest import OPTIONS, make_cfg
from tests.pull.harness import CountingTransport
store, url = Store(sys.argv[1]), sys.argv[2]
events = pull(store, "wide", cfg=make_cfg(store.root, url), transfers=Transfers(OPTIONS),
              transport=CountingTransport(delay=0.02))
for event in events:
    print(event.get("digest", "-"), event.get("completed", 0), flush=True)
"""


@pytest.mark.parametrize("framing", ["frames", "one frame"])
def test_resume_after_the_puller_is_killed(source, registry, cfg, hub, dest, framing):
    publish(source, cfg, "wide")
    layer = wire_shard(registry.url, "wide")
    if framing == "one frame":
        layer = one_frame(registry.root, source, "wide")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-c", _PULLER, str(dest.root), registry.url],
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        digest, completed = line.split()
        if digest == layer.digest and int(completed) > layer.size * 0.5:
            proc.kill()  # SIGKILL: no clean-up runs
            break
    proc.wait()
    assert dest.list_models() == []  # the manifest is written last
    dest.prune()  # a server started now (issue 22: it pruned the partial, losing the pull)
    done = done_ranges(dest, layer)
    assert 0 < sum(b - a for a, b in done) < layer.size
    verified = PartialFile(dest.blobs.root, layer.digest, Layout.of(layer)).load_verified()
    counted = CountingTransport()
    stats = pull_model(dest, "wide", cfg=cfg, transfers=hub, transport=counted)
    same_files(source, dest, "wide")
    fetched_only_the_rest(counted, layer, done)
    if framing == "frames":  # the hash went on from its saved state
        assert verified is not None and verified.offset > 0
        assert stats.reread_bytes <= layer.uncompressed_size - verified.offset + small(registry)
    else:  # one frame is decompressed, and so hashed, from its start again
        assert verified is None


def test_a_stopped_pull_goes_on_from_what_it_verified(source, registry, cfg, hub, dest):
    publish(source, cfg, "wide")
    layer = wire_shard(registry.url, "wide")

    class Stop(Exception):
        pass

    def stop_half_way(event: dict) -> None:
        if event.get("digest") == layer.digest and event["completed"] >= layer.size // 2:
            raise Stop

    with pytest.raises(Stop):
        pull_model(
            dest,
            "wide",
            cfg=cfg,
            transfers=hub,
            progress=stop_half_way,
            transport=CountingTransport(delay=0.01),
        )
    assert hub.wait_idle(10)
    verified = PartialFile(dest.blobs.root, layer.digest, Layout.of(layer)).load_verified()
    assert verified is not None and 0 < verified.offset < layer.uncompressed_size
    done = done_ranges(dest, layer)
    counted = CountingTransport()
    stats = pull_model(dest, "wide", cfg=cfg, transfers=hub, transport=counted)
    same_files(source, dest, "wide")
    fetched_only_the_rest(counted, layer, done)
    assert stats.reread_bytes <= layer.uncompressed_size - verified.offset + small(registry)


def test_a_layer_of_one_frame_pulls(source, registry, cfg, hub, dest):
    publish(source, cfg, "wide")
    layer = one_frame(registry.root, source, "wide")
    assert layer.compressed and not layer.framed
    stats = pull_model(dest, "wide", cfg=cfg, transfers=hub)
    same_files(source, dest, "wide")
    assert stats.fetched_bytes == stats.total_bytes


# -- full disks -----------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path, request):
    """A tmpfs of the size the test asks for, as the store's directory."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={request.param}", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode})")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


# 4 MB: the shard's space (7.5 MB) cannot even be reserved. 10 MB, a shard of one frame:
# the compressed shard (6.9 MB) arrives, but there is no room to decompress it next to it.
@pytest.mark.parametrize(
    "small_disk, framing", [("4m", "frames"), ("10m", "one frame")], indirect=["small_disk"]
)
def test_a_full_disk_fails_cleanly(source, registry, cfg, hub, small_disk, framing):
    publish(source, cfg, "wide")
    layer = wire_shard(registry.url, "wide")
    if framing == "one frame":
        layer = one_frame(registry.root, source, "wide")
    store = Store(small_disk)
    with pytest.raises(RegistryError) as e:
        pull_model(store, "wide", cfg=cfg, transfers=hub)
    assert "no space left on device" in str(e.value) and e.value.status == 507
    hub.wait_idle(10)
    assert store.list_models() == []
    assert not (small_disk / "manifests").exists()
    # What stays is whole (verified) blobs and resumable partials; no half-written blob.
    for p in store.blobs.root.iterdir():
        assert len(p.name) == 71 or p.name.startswith("sha256-") and "-partial" in p.name, p.name
        assert layer.local.digest[7:] not in p.name


@pytest.mark.parametrize("small_disk", ["10m"], indirect=True)
def test_frames_need_no_room_for_a_compressed_copy(source, registry, cfg, hub, small_disk):
    publish(source, cfg, "wide")
    store = Store(small_disk)
    pull_model(store, "wide", cfg=cfg, transfers=hub)  # frames decode into the file's place
    same_files(source, store, "wide")


class _Stalling(CountingTransport):
    """The registry answers everything but the blobs' bytes, which never come: each ranged
    GET waits out the read timeout (`stall` seconds) and fails as a stalled read does."""

    def __init__(self, stall: float):
        super().__init__()
        self.stall, self.tries = stall, 0

    def handle_request(self, request):
        if request.method == "GET" and request.headers.get("range"):
            self.tries += 1
            time.sleep(self.stall)
            raise httpx.ReadTimeout("timed out", request=request)
        return super().handle_request(request)


def test_a_stalled_registry_is_reported_within_the_give_up_time(source, registry, cfg, dest):
    # issue 22: every try of every part waited out its stall, 274 s with the defaults
    publish(source, cfg, "tiny")
    opts = dataclasses.replace(OPTIONS, stall_timeout=0.5, give_up=2.0, backoff=0.2, retries=6)
    hub = Transfers(opts)
    t0 = time.monotonic()
    try:
        with pytest.raises(RegistryError, match=r"gave up after \d tries, \d s without a byte"):
            pull_model(dest, "tiny", cfg=cfg, transfers=hub, transport=_Stalling(0.5))
    finally:
        hub.close()
    assert time.monotonic() - t0 < 2.0 + 1.5  # the budget, and the stall in flight
    assert dest.list_models() == []


def test_a_registry_that_never_answers_is_reported_at_its_first_stall(tmp_path, dest):
    with socket.socket() as silent:  # accepts connections, reads, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        cfg = make_cfg(tmp_path / "models", f"http://127.0.0.1:{silent.getsockname()[1]}")
        hub = Transfers(dataclasses.replace(OPTIONS, stall_timeout=1.0))
        t0 = time.monotonic()
        try:
            with pytest.raises(RegistryError, match="timed out"):
                pull_model(dest, "tiny", cfg=cfg, transfers=hub)
        finally:
            hub.close()
    assert time.monotonic() - t0 < 5
