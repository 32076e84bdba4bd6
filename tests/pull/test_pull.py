"""Pull and push against the real registry on loopback."""

from __future__ import annotations

import hashlib
import importlib
import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from freetoken.pull import RegistryError, pull_model, push_model
from freetoken.pull.parts import PartialFile
from freetoken.pull.wire import ZSTD, WireManifest
from freetoken.store import Store
from tests.pull.conftest import OPTIONS, make_cfg, publish, shard
from tests.pull.harness import CountingTransport, ProcessRegistry, ThreadRegistry


def wire_manifest(url: str, model: str) -> WireManifest:
    return WireManifest.from_bytes(httpx.get(f"{url}/v2/library/{model}/manifests/latest").content)


def wire_shard(url: str, model: str):
    return next(x for x in wire_manifest(url, model).layers if x.name == "ftw-00000.bin")


def same_files(a: Store, b: Store, name: str) -> None:
    fa, fb = a.runner_files(a.resolve(name)), b.runner_files(b.resolve(name))
    assert fa.keys() == fb.keys()
    for key in fa:
        assert Path(fa[key]).read_bytes() == Path(fb[key]).read_bytes(), key


def test_push_then_pull_is_byte_identical(source, registry, cfg, hub, dest):
    publish(source, cfg, "tiny", "wide")
    events = []
    stats = pull_model(dest, "wide", cfg=cfg, transfers=hub, progress=events.append)
    same_files(source, dest, "wide")
    # The same layers in the same order: the manifest, and so the model's ID, is the same.
    assert dest.resolve("wide").digest == source.resolve("wide").digest
    assert [m["name"] for m in dest.list_models()] == ["wide:latest"]
    statuses = [e["status"] for e in events]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    for e in events[1:-3]:
        assert e["status"] == f"pulling {e['digest'][7:19]}" and 0 <= e["completed"] <= e["total"]
    wire = wire_manifest(registry.url, "wide")
    assert {e["digest"] for e in events if "digest" in e} == {b.digest for b in wire.blobs()}
    assert {e["digest"]: e["completed"] for e in events if "digest" in e} == {
        b.digest: b.size for b in wire.blobs()}
    assert stats.fetched_bytes == stats.total_bytes == sum(b.size for b in wire.blobs())
    # Only the uncompressed files are in the store, and nothing else.
    names = sorted(p.name for p in dest.blobs.root.iterdir())
    assert names == sorted(d.replace(":", "-") for d in dest.resolve("wide").manifest.digests())


def test_large_files_travel_compressed(source, registry, cfg):
    publish(source, cfg, "wide")
    layer = wire_shard(registry.url, "wide")
    assert layer.media_type == ZSTD
    assert layer.uncompressed_digest == shard(source, "wide")
    assert layer.size < layer.uncompressed_size
    small = [x for x in wire_manifest(registry.url, "wide").layers if x.name != "ftw-00000.bin"]
    assert all(x.media_type != ZSTD for x in small)


def test_a_second_pull_fetches_nothing(source, registry, cfg, hub, dest):
    publish(source, cfg, "tiny")
    pull_model(dest, "tiny", cfg=cfg, transfers=hub)
    counted = CountingTransport()
    events = []
    stats = pull_model(dest, "tiny", cfg=cfg, transfers=hub, transport=counted,
                       progress=events.append)
    assert [m for m, _, _ in counted.requests] == ["GET"]  # the manifest only
    assert stats.fetched_bytes == 0 and stats.cached_bytes == stats.total_bytes
    layers = [e for e in events if "digest" in e]
    assert layers and all(e["completed"] == e["total"] for e in layers)


@pytest.mark.parametrize("remembered", [True, False])
def test_a_repeated_push_sends_nothing(source, registry, cfg, remembered):
    publish(source, cfg, "wide")
    first = (registry.root / "manifests/library/wide/latest").read_bytes()
    if not remembered:  # as a new process would: compress again
        importlib.import_module("freetoken.pull.push")._zstd_digests.clear()
    counted = CountingTransport()
    events = []
    stats = push_model(source, "wide", cfg=cfg, options=OPTIONS, transport=counted,
                       progress=events.append)
    assert stats.sent_bytes == 0 and stats.skipped_bytes > 0
    assert {m for m, _, _ in counted.requests} == {"HEAD", "PUT"}  # and the PUT is the manifest
    # One thread of zstd: the same bytes, so the same digests and the same manifest.
    assert (registry.root / "manifests/library/wide/latest").read_bytes() == first
    compressed = any(e["status"].startswith("compressing") for e in events)
    assert compressed is not remembered


@pytest.mark.parametrize("name", ["nosuch", "tiny:nosuch", "other/tiny"])
def test_unknown_model_or_tag(source, registry, cfg, hub, dest, name):
    publish(source, cfg, "tiny")
    with pytest.raises(RegistryError) as e:
        pull_model(dest, name, cfg=cfg, transfers=hub)
    assert str(e.value) == "pull model manifest: file does not exist" and e.value.status == 404
    assert dest.list_models() == []


@pytest.mark.parametrize("file", ["tokenizer.json", "ftw-00000.bin"])
def test_a_corrupted_blob_is_not_stored(source, registry, cfg, hub, dest, file):
    publish(source, cfg, "wide")
    layer = next(x for x in wire_manifest(registry.url, "wide").layers if x.name == file)
    path = registry.root / "blobs" / layer.digest.replace(":", "-")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(RegistryError) as e:
        pull_model(dest, "wide", cfg=cfg, transfers=hub)
    got = "sha256:" + hashlib.sha256(data).hexdigest()
    assert str(e.value) == (
        f"digest mismatch, file must be downloaded again: want {layer.digest}, got {got}")
    hub.wait_idle(10)
    assert dest.list_models() == []
    assert not (dest.root / "manifests").exists()
    # Neither the bad blob nor a file made from it; other layers may leave resumable partials.
    left = {p.name for p in dest.blobs.root.iterdir()}
    assert not any(layer.digest[7:] in n or layer.local.digest[7:] in n for n in left)
    assert all(len(n) == 71 or "-partial" in n for n in left)


def test_pulls_of_one_model_share_the_download(source, registry, cfg, hub, dest):
    publish(source, cfg, "wide")
    layer = wire_shard(registry.url, "wide")
    counted = CountingTransport(delay=0.01)
    results: list[object] = []
    seen: list[list[int]] = [[], []]

    def one(i: int) -> None:
        def progress(e: dict) -> None:
            if e.get("digest") == layer.digest:
                seen[i].append(e["completed"])

        try:
            results.append(pull_model(dest, "wide", cfg=cfg, transfers=hub, transport=counted,
                                      progress=progress))
        except Exception as e:  # reported below
            results.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(not isinstance(r, Exception) for r in results), results
    same_files(source, dest, "wide")
    # Both pulls watched the shard arrive, and it was fetched once, not twice.
    assert all(s[0] < layer.size and s[-1] == layer.size for s in seen), seen
    assert counted.bytes[layer.digest] == layer.size
    assert len(counted.ranges(layer.digest)) == len(set(counted.ranges(layer.digest)))


def test_resume_after_the_registry_is_killed(source, tmp_path, hub, dest):
    with ProcessRegistry(tmp_path / "registry") as reg:
        cfg = make_cfg(tmp_path / "models", reg.url)
        publish(source, cfg, "wide")
        layer = wire_shard(reg.url, "wide")
        slow = CountingTransport(delay=0.02)
        with pytest.raises(RegistryError, match="gave up after"):
            for event in pull_model_events(dest, cfg, hub, slow):
                if event.get("digest") == layer.digest and event["completed"] > layer.size * 0.4:
                    reg.kill()
        assert hub.wait_idle(10)
        assert dest.list_models() == []
        saved = saved_parts(dest, layer)
        done = sum(c for _, _, c in saved)
        assert 0 < done < layer.size
        reg.start()
        counted = CountingTransport()
        pull_model(dest, "wide", cfg=cfg, transfers=hub, transport=counted)
    same_files(source, dest, "wide")
    # Only what was missing came again: no byte of a saved range was asked for twice.
    assert counted.bytes[layer.digest] == layer.size - done
    for start, _ in counted.ranges(layer.digest):
        assert any(off + c <= start < off + size for off, size, c in saved), start


def pull_model_events(store, cfg, hub, transport):
    from freetoken.pull import pull

    return pull(store, "wide", cfg=cfg, transfers=hub, transport=transport)


def saved_parts(store: Store, layer) -> list[tuple[int, int, int]]:
    partial = PartialFile(store.blobs.root, layer.digest, layer.size)
    assert partial.path.exists()
    # a state file being rewritten when the kill came is a .tmp the pull ignores; so do we
    states = [json.loads(p.read_text()) for p in partial.path.parent.glob(partial.path.name + "-*")
              if p.name.rsplit("-", 1)[1].isdigit()]
    return sorted((s["Offset"], s["Size"], s["Completed"]) for s in states)


@pytest.fixture
def small_disk(tmp_path, request):
    """A tmpfs of the size the test asks for, as the store's directory."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={request.param}", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip() or r.returncode})")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


# 4 MB: the shard's space cannot even be reserved. 10 MB: the compressed shard (6.9 MB)
# arrives, but there is no room to decompress it (7.5 MB) next to it.
@pytest.mark.parametrize("small_disk", ["4m", "10m"], indirect=True)
def test_a_full_disk_fails_cleanly(source, registry, cfg, hub, small_disk):
    publish(source, cfg, "wide")
    store = Store(small_disk)
    with pytest.raises(RegistryError) as e:
        pull_model(store, "wide", cfg=cfg, transfers=hub)
    assert "no space left on device" in str(e.value) and e.value.status == 507
    hub.wait_idle(10)
    assert store.list_models() == []
    assert not (small_disk / "manifests").exists()
    # What stays is whole (verified) blobs and resumable partials; no half-written blob.
    layer = wire_shard(registry.url, "wide")
    for p in store.blobs.root.iterdir():
        assert len(p.name) == 71 or p.name.startswith("sha256-") and "-partial" in p.name, p.name
        assert layer.local.digest[7:] not in p.name


def test_writes_need_the_token(source, tmp_path):
    with ThreadRegistry(tmp_path / "registry", token="s3cret") as reg:
        cfg = make_cfg(tmp_path / "models", reg.url)
        with pytest.raises(RegistryError) as e:
            push_model(source, "tiny", cfg=cfg, options=OPTIONS)
        assert "FREETOKEN_REGISTRY_TOKEN" in str(e.value) and e.value.status == 401
        push_model(source, "tiny", cfg=make_cfg(tmp_path / "models", reg.url,
                                               FREETOKEN_REGISTRY_TOKEN="s3cret"), options=OPTIONS)
        # Reads are open: a pull needs no token.
        pull_model(Store(tmp_path / "models"), "tiny", cfg=cfg)
    same_files(source, Store(tmp_path / "models"), "tiny")


def test_a_new_version_frees_the_old_layers(source, registry, cfg, hub, dest):
    publish(source, cfg, "tiny", "wide")
    pull_model(dest, "wide", cfg=cfg, transfers=hub)
    old = dest.resolve("wide").manifest.digests()
    # The registry's `wide` becomes what `tiny` is (a new version under the same tag).
    manifests = registry.root / "manifests/library"
    (manifests / "wide/latest").write_bytes((manifests / "tiny/latest").read_bytes())
    events = []
    pull_model(dest, "wide", cfg=cfg, transfers=hub, progress=events.append)
    assert [e["status"] for e in events][-2:] == ["removing unused layers", "success"]
    new = dest.resolve("wide").manifest.digests()
    assert dest.blobs.digests() == new
    assert old - new and old & new  # the shard went; the shared tokenizer stayed


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


def test_resume_after_the_puller_is_killed(source, registry, cfg, hub, dest):
    publish(source, cfg, "wide")
    layer = wire_shard(registry.url, "wide")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", _PULLER, str(dest.root), registry.url],
                            stdout=subprocess.PIPE, text=True, cwd=root)
    assert proc.stdout is not None
    for line in proc.stdout:
        digest, completed = line.split()
        if digest == layer.digest and int(completed) > layer.size * 0.4:
            proc.kill()  # SIGKILL: no clean-up runs
            break
    proc.wait()
    assert dest.list_models() == []  # the manifest is written last
    done = sum(c for _, _, c in saved_parts(dest, layer))
    assert 0 < done < layer.size
    counted = CountingTransport()
    pull_model(dest, "wide", cfg=cfg, transfers=hub, transport=counted)
    same_files(source, dest, "wide")
    assert counted.bytes[layer.digest] == layer.size - done


def test_prune_drops_what_an_interrupted_pull_left(source, registry, cfg, hub, dest):
    publish(source, cfg, "tiny")
    pull_model(dest, "tiny", cfg=cfg, transfers=hub)
    blobs = dest.blobs.root
    for leftover in ("sha256-" + "a" * 64 + "-partial", "sha256-" + "a" * 64 + "-partial-0",
                     "sha256-" + "a" * 64 + "-partial-0.tmp", "push-x1", "partial-x2"):
        (blobs / leftover).write_bytes(b"x")
    (dest.root / ".convert-x3").mkdir()
    kept = dest.blobs.digests()
    dest.prune()
    assert dest.blobs.digests() == kept == dest.resolve("tiny").manifest.digests()
    assert len(list(blobs.iterdir())) == len(kept) and not (dest.root / ".convert-x3").exists()


def test_a_pull_in_progress_keeps_its_blobs_from_delete(source, registry, cfg, hub, dest):
    publish(source, cfg, "tiny")
    pull_model(dest, "tiny", cfg=cfg, transfers=hub)
    digests = dest.resolve("tiny").manifest.digests()
    with dest.pin(digests):  # as a pull of another model sharing these blobs does
        dest.delete("tiny")
        assert all(dest.blobs.has(d) for d in digests)
    assert dest.referenced() == set()
