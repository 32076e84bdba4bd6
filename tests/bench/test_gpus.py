"""`freetoken bench gpus` end to end with CPU ranks: the model is written as FTW, loaded the
runner's way for one process and for two ranks, and every configuration decodes and prefills."""

from __future__ import annotations

import json

from freetoken.bench import gpus as bench
from freetoken.bench.synthmodel import SHAPES


def test_bench_gpus_runs_every_configuration(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_CACHE_DIR", str(tmp_path / "cache"))  # the profile it saves
    bench.main(
        [
            "--model",
            "tiny",
            "--cpu-ranks",
            "2",
            "--dir",
            str(tmp_path),
            "--prefill",
            "40",
            "--tokens",
            "6",
            "--warmup",
            "2",
            "--settle",
            "2",
            "--bw-seconds",
            "0.2",
            "--json",
        ]
    )
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    rows = [json.loads(x) for x in lines]
    assert {(r["config"], r["routing"]) for r in rows} == {
        (c, m)
        for c in ("1 x 24 GiB", "1 x 48 GiB", "2 x 24 GiB")
        for m in ("uniform", "trace", "prefill 40")
    }
    tiny = SHAPES["tiny"]
    for r in rows:
        assert r["tok_s"] > 0
        if not r["routing"].startswith("prefill"):
            # no GPU cache: every routed expert of every layer is a miss, on whichever rank owns it
            assert r["misses_per_token"] == tiny["num_hidden_layers"] * tiny["num_experts_per_tok"]
            assert 0 < r["ratio_to_bound"]
    assert not (tmp_path / "tiny").exists()  # the model is removed unless --keep
