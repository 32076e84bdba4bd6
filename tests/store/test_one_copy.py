"""One copy of each model: a converted source leaves the store unless something else holds
it, local files are read in place or linked in, and every blob is named by its bytes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from freetoken.ftw.convert import convert
from freetoken.store import CreateError, CreateSpec, FilesNotVisible, LocalFile, Store
from freetoken.store.blobs import digest_of_file

from .conftest import create


def upload(store: Store, model_dir: Path) -> dict[str, str]:
    """What a client's upload leaves: every file a blob, each claimed for its create."""
    files = {}
    for p in sorted(model_dir.iterdir()):
        if p.suffix != ".md":
            store.claim(files.setdefault(p.name, digest_of_file(p)))
            store.blobs.put_file(p)
    return files


def local(model_dir: Path) -> dict[str, LocalFile]:
    out = {}
    for p in sorted(model_dir.iterdir()):
        if p.suffix != ".md":
            st = p.stat()
            out[p.name] = LocalFile(str(p), st.st_size, st.st_mtime_ns)
    return out


def only_the_models(store: Store) -> None:
    """The store holds what its manifests name, and every blob is named by its bytes."""
    named = set().union(*(store.resolve(m["name"]).manifest.digests() for m in store.list_models()))
    assert store.blobs.digests() == named
    for digest in named:
        assert digest_of_file(store.blobs.path(digest)) == digest


def test_uploaded_sources_are_dropped_once_converted(store, model_dir):
    files = upload(store, model_dir)
    events = create(store, "up", files=files)
    assert events[-1] == {"status": "success"}
    assert "model.safetensors" not in store.resolve("up").files
    only_the_models(store)
    assert files["model.safetensors"] not in store.blobs.digests()


def test_a_source_another_model_uses_stays(store, model_dir, tmp_path):
    files = upload(store, model_dir)
    # a model that keeps the checkpoint's weights file as it is (an FTW model with an extra file)
    ftw = convert(model_dir, tmp_path / "ftw")
    (ftw / "model.safetensors").hardlink_to(model_dir / "model.safetensors")
    create(store, "keeps", from_=str(ftw))
    create(store, "up", files=files)
    assert files["model.safetensors"] in store.resolve("keeps").manifest.digests()
    only_the_models(store)


def test_a_source_claimed_for_another_create_or_pinned_by_a_pull_stays(store, model_dir):
    files = upload(store, model_dir)
    weights = files["model.safetensors"]  # the one source file FTW does not carry over
    store.claim(weights)  # another client uploaded the same file; its create is still to come
    create(store, "up", files=files)
    assert weights in store.blobs.digests()
    create(store, "again", files=files)  # the other client's create takes up its claim
    assert weights not in store.blobs.digests()
    only_the_models(store)
    files = upload(store, model_dir)
    with store.pin([weights]):  # a pull that fetched the same bytes holds them
        create(store, "third", files=files)
        assert weights in store.blobs.digests()
    assert store.collect([weights]) == [weights]  # released: the next clean-up takes it


def test_a_failed_create_keeps_the_uploads_for_a_retry(store, model_dir):
    files = upload(store, model_dir)
    with pytest.raises(CreateError, match="unknown parameter"):
        create(store, "x", files=files, parameters={"nonsense": 1})
    bad = {**files, "config.json": store.blobs.put_bytes(b'{"model_type": "qwen3_moe"}')}
    with pytest.raises(CreateError):
        create(store, "x", files=bad)
    assert set(files.values()) <= store.blobs.digests()


def test_local_files_are_read_in_place(store, model_dir):
    events = create(store, "here", local_files=local(model_dir))
    assert events[-1] == {"status": "success"} and "converting model" in str(events)
    assert "ftw.json" in store.resolve("here").files
    only_the_models(store)  # nothing of the checkpoint entered the store
    assert not any(p.name.startswith(".convert-") for p in store.root.iterdir())


@pytest.mark.parametrize(
    "change",
    [
        lambda f: LocalFile(f.path + ".gone", f.size, f.mtime_ns),
        lambda f: LocalFile(f.path, f.size + 1, f.mtime_ns),  # another file at that path
        lambda f: LocalFile(f.path, f.size, f.mtime_ns + 1),
    ],
)
def test_local_files_the_server_cannot_see_are_refused(store, model_dir, change):
    files = local(model_dir)
    files["config.json"] = change(files["config.json"])
    with pytest.raises(FilesNotVisible):
        store.plan_create(CreateSpec("x", local_files=files))
    files = {**local(model_dir), "config.json": LocalFile("rel/config.json", 1, 1)}
    with pytest.raises(CreateError, match="not an absolute path"):
        store.plan_create(CreateSpec("x", local_files=files))


def test_ftw_files_are_linked_not_copied(store, model_dir, tmp_path):
    ftw = convert(model_dir, tmp_path / "ftw")
    probe, how = store.blobs.stage_link(ftw / "config.json")  # what this filesystem does
    probe.unlink()
    events = create(store, "ftw", local_files=local(ftw))
    assert "converting model" not in str(events)
    view = store.resolve("ftw")
    for name, digest in view.files.items():
        # a reflink shares the bytes until either file changes; a hard link is the same file
        assert os.path.samefile(store.blobs.path(digest), ftw / name) == (how == "hard link")
    only_the_models(store)
    create(store, "ftw2", from_=str(ftw))  # the same files: every layer already there
    assert store.resolve("ftw2").files == view.files


def test_files_on_another_filesystem_are_copied(tmp_path, model_dir):
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs a second filesystem (/dev/shm)")
    ftw = convert(model_dir, tmp_path / "ftw")
    store = Store(Path(os.path.realpath(shm)) / f"freetoken-test-{os.getpid()}")
    try:
        create(store, "copied", local_files=local(ftw))
        for name, digest in store.resolve("copied").files.items():
            assert not os.path.samefile(store.blobs.path(digest), ftw / name)
        only_the_models(store)
    finally:
        shutil.rmtree(store.root, ignore_errors=True)
