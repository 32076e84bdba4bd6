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
    real = fetchbw.moe_gpu.fetch_experts

    def spy(src, dst, experts, slots):
        real(src, dst, experts, slots)
        copied.append(experts.numel())
        for r, e in enumerate(experts.tolist()):  # each slot holds its expert's bytes
            assert torch.equal(dst[r].cpu(), src[e])

    monkeypatch.setattr(fetchbw.moe_gpu, "fetch_experts", spy)
    b = banks(device == "cuda")
    out = fetchbw.measure_fetch(b, 0.05, routes, device)
    calls = len(copied) // 2  # two banks a call
    assert calls > 0 and set(copied) == {routes}
    assert out["us_per_call"] > 0
    # the rate is the bytes moved over the time the calls took
    assert out["gbps"] * 1e9 * out["us_per_call"] * 1e-6 == pytest.approx(routes * b.expert_bytes)


def test_rows_give_each_call_size_against_b_p():
    rows = fetchbw.rows(
        {1: {"gbps": 26.0, "us_per_call": 363.0}, 8: {"gbps": 39.0, "us_per_call": 1936.0}}, 52.0
    )
    assert [r["path"] for r in rows] == [
        "PCIe fetch kernel, 1 expert a call",
        "PCIe fetch kernel, 8 experts a call",
    ]
    assert rows[0]["note"] == "363 us a call; 0.50x B_P" and rows[1]["gbps"] == 39.0
