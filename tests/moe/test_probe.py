"""A first load's bandwidth probe: the CPU kernel and PCIe timed on the model's own banks,
kept as the machine's profile, and read back as measured by later loads."""

from __future__ import annotations

import pytest
import torch

from freetoken.models.base import ExpertSpec
from freetoken.moe import probe, profile
from freetoken.moe.banks import HostBanks

E, H, I = 16, 256, 128


def banks() -> HostBanks:
    g = torch.Generator().manual_seed(0)
    raw = {}
    for layer in range(2):
        raw[(layer, "gate_up")] = torch.randn((E, 2 * I, H), generator=g).to(torch.bfloat16)
        raw[(layer, "down")] = torch.randn((E, H, I), generator=g).to(torch.bfloat16)
    return HostBanks(raw, torch.bfloat16, pin=False, spec=ExpertSpec(H, I))


def test_the_cpu_kernel_is_timed_on_the_models_banks():
    assert probe.cpu_gbps(banks(), seconds=0.05) > 0


def test_a_stored_probe_reads_back_as_measured_for_its_format_only(tmp_path):
    assert profile.bandwidths(tmp_path, "q4_k")[2] is False
    probe.store(tmp_path, "q4_k", 50.0, 30.0)
    assert profile.bandwidths(tmp_path, "q4_k") == (50e9, 30e9, True)
    assert profile.bandwidths(tmp_path, "")[2] is False  # BF16's own is not known yet
    probe.store(tmp_path, "", 52.0, 60.0)
    assert profile.bandwidths(tmp_path, "") == (52e9, 60e9, True)
    assert profile.bandwidths(tmp_path, "q4_k") == (52e9, 30e9, True)
    assert profile.load(tmp_path)["source"] == "load"


def test_bench_bws_profile_is_kept_and_added_to(tmp_path):
    profile.save(tmp_path, {"pcie_gbps": 55.0, "cpu_expert_gbps": 80.0, "dram_read_gbps": 73})
    probe.store(tmp_path, "mxfp4", 54.0, 40.0)
    known = profile.load(tmp_path)
    assert known["dram_read_gbps"] == 73 and known["cpu_expert_gbps"] == 80.0
    assert known["cpu_expert_gbps_mxfp4"] == 40.0 and "source" not in known


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_first_load_on_a_gpu_times_both_ways_and_keeps_them(tmp_path):
    from freetoken.moe import setup

    host = banks()  # the banks' tensors; the backend pins its own
    raw = {(layer, b): t for layer, bk in host.banks.items() for b, t in bk.items()}
    placement = setup.Placement("adaptive", 0, tmp_path, slots=E)
    backend = setup.build(raw, host.spec, torch.device("cuda"), torch.bfloat16, placement)
    b_p, b_h, measured = profile.bandwidths(tmp_path, "")
    assert measured and b_p > 1e9 and b_h > 1e8
    assert backend.split.pcie.per_expert == pytest.approx(host.expert_bytes / b_p, rel=1e-6)


def test_the_fetch_kernels_rate_reads_back_from_bench_bws_profile(tmp_path):
    assert profile.fetch_gbps(tmp_path) is None
    fetch = {1: {"gbps": 32.6, "us_per_call": 290.0}, 8: {"gbps": 34.7, "us_per_call": 2170.0}}
    profile.save(tmp_path, {"pcie_gbps": 51.8, "cpu_expert_gbps": 98.6, "fetch": fetch})
    assert profile.fetch_gbps(tmp_path) == 32.6  # one expert a call, as a step's misses come
    probe.store(tmp_path, "q4_k", 50.0, 80.0)  # a load's probe keeps it
    assert profile.fetch_gbps(tmp_path) == 32.6


def test_a_cpu_model_prices_no_fetch_kernel(tmp_path):
    from freetoken.moe import setup

    profile.save(tmp_path, {"pcie_gbps": 51.8, "cpu_expert_gbps": 98.6, "fetch": {1: {"gbps": 9}}})
    host = banks()
    raw = {(layer, b): t for layer, bk in host.banks.items() for b, t in bk.items()}
    placement = setup.Placement("adaptive", 0, tmp_path, slots=E)
    backend = setup.build(raw, host.spec, torch.device("cpu"), torch.float32, placement)
    assert backend.split.fetch_s == 0 and backend.stats()["fetch_cost_ms"] is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_placements_price_a_miss_at_the_fetch_kernels_rate(tmp_path):
    from freetoken.moe import setup

    fetch = {1: {"gbps": 10.0}}
    profile.save(tmp_path, {"pcie_gbps": 50.0, "cpu_expert_gbps": 90.0, "fetch": fetch})
    host = banks()
    raw = {(layer, b): t for layer, bk in host.banks.items() for b, t in bk.items()}
    placement = setup.Placement("adaptive", 0, tmp_path, slots=E)
    backend = setup.build(raw, host.spec, torch.device("cuda"), torch.bfloat16, placement)
    per_miss = host.expert_bytes / 10e9
    assert backend.split.fetch_s == pytest.approx(per_miss)
    assert backend.split.pcie.per_expert == pytest.approx(host.expert_bytes / 50e9)  # the bound's
    assert backend.stats()["fetch_cost_ms"] == pytest.approx(per_miss * 1e3)
