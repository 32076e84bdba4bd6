"""What the served benchmarks share: the machine's bandwidths measured before a server of
their own starts, where only a load's probe measured them."""

from __future__ import annotations

import torch

from freetoken import config
from freetoken.bench import bw, common, served
from freetoken.moe import profile


def test_bandwidths_are_measured_where_only_a_loads_probe_timed_them(tmp_path, monkeypatch):
    env = [f"FREETOKEN_CACHE_DIR={tmp_path}"]
    cfg = config.load(config.child_environment(dict(e.split("=", 1) for e in env)))
    cache_dir = cfg.cache_dir
    assert cache_dir == tmp_path  # the directory the server's runners read
    runs = []

    def run(seconds, gib, formats):
        runs.append(formats)
        per_format = {f: {"gbps": 81.8} for f in formats}
        return bw.with_formats({"pcie_gbps": 50.2, "cpu_expert_gbps": 98.6}, per_format)

    monkeypatch.setattr(bw, "run", run)
    # no GPU here to name
    monkeypatch.setattr(profile, "machine_key", lambda: "this-machine")
    monkeypatch.setattr(common, "machine", lambda: {"gpu": "a GPU"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not served.measure_bandwidths(env)  # no GPU: no bound to measure for
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    profile.save(cache_dir, {"source": "load", "pcie_gbps": 29.8, "cpu_expert_gbps_q4_k": 44.2})
    assert not profile.from_bench(cache_dir)
    assert served.measure_bandwidths(env)
    assert runs and "q4_k" in runs[0]  # every block format's B_H: a packed model reads its own
    assert profile.from_bench(cache_dir)
    assert profile.bandwidths(cache_dir, "q4_k")[:2] == (50.2e9, 81.8e9)
    assert not served.measure_bandwidths(env)  # measured once: kept
    assert len(runs) == 1


def test_placements_are_forgotten_where_the_servers_runners_keep_them(
    tmp_path, monkeypatch, capsys
):
    from freetoken.moe.learned import Learned

    monkeypatch.setattr(profile, "machine_key", lambda: "this-machine")
    env = [f"FREETOKEN_CACHE_DIR={tmp_path}"]
    store = Learned(tmp_path, "12x128x9437184-r1")
    store.save(1152, {"mode": "layers", "share": 0.5, "step_ms": {}, "batch": 1})
    served.forget_placements(env)
    assert store.load(1152) is None
    assert "dropped the placements" in capsys.readouterr().out
    served.forget_placements(env)  # nothing left: nothing said
    assert capsys.readouterr().out == ""


def test_only_the_models_formats_are_measured_and_a_missing_one_is_added(tmp_path, monkeypatch):
    """A fresh machine measures B_P, BF16's B_H and the served model's block formats only;
    a later model of another format adds its B_H to the profile, the rest kept."""
    env = [f"FREETOKEN_CACHE_DIR={tmp_path}"]
    runs, packed = [], []

    def run(seconds, gib, formats):
        runs.append(formats)
        return bw.with_formats(
            {"pcie_gbps": 50.2, "cpu_expert_gbps": 98.6},
            {f: {"gbps": 80.0} for f in formats},
        )

    def measure_formats(formats, seconds, gib, bf16_gbps):
        packed.append((formats, bf16_gbps))
        return {f: {"gbps": 70.0} for f in formats}

    monkeypatch.setattr(bw, "run", run)
    monkeypatch.setattr(bw, "measure_formats", measure_formats)
    monkeypatch.setattr(profile, "machine_key", lambda: "this-machine")
    monkeypatch.setattr(common, "machine", lambda: {"gpu": "a GPU"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert served.measure_bandwidths(env, ["q4_k", "q6_k"])
    assert runs == [["q4_k", "q6_k"]] and not packed
    assert not served.measure_bandwidths(env, ["q4_k"])  # known
    assert not served.measure_bandwidths(env, [])  # a float model: BF16's, known
    assert served.measure_bandwidths(env, ["q6_k", "q8_0"])
    assert packed == [(["q8_0"], 98.6)] and len(runs) == 1
    cache_dir = served.runner_config(env).cache_dir
    assert profile.bandwidths(cache_dir, "q8_0")[:2] == (50.2e9, 70e9)
    assert profile.bandwidths(cache_dir, "q4_k")[:2] == (50.2e9, 80e9)
    assert set(profile.load(cache_dir)["formats"]) == {"q4_k", "q6_k", "q8_0"}


def test_a_models_expert_formats_are_read_from_its_index(tmp_path):
    """The synthetic shape's experts at q4_K_M: q4_k and q6_k banks (the down matrices of
    some layers take Q6_K); at BF16 none."""
    from freetoken.store import Store

    store = Store(tmp_path / "store")
    quantized = served.checkpoint("tiny", 2, tmp_path, quantize="q4_K_M")
    served.ensure_model(store, "tiny-q", quantized)
    formats = served.expert_formats(store, "tiny-q")
    assert formats and set(formats) <= {"q4_k", "q6_k", "q5_k", "q8_0"} and "q4_k" in formats
    plain = served.checkpoint("tiny", 1, tmp_path, "float32")
    served.ensure_model(store, "tiny-f", plain)
    assert served.expert_formats(store, "tiny-f") == []


def test_a_rows_settings_are_the_servers_environment_and_its_overrides(monkeypatch, capsys):
    """What the server of its own ran with goes into the record: this process's FreeToken
    settings, then --env's, but not where it listens or its store (the bench's own)."""
    monkeypatch.setenv("FREETOKEN_LANE_SPIN_MS", "30")
    monkeypatch.setenv("FREETOKEN_HOST", "127.0.0.1:1")
    monkeypatch.setenv("UNRELATED", "x")
    got = served.server_settings(["FREETOKEN_EXPERT_SLOTS=1152", "FREETOKEN_LANE_SPIN_MS=2"])
    assert got["FREETOKEN_EXPERT_SLOTS"] == "1152" and got["FREETOKEN_LANE_SPIN_MS"] == "2"
    assert "FREETOKEN_HOST" not in got and "UNRELATED" not in got
    head = common.header("serve") | {"settings": {"FREETOKEN_EXPERT_SLOTS": "1152"}}
    common.emit([{"a": 1}], [("a", "a")], False, head)
    assert "# settings: FREETOKEN_EXPERT_SLOTS=1152" in capsys.readouterr().out


def test_a_run_prints_the_decisions_its_server_logged(tmp_path, capsys):
    """Only the lines this run's server appended, from where they begin."""
    from freetoken.bench.served import print_decisions

    log = tmp_path / "server.log"
    earlier = "12:00 INFO runner 1: runner INFO adaptive: 3 misses of 96 routes: device\n"
    log.write_text(earlier)
    start = log.stat().st_size
    with open(log, "a") as f:
        f.write("12:01 INFO freetoken.server: loaded\n")
        f.write("12:02 INFO runner 2: runner INFO adaptive: gate: 0.88 misses a step: no\n")
    print_decisions(log, start)
    assert capsys.readouterr().out == "# adaptive: gate: 0.88 misses a step: no\n"
