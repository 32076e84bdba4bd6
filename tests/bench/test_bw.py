"""`freetoken bench bw` per block format, at a tiny size: every format's CPU kernel reads
its packed banks, and the profile gains a B_H per format that runners use."""

from __future__ import annotations

import pytest

from freetoken import quant
from freetoken.bench import bw
from freetoken.moe import profile


def test_every_format_is_measured_against_bf16(monkeypatch, tmp_path):
    monkeypatch.setattr(bw, "E", 8)
    monkeypatch.setattr(bw, "H", 256)
    monkeypatch.setattr(bw, "I", 256)
    formats = list(quant.FORMATS)
    r = bw.measure_formats(formats, 0.05, 0.001, bf16_gbps=1.0)
    assert set(r) == set(formats)
    for fmt, f in r.items():
        assert f["gbps"] > 0 and f["experts_per_s"] > 0 and f["vs_bf16"] > 0, fmt
    monkeypatch.setattr(profile, "machine_key", lambda: "test")
    profile.save(
        tmp_path, {"cpu_expert_gbps": 10.0, "pcie_gbps": 20.0, "cpu_expert_gbps_q4_k": 3.0}
    )
    assert profile.bandwidths(tmp_path, "q4_k") == (20e9, 3e9, True)
    assert profile.bandwidths(tmp_path, "mxfp4") == (20e9, 10e9, True)  # not measured: BF16's
    assert profile.bandwidths(tmp_path) == pytest.approx((20e9, 10e9, True))


def test_the_lane_is_timed_beside_the_kernel_called_directly(monkeypatch):
    """`bench bw`'s lane rows: the kernel through the lane and called directly at a split's
    routes, alone and beside a busy process, as served and on every core."""
    from freetoken.kernels import cpu as cpu_kernel

    if cpu_kernel.extension() is None:
        pytest.skip("needs the compiled CPU kernel")
    monkeypatch.setattr(bw, "E", 8)
    monkeypatch.setattr(bw, "H", 256)
    monkeypatch.setattr(bw, "I", 128)
    r = bw.measure_lanes(bw.Banks(2, pin=False), 0.05)
    gbps = [k for k in r if k.endswith("_gbps")]
    assert len(gbps) == 6 and all(r[k] > 0 for k in gbps)
    assert r["cores"] == len(cpu_kernel.physical_cpus()) >= r["lane_threads"] >= 1
    rows = bw.lane_rows(r, 1.0)
    assert len(rows) == 6 and all(row["gbps"] > 0 and "x" in row["note"] for row in rows)
