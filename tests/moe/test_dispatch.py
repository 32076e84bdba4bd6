from __future__ import annotations

import random

from freetoken.moe.dispatch import PathCost, Split, q_star


def test_q_star_balances_and_rounds_to_the_faster_side():
    assert q_star(0, 50, 50) == 0
    assert q_star(4, 50, 50) == 2
    assert q_star(4, 25, 75) == 1  # exact 1.0
    for m in range(1, 20):
        for bp, bh in [(55, 70), (12, 47), (50, 10)]:
            q = q_star(m, bp, bh)
            best = min(range(m + 1), key=lambda x: max(x / bp, (m - x) / bh))
            assert max(q / bp, (m - q) / bh) == max(best / bp, (m - best) / bh)


def test_split_with_zero_fixed_costs_is_q_star():
    s = Split.from_bandwidths(1000, 55e9, 70e9)
    for m in range(12):
        assert s.choose(m) == q_star(m, 55e9, 70e9)


def test_online_fit_recovers_fixed_and_per_expert_costs():
    rng = random.Random(0)
    c = PathCost(per_expert=1e-3)  # a wrong prior
    for _ in range(300):
        n = rng.randint(1, 8)
        c.observe(n, 0.4e-3 + n * 0.15e-3 * rng.uniform(0.97, 1.03))
    assert abs(c.per_expert - 0.15e-3) < 0.02e-3
    assert abs(c.fixed - 0.4e-3) < 0.1e-3


def test_a_large_fixed_cost_moves_the_split_off_the_cpu():
    """The field failure: the CPU path looked fast per byte but paid a big per-layer cost."""
    s = Split(PathCost(0.17e-3), PathCost(0.15e-3, fixed=2e-3))
    assert s.choose(4) == 4  # everything over PCIe beats paying the CPU path's fixed cost
    s = Split(PathCost(0.17e-3), PathCost(0.15e-3))
    assert s.choose(4) == 2
