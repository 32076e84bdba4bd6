"""`freetoken bench create`'s measurement on the tiny model: both paths through a real server,
the store checked to hold the FTW only."""

from __future__ import annotations

import shutil

import pytest

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


def test_the_stores_disk_counts_what_is_written(tmp_path):
    """The block device's own counters (where the filesystem has one) see a file written and
    fsynced; their columns say how busy the disk was and how fast it wrote while busy."""
    before = bench.disk_counters(tmp_path)
    if before is None:
        pytest.skip("this filesystem has no block device of its own")
    bench.write_seconds(tmp_path, 8 << 20)
    after = bench.disk_counters(tmp_path)
    assert after[0] >= before[0] and after[1] - before[1] >= 8 << 20
    cols = bench._disk_columns((1.0, 0), (3.0, 4_000_000_000), seconds=4.0, rate=1e9)
    assert cols == {"disk_busy": 0.5, "disk_written_mb": 4000.0, "busy_rate_over_write": 2.0}
    assert bench._disk_columns(None, after, 1.0, 1e9) == {}
