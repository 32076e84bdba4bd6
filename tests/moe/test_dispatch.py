from __future__ import annotations

import random

import pytest

from freetoken.moe import dispatch
from freetoken.moe.dispatch import PathCost, Split, q_star
from freetoken.moe.policy import Mode


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
    for _ in range(300):
        tuner.observe(cost[share] * 1e-3 * 240)
        share = tuner.next_arm()
        chosen.append(share)
    tail = chosen[-100:]
    assert tail.count(0.75) >= 80
    assert set(tuner.count) != {0} and min(tuner.count) >= 2  # every share was measured


def test_share_tuner_ignores_empty_timings():
    from freetoken.moe.dispatch import ShareTuner

    tuner = ShareTuner(prior=1.0)
    tuner.next_arm()
    tuner.observe(0.0)
    assert tuner.count == [0] * len(ShareTuner.ARMS)


def _run_chooser(chooser, cost: dict[str, float], steps: int) -> list[str]:
    modes = []
    for _ in range(steps):
        modes.append(chooser.mode)
        chooser.observe(cost[chooser.mode])
    return modes


def test_mode_chooser_measures_both_then_keeps_the_faster():
    from freetoken.moe.dispatch import ModeChooser

    for cost, best in (
        ({"cache": 0.05, "layers": 0.04}, "layers"),
        ({"cache": 0.03, "layers": 0.04}, "cache"),
    ):
        chooser = ModeChooser(settle=2, measure=3, period=100)
        modes = _run_chooser(chooser, cost, 40)
        assert modes[:5] == ["cache"] * 5 and modes[5:10] == ["layers"] * 5
        assert set(modes[10:]) == {best}
        assert chooser.means == cost


def test_mode_chooser_measures_again_after_a_period():
    from freetoken.moe.dispatch import ModeChooser

    chooser = ModeChooser(settle=1, measure=2, period=10)
    cost = {"cache": 0.05, "layers": 0.04}
    _run_chooser(chooser, cost, 6)
    assert chooser.mode == "layers"
    cost["cache"] = 0.01  # the work changed: the cache became the faster
    modes = _run_chooser(chooser, cost, 30)
    assert modes[-1] == "cache"
    assert "cache" in modes[10:14]  # the re-measurement started with the other mode


def test_mode_chooser_in_rounds_is_not_fooled_by_a_machine_that_slows_down():
    from freetoken.moe.dispatch import ModeChooser

    def run(chooser, steps):
        # layers is the faster; from the fifth step on, every step is 30 ms slower
        base, modes = {"cache": 0.05, "layers": 0.04}, []
        for i in range(steps):
            modes.append(chooser.mode)
            chooser.observe(base[chooser.mode] + (0.03 if i >= 4 else 0.0))
        return modes

    one = ModeChooser(settle=0, measure=4, period=100)  # cache measured fast, layers slow
    run(one, 12)
    assert one.mode == "cache"
    two = ModeChooser(settle=0, measure=4, period=100, rounds=2)
    modes = run(two, 12)
    assert modes[:8] == ["cache", "cache", "layers", "layers"] * 2  # visits in turn, 2 samples each
    assert two.mode == "layers" and two.means == pytest.approx({"cache": 0.08, "layers": 0.07})


def _run_batches(chooser, cost, batch_of, steps):
    """Steps whose time is cost[mode][batch], the batch at each step given by batch_of."""
    modes = []
    for i in range(steps):
        modes.append(chooser.mode)
        b = batch_of(i, chooser.mode)
        chooser.observe(cost[chooser.mode][b], b)
    return modes


# four sequences' step costs more than one's in either mode; cache is faster at both
BATCHED = {"cache": {1: 0.002, 4: 0.004}, "layers": {1: 0.003, 4: 0.012}}


def test_mode_chooser_compares_modes_at_one_batch_size():
    from freetoken.moe.dispatch import ModeChooser

    # cache's visits see four sequences and one, layers' only one (the others ended): all
    # samples pooled, layers would look faster (3 ms against cache's 2-4 ms median)
    chooser = ModeChooser(settle=0, measure=4, period=100, start="cache")
    _run_batches(chooser, BATCHED, lambda i, mode: 4 if mode == "cache" and i % 4 else 1, 8)
    assert chooser.mode == "cache" and chooser.batch == 1
    assert chooser.means == pytest.approx({"cache": 0.002, "layers": 0.003})


def test_a_measurement_with_no_batch_size_in_common_decides_nothing():
    from freetoken.moe.dispatch import ModeChooser

    chooser = ModeChooser(settle=0, measure=2, period=100, start="cache", explore_after=10)
    assert set(_run_batches(chooser, BATCHED, lambda i, mode: 1, 10)) == {"cache"}
    # the measurement: layers at one sequence, then cache at four; not comparable
    modes = _run_batches(chooser, BATCHED, lambda i, mode: 4 if mode == "cache" else 1, 4)
    assert modes == ["layers", "layers", "cache", "cache"]
    assert chooser.mode == "cache" and not chooser.completed and not chooser.means
    # measured again `retry` steps later (not a whole period), this time comparably
    modes = _run_batches(chooser, BATCHED, lambda i, mode: 1, 20)
    assert "layers" in modes[9:12] and chooser.completed == 1 and chooser.mode == "cache"


def _measurements_begun(chooser, cost, steps, offset=0):
    """The steps at which a measurement began."""
    began = []
    for i in range(offset, offset + steps):
        was = chooser.measuring
        chooser.observe(cost[chooser.mode])
        if chooser.measuring and not was:
            began.append(i)
    return began


def test_a_measurement_that_keeps_the_mode_doubles_the_wait_for_the_next():
    from freetoken.moe.dispatch import ModeChooser

    cost = {"cache": 0.01, "layers": 0.012}  # close: layers is never left out
    chooser = ModeChooser(settle=0, measure=2, period=10)
    began = _measurements_begun(chooser, cost, 400)
    gaps = [b - a for a, b in zip(began, began[1:])]
    # each gap is the wait plus the measurement's own four steps: waits 20, 40, 80, 160
    assert gaps[:4] == [24, 44, 84, 164] and chooser.mode == "cache"
    assert chooser.wait == 16 * 10  # never more than MAX_BACKOFF periods
    cost["layers"] = 0.008  # the work changed (not so much that cache sits out): a switch
    began = _measurements_begun(chooser, cost, 240, offset=400)
    assert chooser.mode == "layers"
    assert began[1] - began[0] == 14  # after the switch the wait is a period again


def test_a_much_slower_mode_sits_out_the_next_measurements():
    from freetoken.moe.dispatch import ModeChooser

    cost = {"device": 0.01, "split": 0.011, "layers": 0.03}
    chooser = ModeChooser(settle=0, measure=1, period=10, modes=tuple(cost))
    visited = []
    for _ in range(2000):
        visited.append(chooser.mode)
        chooser.observe(cost[chooser.mode])
        if chooser.completed == 5:
            break
    runs = [m for i, m in enumerate(visited) if i == 0 or visited[i - 1] != m]
    # layers: measured first, then left out of three measurements, then measured again
    assert runs.count("layers") == 2 and chooser.mode == "device"


def test_mode_chooser_serves_its_start_then_measures_in_rationed_visits():
    from freetoken.moe.dispatch import ModeChooser

    cost = {"device": 0.02, "split": 0.01, "layers": 0.03}
    chooser = ModeChooser(
        settle=1,
        measure=4,
        period=1000,
        modes=tuple(cost),
        rounds=2,
        start="split",
        explore_after=50,
        duty=0.1,
    )
    modes = []
    for _ in range(400):
        modes.append(chooser.mode)
        chooser.observe(cost[chooser.mode])
    assert set(modes[:50]) == {"split"}  # the first answer is served as predicted
    # six visits (three modes, two rounds) of settle + 2 samples, each followed by a rest
    visits = sum(1 for a, b in zip(modes, modes[1:]) if a == "split" and b != "split")
    assert visits == 4 and chooser.measured and chooser.mode == "split"
    away = sum(m != "split" for m in modes)
    assert away <= 0.1 * (len(modes) - 50) + 3  # visits took about a tenth of the steps
    assert chooser.means == pytest.approx(cost)


def test_visits_to_a_slow_mode_take_their_share_of_the_time_not_of_the_steps():
    from freetoken.moe.dispatch import ModeChooser

    cost = {"device": 0.002, "layers": 0.02}  # a visited mode ten times slower
    chooser = ModeChooser(
        settle=2,
        measure=4,
        period=10**6,
        modes=tuple(cost),
        rounds=2,
        start="device",
        explore_after=10,
        duty=0.1,
    )
    spent = {"device": 0.0, "layers": 0.0}
    for step in range(5000):
        if step >= 10:  # from the first visit on
            spent[chooser.mode] += cost[chooser.mode]
        chooser.observe(cost[chooser.mode])
        if chooser.measured:
            break
    assert chooser.measured and chooser.mode == "device"
    assert spent["layers"] > 0
    assert spent["layers"] <= 0.1 * sum(spent.values()) * 1.05


def test_a_move_is_charged_to_the_visit_it_serves():
    from freetoken.moe.dispatch import ModeChooser

    def chooser():
        c = ModeChooser(
            settle=1,
            measure=2,
            period=10**6,
            modes=("device", "layers"),
            rounds=2,
            start="device",
            explore_after=2,
            duty=0.1,
        )
        for _ in range(2):
            c.observe(0.001)
        assert c.mode == "layers"  # the first visit begins
        return c

    def rest_steps(c, move: float) -> int:
        c.charge(move)  # the move into the visit
        while c.mode == "layers":
            c.observe(0.01)
        c.charge(move)  # and back out of it
        n = 0
        while c.mode == "device":
            c.observe(0.001)
            n += 1
        return n

    # steps in device until the next visit to layers: the rest after 20 ms of layers (180
    # ms), the home mode's own visit and its rest; moves of 50 ms either side of the visit
    # rest 9 x 100 ms more
    assert rest_steps(chooser(), 0.05) - rest_steps(chooser(), 0.0) == pytest.approx(900, abs=2)


def test_the_tuner_charges_a_move_and_the_step_after_it(monkeypatch):
    from freetoken.moe import tuning
    from freetoken.moe.policy import Mode

    clock = [0.0]
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: clock[0])
    tuner = tuning.AdaptiveTuner(0.5, (Mode.DEVICE, Mode.LAYERS))
    charged = []
    monkeypatch.setattr(tuner.modes, "charge", charged.append)
    observed = []
    monkeypatch.setattr(tuner.modes, "observe", lambda s, b=1: observed.append(s))
    for dt in (0.002, 0.002, 0.002):
        tuner.step_started(1, Mode.DEVICE)
        clock[0] += dt
    tuner.step_started(1, Mode.DEVICE)
    clock[0] += 0.3  # the move, before the step that starts here
    tuner.moved(Mode.DEVICE, Mode.LAYERS)
    clock[0] += 0.05  # that step: it recaptures the graphs
    tuner.step_started(1, Mode.LAYERS)
    clock[0] += 0.008
    tuner.step_started(1, Mode.LAYERS)
    assert observed == pytest.approx([0.002, 0.002, 0.002, 0.008])
    assert charged == pytest.approx([0.3, 0.05])
    assert tuner.stats()["placement"]["moves"] == 1  # /api/cache shows it, bench serve notes it


def test_a_long_step_in_a_visit_is_charged_to_it_and_one_between_visits_is_not(monkeypatch):
    """A visited mode's first use can take a second (the H200's first split step took
    1.27 s): dropped as idle time, the rest after the visit was shorter than the visit."""
    from freetoken.moe import tuning
    from freetoken.moe.policy import Mode

    clock = [0.0]
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: clock[0])
    tuner = tuning.AdaptiveTuner(0.5, (Mode.DEVICE, Mode.LAYERS))
    charged = []
    monkeypatch.setattr(tuner.modes, "charge", charged.append)

    def step(dt, mode=Mode.DEVICE):
        tuner.step_started(1, mode)
        clock[0] += dt

    for _ in range(tuning.EXPLORE_AFTER + 2):
        step(0.002)
    assert tuner.modes.visiting and tuner.modes.mode == "layers"
    step(0.4, Mode.LAYERS)  # far longer than a step: the visit's cost
    step(3.0, Mode.LAYERS)  # longer than any move: idle time too, charged the cap
    step(0.004, Mode.LAYERS)
    assert charged == pytest.approx([0.4, tuning.MOVE_CHARGE_CAP])
    while tuner.modes.visiting:
        step(0.004, Mode.LAYERS)
    assert tuner.modes.measuring  # resting in device before the next visit
    step(0.002)
    step(2.0)  # a pause between two requests while resting: not a visit's
    step(0.002)
    assert charged == pytest.approx([0.4, tuning.MOVE_CHARGE_CAP])


def test_a_chooser_that_learned_waits_a_period():
    from freetoken.moe.dispatch import ModeChooser

    chooser = ModeChooser(modes=("device", "split"), start="device", explore_after=4096)
    for _ in range(4095):
        chooser.observe(0.01)
    assert chooser.mode == "device" and not chooser._plan
    chooser.observe(0.01)
    assert chooser._plan  # measuring again


def test_prediction_prefers_both_paths_then_pcie():
    from freetoken.moe.policy import Mode
    from freetoken.moe.tuning import predict

    modes = (Mode.DEVICE, Mode.SPLIT, Mode.LAYERS)
    assert predict(modes, 48, 128, 2304, 0.18e-3, 0.11e-3) is Mode.SPLIT
    assert predict((Mode.DEVICE, Mode.LAYERS), 48, 128, 2304, 0.18e-3, 0.11e-3) is Mode.LAYERS
    assert predict((Mode.DEVICE, Mode.LAYERS), 48, 128, 2304, 0.05e-3, 0.5e-3) is Mode.DEVICE


def test_locality_keeps_device_unless_misses_come_near_uniform():
    from freetoken.moe.tuning import NEAR_UNIFORM, LocalityCheck

    check = LocalityCheck(Mode.SPLIT, uniform_miss_rate=0.25)  # a cache of 75 % of experts
    assert check.verdict(hits=990, misses=10) is Mode.DEVICE  # a hot cache: keep what it holds
    near = int(1000 * 0.25 * NEAR_UNIFORM) + 1
    assert check.verdict(hits=1000 - near, misses=near) is Mode.SPLIT
    assert check.verdict(hits=0, misses=0) is Mode.DEVICE  # nothing seen: nothing to move for


def test_locality_takes_the_prediction_where_it_wins_even_at_uniforms_misses():
    """A small cache under routing with locality: device missed 0.44 of the routes where
    uniform routing misses 0.92 (8 GiB of the 48-layer shape), far from uniform, yet split,
    at a third of device's cost a miss, wins even if it missed as often as uniform."""
    from freetoken.moe.tuning import LocalityCheck, miss_costs

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


def test_a_chooser_adopts_a_mode_between_measurements_only():
    chooser = dispatch.ModeChooser(modes=("device", "split"), start="device", explore_after=100)
    chooser.adopt("split")
    assert chooser.mode == "split" and chooser.best == "split"
    chooser.adopt("cache")  # not one of its modes
    assert chooser.mode == "split"
    measuring = dispatch.ModeChooser(modes=("device", "split"))  # measures from the start
    first = measuring.mode
    measuring.adopt("split" if first == "device" else "device")
    assert measuring.mode == first


def test_steps_are_timed_after_a_first_interval_far_shorter_than_a_step(monkeypatch):
    """Decode ahead launches a step right behind the one before: its interval is a fraction
    of a step's. Taken as the running step time, every later step looked like idle time and
    adaptive never measured; a run of such intervals resets it."""
    from freetoken.moe import tuning
    from freetoken.moe.policy import Mode

    clock = [0.0]
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: clock[0])
    tuner = tuning.AdaptiveTuner(0.5, (Mode.DEVICE, Mode.LAYERS))

    def step(dt, mode=Mode.DEVICE):
        tuner.step_started(1, mode)
        clock[0] += dt

    step(0.0002)  # the chained launch
    for _ in range(tuning.EXPLORE_AFTER + tuning.STALE_AFTER + 2):
        step(0.025)
    assert tuner.modes.visiting and tuner.modes.mode == "layers"
    assert tuner._typical == pytest.approx(0.025)
    step(2.0, Mode.LAYERS)  # idle time is still dropped once the running time is right
    assert tuner._typical == pytest.approx(0.025)
