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
        return {"pcie_gbps": 50.2, "cpu_expert_gbps": 98.6, "cpu_expert_gbps_q4_k": 81.8}

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
