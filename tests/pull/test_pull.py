"""Pull and push against the real registry on loopback."""

from __future__ import annotations

import importlib
import threading
from pathlib import Path

import httpx
import pytest
import zstandard

from freetoken.pull import RegistryError, pull_model, push_model
from freetoken.pull.frames import decode_frame
from freetoken.pull.wire import ZSTD, WireManifest
from freetoken.store import Store
from tests.pull.conftest import OPTIONS, make_cfg, publish, shard
from tests.pull.harness import CountingTransport, ThreadRegistry


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
        b.digest: b.size for b in wire.blobs()
    }
    assert stats.fetched_bytes == stats.total_bytes == sum(b.size for b in wire.blobs())
    # Only the uncompressed files are in the store, and nothing else.
    names = sorted(p.name for p in dest.blobs.root.iterdir())
    assert names == sorted(d.replace(":", "-") for d in dest.resolve("wide").manifest.digests())


def test_large_files_travel_compressed_in_frames(source, registry, cfg):
    publish(source, cfg, "wide")
    layer = wire_shard(registry.url, "wide")
    assert layer.media_type == ZSTD
    assert layer.uncompressed_digest == shard(source, "wide")
    assert layer.size < layer.uncompressed_size
    # One frame per 256 KiB of the file (the tests' frame size), each decodable alone.
    blob = (registry.root / "blobs" / layer.digest.replace(":", "-")).read_bytes()
    data = source.blobs.read_bytes(layer.uncompressed_digest)
    assert layer.framed and layer.frame_size == OPTIONS.frame_size
    assert len(layer.frames) == -(-len(data) // OPTIONS.frame_size) > 4
    k = len(layer.frames) // 2
    at = sum(layer.frames[:k])
    frame = bytearray(OPTIONS.frame_size)
    decode_frame(memoryview(blob)[at : at + layer.frames[k]], OPTIONS.frame_size, memoryview(frame))
    assert frame == data[k * OPTIONS.frame_size : (k + 1) * OPTIONS.frame_size]
    # Any zstd reader still gets the whole file from the blob.
    reader = zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True)
    assert reader.read() == data
    small = [x for x in wire_manifest(registry.url, "wide").layers if x.name != "ftw-00000.bin"]
    assert all(x.media_type != ZSTD for x in small)


def test_a_second_pull_fetches_nothing(source, registry, cfg, hub, dest):
    publish(source, cfg, "tiny")
    pull_model(dest, "tiny", cfg=cfg, transfers=hub)
    counted = CountingTransport()
    events = []
    stats = pull_model(
        dest, "tiny", cfg=cfg, transfers=hub, transport=counted, progress=events.append
    )
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
    stats = push_model(
        source, "wide", cfg=cfg, options=OPTIONS, transport=counted, progress=events.append
    )
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
            results.append(
                pull_model(
                    dest, "wide", cfg=cfg, transfers=hub, transport=counted, progress=progress
                )
            )
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


def test_writes_need_the_token(source, tmp_path):
    with ThreadRegistry(tmp_path / "registry", token="s3cret") as reg:
        cfg = make_cfg(tmp_path / "models", reg.url)
        with pytest.raises(RegistryError) as e:
            push_model(source, "tiny", cfg=cfg, options=OPTIONS)
        assert "FREETOKEN_REGISTRY_TOKEN" in str(e.value) and e.value.status == 401
        push_model(
            source,
            "tiny",
            cfg=make_cfg(tmp_path / "models", reg.url, FREETOKEN_REGISTRY_TOKEN="s3cret"),
            options=OPTIONS,
        )
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


def test_prune_keeps_what_a_pull_can_resume_and_drops_the_rest(source, registry, cfg, hub, dest):
    publish(source, cfg, "tiny")
    pull_model(dest, "tiny", cfg=cfg, transfers=hub)
    blobs = dest.blobs.root
    resumable = (  # a partial file with saved state: a later pull goes on from it
        "sha256-" + "a" * 64 + "-partial",
        "sha256-" + "a" * 64 + "-partial-0",
        "sha256-" + "a" * 64 + "-partial-verified",
    )
    leftovers = (
        "sha256-" + "a" * 64 + "-partial-0.tmp",  # a state being written when the kill came
        "sha256-" + "b" * 64 + "-partial",  # no state: nothing in it is known to be good
        "sha256-" + "c" * 64 + "-partial-3",  # a state without its file
        "push-x1",
        "partial-x2",
    )
    for name in resumable + leftovers:
        (blobs / name).write_bytes(b"x")
    (dest.root / ".convert-x3").mkdir()
    kept = dest.blobs.digests()
    removed = dest.prune()
    assert dest.blobs.digests() == kept == dest.resolve("tiny").manifest.digests()
    assert set(leftovers) <= set(removed) and all((blobs / n).exists() for n in resumable)
    assert len(list(blobs.iterdir())) == len(kept) + len(resumable)
    assert not (dest.root / ".convert-x3").exists()


def test_a_pull_in_progress_keeps_its_blobs_from_delete(source, registry, cfg, hub, dest):
    publish(source, cfg, "tiny")
    pull_model(dest, "tiny", cfg=cfg, transfers=hub)
    digests = dest.resolve("tiny").manifest.digests()
    with dest.pin(digests):  # as a pull of another model sharing these blobs does
        dest.delete("tiny")
        assert all(dest.blobs.has(d) for d in digests)
    assert dest.referenced() == set()
