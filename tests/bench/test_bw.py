"""`freetoken bench bw` per block format, at a tiny size: every format's CPU kernel reads
its packed banks, and the profile gains a B_H per format that runners use."""

from __future__ import annotations

import pytest
import torch

from freetoken import quant
from freetoken.bench import bw
from freetoken.kernels import cpu as cpu_kernel
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
        assert f["hot_gbps"] > 0, fmt  # the kernel's own speed, beside DRAM's
        if cpu_kernel.extension() is not None:  # each format through the lane as well
            assert f["lane_split_gbps"] > 0 and f["cpu_split_gbps"] > 0, fmt
    monkeypatch.setattr(profile, "machine_key", lambda: "test")
    profile.save(
        tmp_path, {"cpu_expert_gbps": 10.0, "pcie_gbps": 20.0, "cpu_expert_gbps_q4_k": 3.0}
    )
    assert profile.bandwidths(tmp_path, "q4_k") == (20e9, 3e9, True)
    assert profile.bandwidths(tmp_path, "mxfp4") == (20e9, 10e9, True)  # not measured: BF16's
    assert profile.bandwidths(tmp_path) == pytest.approx((20e9, 10e9, True))


def test_each_format_row_gives_its_fraction_of_dram_read():
    """The packed kernels' goal is a fraction of DRAM read, so each format's row states it."""
    fmt = {
        "gbps": 20.0,
        "experts_per_s": 7000.0,
        "vs_bf16": 2.9,
        "exact_gbps": 6.0,
        "hot_gbps": 40.0,
        "by_threads": {},
    }
    r = {
        "cpu_expert_gbps": 24.0,
        "torch_cpu_expert_gbps": 12.0,
        "dram_read_gbps": 25.0,
        "cpu_kernel": "avx512-bf16",
        "formats": {"q4_k": fmt},
        "by_threads": {},
    }
    [row] = [row for row in bw.table_rows(r) if row["path"] == "CPU expert kernel, q4_k"]
    assert row["gbps"] == 20.0 and row["note"].startswith("80% of DRAM read, 7000 experts/s")
    assert row["note"].endswith("40.0 GB/s on 8 experts in cache")


def test_a_thread_sweep_measures_every_kernel_at_every_count(monkeypatch):
    """`--threads 1,2`: BF16 and each format at both counts, with rows against DRAM and
    against one thread; torch's own thread count is put back."""
    monkeypatch.setattr(bw, "E", 8)
    monkeypatch.setattr(bw, "H", 256)
    monkeypatch.setattr(bw, "I", 256)
    monkeypatch.setattr(bw, "measure_dram", lambda seconds: 10.0)
    before = torch.get_num_threads()
    r = bw.run(0.05, 0.001, ["q4_k", "q8_0"], threads=[1, 2])
    assert torch.get_num_threads() == before
    for by in (
        r["by_threads"],
        r["formats"]["q4_k"]["by_threads"],
        r["formats"]["q8_0"]["by_threads"],
    ):
        assert sorted(by) == [1, 2] and all(g > 0 for g in by.values())
    rows = bw.thread_rows(r)
    assert [row["path"] for row in rows] == [
        f"CPU expert kernel, {k}, {n} threads" for k in ("BF16", "q4_k", "q8_0") for n in (1, 2)
    ]
    one = rows[0]["gbps"]
    assert (
        rows[1]["note"]
        == f"{rows[1]['gbps'] / 10:.0%} of DRAM read, {rows[1]['gbps'] / one:.1f}x one thread's"
    )


def test_thread_counts_are_checked(capsys):
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            bw.main(["--threads", bad, "--no-save"])
        assert "--threads" in capsys.readouterr().err


def test_a_prefetch_sweep_measures_each_count_and_puts_the_default_back():
    """`--prefetch-bytes 0,8192`: each packed format's int8 kernel at each distance asked
    ahead, at the swept thread counts, with a row each; the kernel's own distance is restored."""
    from freetoken.kernels import cpu as cpu_kernel

    ext = cpu_kernel.extension()
    if ext is None:
        pytest.skip("needs the compiled CPU kernel")
    calls = []
    got = bw.by_prefetch([0, 8192], [1], lambda: calls.append(1) or 5.0)
    assert got == {0: {1: 5.0}, 8192: {1: 5.0}} and calls
    assert ext.quant_set_prefetch_bytes(4096) == 4096  # put back: the default
    assert bw.by_prefetch([], [1], lambda: 1.0) == {}
    r = {"formats": {"q4_k": {"gbps": 3.0, "by_prefetch": got, "by_threads": {}}}, "by_threads": {}}
    assert [row["path"] for row in bw.thread_rows(r)] == [
        "CPU expert kernel, q4_k, 1 threads, prefetch 0 bytes ahead",
        "CPU expert kernel, q4_k, 1 threads, prefetch 8192 bytes ahead",
    ]


def test_the_kernels_are_held_to_the_isa_asked_for(monkeypatch, capsys):
    """`--isa avx2`: every kernel called directly runs at that tier (a desktop CPU's view on
    a larger one), and the result says so; nothing is saved as the machine's profile."""
    from freetoken.kernels import cpu as cpu_kernel

    ext = cpu_kernel.extension()
    if ext is None or ext.cpu_tier() < cpu_kernel.TIERS.index("avx2"):
        pytest.skip("needs the compiled CPU kernel on a CPU with AVX2")
    monkeypatch.setattr(bw, "E", 8)
    monkeypatch.setattr(bw, "H", 256)
    monkeypatch.setattr(bw, "I", 256)
    monkeypatch.setattr(bw, "measure_dram", lambda seconds: 10.0)
    # the lane serves at the CPU's best tier: not what this test is about
    monkeypatch.setattr(bw.lanebw, "measure_lanes", lambda *a: {})
    monkeypatch.setattr(bw.lanebw, "measure_lane", lambda *a: 1.0)
    tiers, real = [], cpu_kernel.moe_experts

    def kernel(*args, isa=None, **kw):
        tiers.append(isa)
        return real(*args, isa=isa, **kw)

    monkeypatch.setattr(cpu_kernel, "moe_experts", kernel)
    r = bw.run(0.02, 0.001, ["q4_k"], isa="avx2")
    assert r["cpu_kernel"] == "avx2" and r["formats"]["q4_k"]["gbps"] > 0
    assert tiers and set(tiers) == {"avx2"}
    saved = []
    monkeypatch.setattr(bw.profile, "save", lambda *a: saved.append(a))
    monkeypatch.setattr(bw, "run", lambda *a: {k: v for k, v in r.items() if k != "lane"})
    bw.main(["--isa", "avx2"])
    assert not saved and "avx2" in capsys.readouterr().out
