"""`freetoken bench create`'s measurement on the tiny model: both paths through a real server,
the store checked to hold the FTW only."""

from __future__ import annotations

import shutil

from freetoken.bench import create as bench
from freetoken.bench import served
from tests.server.harness import tiny_model_dir


def test_one_create_of_each_path_is_timed_and_measured(tmp_path):
    source = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir(), source)
    store = tmp_path / "store"
    store.mkdir()
    with served.server(store, [], tmp_path / "server.log") as url:
        rows = [bench.one_create(url, store, source, in_place) for in_place in (True, False)]
    assert [r["path"] for r in rows] == ["in place", "upload"]
    for r in rows:
        assert r["format"] == "ftw" and r["seconds"] > 0 and r["ratio"] > 0
        assert r["read_s"] > 0 and r["write_s"] > 0
        # the uploaded checkpoint was collected: the store holds the FTW (and its manifest)
        assert 1.0 <= r["store_over_ftw"] < 1.05
    assert not any((store / "blobs").iterdir())  # each create was deleted after measuring
