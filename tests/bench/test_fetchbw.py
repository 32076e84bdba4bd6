"""The fetch kernel's bandwidth row of bench bw: bytes counted per call, rows against B_P."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from freetoken.bench import fetchbw


@dataclass
class SmallBanks:
    layers: list[dict[str, torch.Tensor]]
    expert_bytes: int


def banks(device_pinned: bool) -> SmallBanks:
    layers = [{"gate_up": torch.randn(16, 8, 4), "down": torch.randn(16, 4, 4)} for _ in range(3)]
    if device_pinned:
        layers = [{n: b.pin_memory() for n, b in layer.items()} for layer in layers]
    return SmallBanks(layers, (8 * 4 + 4 * 4) * 4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("routes", [1, 4])
def test_every_call_moves_its_routes_experts(device, routes, monkeypatch):
    copied = []
    real = fetchbw.moe_gpu.fetch_banks

    def spy(pairs, experts, slots):
        real(pairs, experts, slots)
        copied.append((len(pairs), experts.numel()))
        for src, dst in pairs:  # each slot holds its expert's bytes
            for r, e in enumerate(experts.tolist()):
                assert torch.equal(dst[r].cpu(), src[e])

    monkeypatch.setattr(fetchbw.moe_gpu, "fetch_banks", spy)
    b = banks(device == "cuda")
    out = fetchbw.measure_fetch(b, 0.05, routes, device)
    assert copied and set(copied) == {(2, routes)}  # a layer's two banks a call
    assert out["us_per_call"] > 0
    # the rate is the bytes moved over the time the calls took
    assert out["gbps"] * 1e9 * out["us_per_call"] * 1e-6 == pytest.approx(routes * b.expert_bytes)


def test_an_idle_call_fetches_nothing(monkeypatch):
    """Every slot -1: the call is timed and no slot is written."""
    device = "cpu"
    seen = []
    real = fetchbw.moe_gpu.fetch_banks

    def spy(pairs, experts, slots):
        before = [dst.clone() for _, dst in pairs]
        real(pairs, experts, slots)
        seen.append(slots.tolist())
        # bits, not values: the slot is uninitialised memory and may hold NaNs
        unchanged = zip(before, pairs, strict=True)
        assert all(torch.equal(a.view(torch.uint8), d.view(torch.uint8)) for a, (_, d) in unchanged)

    monkeypatch.setattr(fetchbw.moe_gpu, "fetch_banks", spy)
    us = fetchbw.measure_idle(banks(False), 0.05, 8, device)
    assert us > 0 and seen and all(s == [-1] * 8 for s in seen)


@pytest.mark.gpu
def test_idle_calls_on_a_gpu_are_replayed_from_a_graph(monkeypatch):
    """On a GPU the idle calls are captured once and replayed, as a step's are: Python
    launches a graph's worth of calls twice (the compile, the capture), however long the
    timing runs."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    launched, real = [], fetchbw.moe_gpu.fetch_banks

    def count(pairs, experts, slots):
        launched.append(slots.numel())
        real(pairs, experts, slots)

    monkeypatch.setattr(fetchbw.moe_gpu, "fetch_banks", count)
    b = banks(True)
    us = fetchbw.measure_idle(b, 0.2, 8, "cuda")
    assert us > 0 and len(launched) == 1 + fetchbw.GRAPH_CALLS


def test_rows_give_each_call_size_against_b_p():
    rows = fetchbw.rows(
        {1: {"gbps": 26.0, "us_per_call": 363.0}, 8: {"gbps": 39.0, "us_per_call": 1936.0}},
        52.0,
        {8: 4.25},
    )
    assert [r["path"] for r in rows] == [
        "PCIe fetch kernel, 1 expert a call",
        "PCIe fetch kernel, 8 experts a call",
        "PCIe fetch kernel, 8 routes, nothing to fetch",
    ]
    assert rows[0]["note"] == "363 us a call; 0.50x B_P" and rows[1]["gbps"] == 39.0
    assert rows[2]["note"].startswith("4.2 us a call")
