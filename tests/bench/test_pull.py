"""`freetoken bench pull` end to end on a small file: a registry process on loopback, a
push, raw fetches, a pull and a resumed one."""

from __future__ import annotations

import json

import pytest

from freetoken.bench import pull as bench


@pytest.mark.parametrize("weights", [False, True])
def test_bench_pull_measures_every_path(capsys, weights):
    # An odd size: the weights payload must still be exactly the bytes its manifest says.
    args = ["--gib", "0.01", "--streams", "4", "--json"] + (["--weights"] if weights else [])
    bench.main(args)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    rows = {r["path"]: r for r in map(json.loads, lines)}
    assert set(rows) == {
        "raw ranged copy",
        "raw, bytes dropped",
        "freetoken pull",
        "resume after 50%",
    }
    assert all(r["weights"] is weights and r["streams"] == 4 for r in rows.values())
    assert rows["freetoken pull"]["ratio_to_raw"] > 0
    resume = rows["resume after 50%"]
    # A small file of few frames may be whole before the pull can be stopped half way.
    assert 0 <= resume["refetched_share"] < 1 and resume["vs_full_pull_time"] > 0
