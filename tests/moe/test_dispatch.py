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


def test_share_tuner_starts_at_the_prior_and_settles_on_the_fastest_share():
    from freetoken.moe.dispatch import ShareTuner

    tuner = ShareTuner(prior=0.6, explore=0.1, seed=3)
    first = tuner.next_arm()
    assert first == 0.5  # the arm nearest the bandwidth split's share
    cost = {0.0: 3.0, 0.25: 2.2, 0.5: 1.6, 0.75: 1.2, 1.0: 1.5}  # ms per miss, 0.75 the fastest
    chosen = []
    share = first
    for _ in range(400):
        tuner.observe(cost[share] * 1e-3 * 240)
        share = tuner.next_arm()
        chosen.append(share)
    tail = chosen[-200:]
    assert tail.count(0.75) >= 160
    assert set(tuner.count) != {0} and min(tuner.count) >= 2  # every share was measured


def test_share_tuner_keeps_each_batch_size_apart():
    """One and four streams in turn, each with its own fastest share: each size settles on
    its own, though a four-stream step takes three times one's whatever the share."""
    from freetoken.moe.dispatch import ShareTuner

    tuner = ShareTuner(prior=0.5, explore=0.1, seed=5)
    ms = {
        1: {0.0: 9.0, 0.25: 7.0, 0.5: 6.0, 0.75: 5.0, 1.0: 5.5},  # 0.75 the fastest
        4: {0.0: 18.0, 0.25: 15.0, 0.5: 16.0, 0.75: 19.0, 1.0: 22.0},  # 0.25 the fastest
    }
    chosen: dict[int, list[float]] = {1: [], 4: []}
    batch = 1
    share = tuner.next_arm(batch)
    for step in range(800):
        tuner.observe(ms[batch][share] * 1e-3, batch)
        batch = 1 if (step // 40) % 2 else 4  # streams come and go in spells
        share = tuner.next_arm(batch)
        chosen[batch].append(share)
    assert chosen[1][-200:].count(0.75) >= 160
    assert chosen[4][-200:].count(0.25) >= 160
    by_batch = tuner.stats()["by_batch"]
    assert set(by_batch) == {1, 4} and min(by_batch[1]["steps"]) >= 2


def test_share_tuner_starts_a_new_size_from_the_nearest_sizes_best():
    from freetoken.moe.dispatch import ShareTuner

    tuner = ShareTuner(prior=0.0, explore=0.0)
    ms = {0.0: 9.0, 0.25: 7.0, 0.5: 6.0, 0.75: 5.0, 1.0: 5.5}
    share = tuner.next_arm(1)
    for _ in range(len(ShareTuner.ARMS) * ShareTuner.HOLD):  # each share tried, held
        tuner.observe(ms[share] * 1e-3, 1)
        share = tuner.next_arm(1)
    assert share == 0.75
    assert tuner.next_arm(2) == 0.75  # two sequences try one's best first, not the prior
    assert tuner.count == [0] * len(ShareTuner.ARMS)  # and have no steps of their own yet


def test_share_tuner_ignores_empty_timings():
    from freetoken.moe.dispatch import ShareTuner

    tuner = ShareTuner(prior=1.0)
    tuner.next_arm()
    tuner.observe(0.0)
    assert tuner.count == [0] * len(ShareTuner.ARMS)


def test_share_tuner_credits_each_share_with_its_own_steps_when_timed_a_step_late():
    """Steps launched one ahead are timed as the step before them ends: a share tried for
    one step would be credited with its neighbour's time. Held `HOLD` steps and counted only
    where the step before ran it too, the fastest share serves as if timed in place."""
    from freetoken.moe.dispatch import ShareTuner

    cost = {0.0: 1.3, 0.25: 1.0, 0.5: 1.3, 0.75: 1.6, 1.0: 1.6}
    for late in (0, 1):
        tuner, times, chosen = ShareTuner(prior=0.25, explore=0.1, seed=1), [], []
        for _ in range(600):
            share = tuner.next_arm(1)
            chosen.append(share)
            times.append(cost[share] * 1e-3)
            tuner.observe(times[-1 - late] if len(times) > late else times[-1], 1)
        assert chosen[-300:].count(0.25) >= 250
