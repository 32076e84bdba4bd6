"""Where a load with nothing learned starts (moe/locality.py): the placement the
bandwidths predict, and the locality check's verdict on device's first steps."""

from __future__ import annotations

import pytest

from freetoken.moe.policy import Mode


def test_prediction_prefers_both_paths_then_pcie():
    from freetoken.moe.locality import predict

    modes = (Mode.DEVICE, Mode.SPLIT, Mode.LAYERS)
    assert predict(modes, 48, 128, 2304, 0.18e-3, 0.11e-3) is Mode.SPLIT
    assert predict((Mode.DEVICE, Mode.LAYERS), 48, 128, 2304, 0.18e-3, 0.11e-3) is Mode.LAYERS
    assert predict((Mode.DEVICE, Mode.LAYERS), 48, 128, 2304, 0.05e-3, 0.5e-3) is Mode.DEVICE


def test_locality_keeps_device_unless_misses_come_near_uniform():
    from freetoken.moe.locality import NEAR_UNIFORM, LocalityCheck

    check = LocalityCheck(Mode.SPLIT, uniform_miss_rate=0.25)  # a cache of 75 % of experts
    assert check.verdict(hits=990, misses=10) is Mode.DEVICE  # a hot cache: keep what it holds
    near = int(1000 * 0.25 * NEAR_UNIFORM) + 1
    assert check.verdict(hits=1000 - near, misses=near) is Mode.SPLIT
    assert check.verdict(hits=0, misses=0) is Mode.DEVICE  # nothing seen: nothing to move for


def test_locality_takes_the_prediction_where_it_wins_even_at_uniforms_misses():
    """A small cache under routing with locality: device missed 0.44 of the routes where
    uniform routing misses 0.92 (8 GiB of the 48-layer shape), far from uniform, yet split,
    at a third of device's cost a miss, wins even if it missed as often as uniform."""
    from freetoken.moe.locality import LocalityCheck, miss_costs

    cost = miss_costs(9.44e6 / 51.3e9, 9.44e6 / 106.6e9)  # one BF16 expert over B_P and B_H
    ratio = cost[Mode.SPLIT] / cost[Mode.DEVICE]
    assert ratio == pytest.approx(51.3 / (51.3 + 106.6))
    small = LocalityCheck(Mode.SPLIT, uniform_miss_rate=0.92, cost_ratio=ratio)
    assert small.verdict(hits=56, misses=44) is Mode.SPLIT
    assert small.verdict(hits=80, misses=20) is Mode.DEVICE  # 0.20 · device's < 0.92 · split's
    alike = LocalityCheck(Mode.SPLIT, uniform_miss_rate=0.92, cost_ratio=0.95)
    assert alike.verdict(hits=56, misses=44) is Mode.DEVICE  # split barely cheaper: keep the cache
    hot = LocalityCheck(Mode.SPLIT, uniform_miss_rate=0.25, cost_ratio=ratio)
    assert hot.verdict(hits=984, misses=16) is Mode.DEVICE  # the 12-layer checkpoint at 75 %
