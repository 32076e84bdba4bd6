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
