"""`freetoken bench bw`'s lane rows (bench/lanebw.py)."""

from __future__ import annotations

from functools import partial

import pytest

from freetoken.bench import bw, lanebw


def test_the_lane_is_timed_beside_the_kernel_called_directly(monkeypatch):
    """`bench bw`'s lane rows: the kernel through the lane and called directly at a split's
    routes, alone and beside a busy process, as served and on every core."""
    from freetoken.kernels import cpu as cpu_kernel

    if cpu_kernel.extension() is None:
        pytest.skip("needs the compiled CPU kernel")
    monkeypatch.setattr(bw, "E", 8)
    monkeypatch.setattr(bw, "H", 256)
    monkeypatch.setattr(bw, "I", 128)
    banks = bw.Banks(2, pin=False)
    r = lanebw.measure_lanes(banks, 0.05, partial(bw.measure_cpu, banks))
    gbps = [k for k in r if k.endswith("_gbps")]
    assert len(gbps) == 6 and all(r[k] > 0 for k in gbps)
    assert r["cores"] == len(cpu_kernel.physical_cpus()) >= r["lane_threads"] >= 1
    rows = lanebw.lane_rows(r, 1.0)
    assert len(rows) == 6 and all(row["gbps"] > 0 and "x" in row["note"] for row in rows)
