"""Create checks an FTW model whole before it is listed (issue 22: a truncated shard, or an
index with absurd sizes, was stored, and the model's first use failed with a 500)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from freetoken.store import CreateError
from freetoken.store.ftwcheck import FTWInvalid, check_ftw

from .conftest import create

ALIGN = 4096


def _index(**changes) -> dict:
    index = {
        "format": "freetoken-ftw",
        "version": 1,
        "align": ALIGN,
        "total_bytes": 3 * ALIGN,
        "shards": [
            {"file": "ftw-00000.bin", "offset": 0, "nbytes": 2 * ALIGN},
            {"file": "ftw-00001.bin", "offset": 2 * ALIGN, "nbytes": ALIGN},
        ],
        "tensors": [{"name": "w", "shape": [4, 8], "offset": 2 * ALIGN, "nbytes": 128}],
    }
    return {**index, **changes}


SIZES = {"ftw-00000.bin": 2 * ALIGN, "ftw-00001.bin": ALIGN}


def test_a_whole_ftw_passes():
    check_ftw(_index(), SIZES.get)


@pytest.mark.parametrize(
    "index, sizes, message",
    [
        (_index(), {**SIZES, "ftw-00001.bin": 100}, "has 100 bytes, the index says 4096"),
        (_index(), {"ftw-00000.bin": 2 * ALIGN}, "shard ftw-00001.bin is missing"),
        (_index(total_bytes=10**15), SIZES, "total_bytes says 1000000000000000"),
        (_index(version=7), SIZES, "not freetoken-ftw version 1"),
        (_index(shards=[]), SIZES, "lists no shards"),
        (_index(shards=[{"file": "ftw-00000.bin", "offset": 0, "nbytes": -1}]), SIZES, "whole"),
        (
            _index(shards=[{"file": "ftw-00000.bin", "offset": 5, "nbytes": ALIGN}]),
            SIZES,
            "where the shards before it end at 0",
        ),
        (
            _index(tensors=[{"name": "w", "shape": [2], "offset": 3 * ALIGN, "nbytes": 1}]),
            SIZES,
            "past the 12288 bytes stored",
        ),
        (_index(tensors=[{"name": "w", "shape": "big", "offset": 0, "nbytes": 1}]), SIZES, "shape"),
        ([1, 2], SIZES, "not a JSON object"),
    ],
)
def test_a_broken_ftw_is_refused(index, sizes, message):
    with pytest.raises(FTWInvalid, match=message):
        check_ftw(index, sizes.get)


@pytest.fixture
def ftw_dir(store, model_dir, tmp_path) -> Path:
    """An FTW model directory, as `freetoken create` would upload one."""
    create(store, "made", from_=str(model_dir))
    out = tmp_path / "ftw"
    out.mkdir()
    for name, digest in store.resolve("made").files.items():
        shutil.copyfile(store.blobs.path(digest), out / name)
    return out


def test_create_from_an_ftw_directory_checks_it_before_listing(store, ftw_dir):
    create(store, "again", from_=str(ftw_dir))
    assert store.resolve("again").info["model_format"] == "ftw"

    shard = ftw_dir / "ftw-00000.bin"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - ALIGN)
    with pytest.raises(CreateError, match=f"has {size - ALIGN} bytes, the index says {size}"):
        create(store, "truncated", from_=str(ftw_dir))

    index = json.loads((ftw_dir / "ftw.json").read_text())
    index["shards"][0]["nbytes"] = index["total_bytes"] = 1 << 60
    (ftw_dir / "ftw.json").write_text(json.dumps(index))
    with pytest.raises(CreateError, match="ftw.json: shard ftw-00000.bin has"):
        create(store, "absurd", from_=str(ftw_dir))
    names = {m["name"] for m in store.list_models()}
    assert names == {"made:latest", "again:latest"}


def test_create_from_uploaded_ftw_files_checks_them(store, ftw_dir):
    files = {p.name: store.blobs.put_file(p)[0] for p in ftw_dir.iterdir()}
    short = ftw_dir / "ftw-00000.bin"
    data = short.read_bytes()[:-ALIGN]
    files["ftw-00000.bin"] = store.blobs.put_bytes(data)
    with pytest.raises(CreateError, match="the uploaded files: ftw.json: shard ftw-00000.bin"):
        create(store, "up", files=files)
