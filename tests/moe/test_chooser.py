from __future__ import annotations

import pytest

from freetoken.moe.chooser import ModeChooser


def _run_chooser(chooser, cost: dict[str, float], steps: int) -> list[str]:
    modes = []
    for _ in range(steps):
        modes.append(chooser.mode)
        chooser.observe(cost[chooser.mode])
    return modes


def test_mode_chooser_measures_both_then_keeps_the_faster():
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
    chooser = ModeChooser(settle=1, measure=2, period=10)
    cost = {"cache": 0.05, "layers": 0.04}
    _run_chooser(chooser, cost, 6)
    assert chooser.mode == "layers"
    cost["cache"] = 0.01  # the work changed: the cache became the faster
    modes = _run_chooser(chooser, cost, 30)
    assert modes[-1] == "cache"
    assert "cache" in modes[10:14]  # the re-measurement started with the other mode


def test_mode_chooser_in_rounds_is_not_fooled_by_a_machine_that_slows_down():
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
    # moves between the modes dear (no size of its own): the close call gets no more rounds
    two = ModeChooser(settle=0, measure=4, period=100, rounds=2, own_sizes=())
    modes = run(two, 12)
    assert modes[:8] == ["cache", "cache", "layers", "layers"] * 2  # visits in turn, 2 samples each
    assert two.mode == "layers" and two.means == pytest.approx({"cache": 0.08, "layers": 0.07})


def _noisy(chooser, base: dict[str, float], noise: list[float], steps: int) -> list[str]:
    """Steps whose time is the mode's base plus the next of `noise` (then none): the
    misses a step happens to draw, whichever mode serves it."""
    modes = []
    for i in range(steps):
        modes.append(chooser.mode)
        chooser.observe(base[chooser.mode] + (noise[i] if i < len(noise) else 0.0))
    return modes


# device 5 % faster; five of the first eight steps (device's visit) draw costly misses
CLOSE_BASE = {"device": 1.00, "split": 1.05}
CLOSE_NOISE = [0.1] * 5


def test_a_close_call_is_decided_on_more_rounds_of_visits():
    # one visit of eight samples a mode: device's drew the costly steps, split was chosen
    dear = ModeChooser(settle=0, measure=8, period=1000, modes=("device", "split"), own_sizes=())
    _noisy(dear, CLOSE_BASE, CLOSE_NOISE, 16)
    assert dear.mode == "split" and dear.completed == 1
    # moves between them cheap, and within CLOSE of each other: more visits in turn,
    # judged on all of them; over 40 samples each the draws even out and device is faster
    cheap = ModeChooser(settle=0, measure=8, period=1000, modes=("device", "split"))
    modes = _noisy(cheap, CLOSE_BASE, CLOSE_NOISE, 16 * (1 + ModeChooser.EXTRA_ROUNDS))
    assert modes[16:32] == ["split"] * 8 + ["device"] * 8  # the others, then the mode in use
    assert cheap.completed == 1 and cheap.mode == "device"
    assert cheap.means == pytest.approx(CLOSE_BASE)


def test_a_clear_difference_or_a_move_of_whole_layers_takes_no_more_rounds():
    far = {"device": 1.0, "split": 1.5}
    chooser = ModeChooser(settle=0, measure=8, period=1000, modes=("device", "split"))
    _noisy(chooser, far, [0.0], 16)
    assert chooser.completed == 1 and chooser.mode == "device"
    # layers moves whole layers: its close call is decided on the rounds asked for
    modes = ("device", "layers")
    chooser = ModeChooser(settle=0, measure=8, period=1000, modes=modes, own_sizes=("device",))
    _noisy(chooser, {"device": 1.0, "layers": 1.05}, [0.0], 16)
    assert chooser.completed == 1 and chooser.mode == "device"


def _run_batches(chooser, cost, batch_of, steps):
    """Steps whose time is cost[mode][batch], the batch at each step given by batch_of."""
    modes = []
    for i in range(steps):
        b = batch_of(i, chooser.mode)
        ran = chooser.mode_for(b)  # the mode itself wherever a measurement is under way
        modes.append(ran)
        chooser.observe(cost[ran][b], b, ran)
    return modes


def _device_split(period: int, explore_after: int, start: str = "device") -> ModeChooser:
    """Device and split, one sample a visit, serving from `start` and measuring after
    `explore_after` steps."""
    return ModeChooser(
        settle=0,
        measure=2,
        period=period,
        modes=("device", "split"),
        start=start,
        explore_after=explore_after,
    )


# four sequences' step costs more than one's in either mode; cache is faster at both
BATCHED = {"cache": {1: 0.002, 4: 0.004}, "layers": {1: 0.003, 4: 0.012}}


def test_mode_chooser_compares_modes_at_one_batch_size():
    # cache's visits see four sequences and one, layers' only one (the others ended): all
    # samples pooled, layers would look faster (3 ms against cache's 2-4 ms median)
    chooser = ModeChooser(settle=0, measure=4, period=100, start="cache")
    _run_batches(chooser, BATCHED, lambda i, mode: 4 if mode == "cache" and i % 4 else 1, 8)
    assert chooser.mode == "cache" and chooser.batch == 1
    assert chooser.means == pytest.approx({"cache": 0.002, "layers": 0.003})


def test_a_measurement_with_no_batch_size_in_common_decides_nothing():
    chooser = ModeChooser(settle=0, measure=2, period=100, start="cache", explore_after=10)
    assert set(_run_batches(chooser, BATCHED, lambda i, mode: 1, 10)) == {"cache"}
    # the measurement: layers at one sequence, then cache at four; not comparable
    modes = _run_batches(chooser, BATCHED, lambda i, mode: 4 if mode == "cache" else 1, 4)
    assert modes == ["layers", "layers", "cache", "cache"]
    assert chooser.mode == "cache" and not chooser.completed and not chooser.means
    # measured again `retry` steps later (not a whole period), this time comparably
    modes = _run_batches(chooser, BATCHED, lambda i, mode: 1, 20)
    assert "layers" in modes[9:12] and chooser.completed == 1 and chooser.mode == "cache"


def test_modes_with_no_size_in_common_are_judged_against_the_mode_in_use():
    chooser = ModeChooser(settle=0, measure=2, period=100, start="cache", explore_after=40)
    # the mode in use served both sizes first, enough of each to judge by
    assert set(_run_batches(chooser, BATCHED, lambda i, mode: 1 + 3 * (i % 2), 40)) == {"cache"}
    # the measurement: layers at one sequence, then cache at four; no size in common
    modes = _run_batches(chooser, BATCHED, lambda i, mode: 4 if mode == "cache" else 1, 4)
    assert modes == ["layers", "layers", "cache", "cache"] and chooser.completed == 1
    # layers' 3 ms at one sequence is 1.5x cache's served 2 ms there: scaled to the size
    # cache served most (one sequence, tied with four, the smaller taken), 3 ms
    assert chooser.batch == 1 and chooser.mode == "cache"
    assert chooser.means == pytest.approx({"cache": 0.002, "layers": 0.003})
    fast = {"cache": BATCHED["cache"], "layers": {1: 0.001, 4: 0.012}}
    chooser = ModeChooser(settle=0, measure=2, period=100, start="cache", explore_after=40)
    _run_batches(chooser, fast, lambda i, mode: 1 + 3 * (i % 2), 40)
    _run_batches(chooser, fast, lambda i, mode: 4 if mode == "cache" else 1, 4)
    assert chooser.mode == "layers"  # half cache's time at one sequence: on trial


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


def test_a_mode_told_to_sit_out_is_not_visited_for_that_many_measurements():
    """A locality check (or a load before) found device slow: the measurements that follow
    compare the others, then device is measured again."""
    cost = {"split": 0.01, "device": 0.03, "layers": 0.012}
    chooser = ModeChooser(
        settle=0, measure=1, period=10, modes=tuple(cost), start="split", explore_after=5
    )
    chooser.sit_out("device", 2)
    assert chooser.sitting_out == {"device": 2}
    visited = []
    while chooser.completed < 3:
        visited.append(chooser.mode)
        chooser.observe(cost[chooser.mode])
    first = visited.index("device")
    assert "layers" in visited[:first] and chooser.completed == 3 and chooser.mode == "split"
    assert visited[:first].count("layers") == 2  # two measurements without device


def test_mode_chooser_serves_its_start_then_measures_in_rationed_visits():
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


def _rationed(modes: tuple[str, ...], explore_after: int, **kw) -> ModeChooser:
    """Visits of 2 settling steps and 2 samples, in two rounds, serving from `modes[0]`
    and resting so that visits take a tenth of the time."""
    return ModeChooser(
        settle=2,
        measure=4,
        period=10**6,
        modes=modes,
        rounds=2,
        start=modes[0],
        explore_after=explore_after,
        duty=0.1,
        **kw,
    )


def test_visits_to_a_slow_mode_take_their_share_of_the_time_not_of_the_steps():
    cost = {"device": 0.002, "layers": 0.02}  # a visited mode ten times slower
    chooser = _rationed(tuple(cost), explore_after=10)
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


def test_a_visit_to_a_mode_about_as_fast_rests_next_to_nothing():
    def steps_to_decide(split_cost: float) -> int:
        cost = {"device": 1.0, "split": split_cost}
        # moves between the modes dear: rounds as asked, so only the rests differ
        chooser = _rationed(tuple(cost), explore_after=64, own_sizes=())
        for step in range(10**4):
            chooser.observe(cost[chooser.mode])
            if chooser.measured:
                return step + 1 - 64
        raise AssertionError("never decided")

    # four visits of four steps; a visit 2 % slower repays its cost in a step or two, one to
    # the mode in use costs nothing; a mode twice as slow rests nine times its excess
    assert steps_to_decide(1.02) <= 4 * 4 + 2 * 2
    assert steps_to_decide(2.0) >= 4 * 4 + 2 * 36


def test_a_move_is_charged_to_the_visit_it_serves():
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


def test_a_chooser_that_learned_waits_a_period():
    chooser = ModeChooser(modes=("device", "split"), start="device", explore_after=4096)
    for _ in range(4095):
        chooser.observe(0.01)
    assert chooser.mode == "device" and not chooser._plan
    chooser.observe(0.01)
    assert chooser._plan  # measuring again


def test_a_chooser_adopts_a_mode_between_measurements_only():
    chooser = ModeChooser(modes=("device", "split"), start="device", explore_after=100)
    chooser.adopt("split")
    assert chooser.mode == "split" and chooser.best == "split"
    chooser.adopt("cache")  # not one of its modes
    assert chooser.mode == "split"
    measuring = ModeChooser(modes=("device", "split"))  # measures from the start
    first = measuring.mode
    measuring.adopt("split" if first == "device" else "device")
    assert measuring.mode == first


def _run_visits_apart(chooser, visit: dict[str, float], served: dict[str, float], steps: int):
    """Steps that take visit[mode] during a measurement's visits and served[mode] otherwise:
    what a cache stirred by the visits (or left filled for them) does to a mode's time."""
    modes = []
    for _ in range(steps):
        modes.append(chooser.mode)
        cost = visit if chooser.visiting else served
        chooser.observe(cost[chooser.mode])
    return modes


def test_a_switch_that_serves_slower_than_it_visited_is_taken_back():
    # split visits a cache device filled (fast), then, serving, keeps no new expert (slow)
    chooser = _device_split(100, 20)
    modes = _run_visits_apart(
        chooser, {"device": 0.015, "split": 0.010}, {"device": 0.015, "split": 0.020}, 100
    )
    switched = modes.index("split", 20 + 4)  # after the measurement's four visit steps
    # the verdict contradicts the visits: taken twice before split goes
    trials = 2 * ModeChooser.TRIAL
    assert modes[switched : switched + trials] == ["split"] * trials
    assert modes[switched + trials + 1 :] == ["device"] * (len(modes) - switched - trials - 1)
    assert chooser.mode == "device" and chooser.reverted == 1
    assert chooser.means["split"] == pytest.approx(0.020)
    assert chooser.stats()["reverted"] == 1
    # split sits out the next measurements, and after each revert twice as many
    reverts = []
    for step in range(4000):
        was = chooser.reverted
        _run_visits_apart(
            chooser, {"device": 0.015, "split": 0.01}, {"device": 0.015, "split": 0.02}, 1
        )
        if chooser.reverted > was:
            reverts.append(step)
    gaps = [b - a for a, b in zip(reverts, reverts[1:])]
    assert len(reverts) >= 3 and all(b > 1.5 * a for a, b in zip(gaps, gaps[1:]))
    assert chooser.mode == "device"


def test_a_switch_that_serves_as_fast_as_it_visited_is_kept():
    chooser = _device_split(100, 20)
    modes = _run_visits_apart(
        chooser, {"device": 0.015, "split": 0.010}, {"device": 0.015, "split": 0.0104}, 80
    )
    assert modes[-1] == "split" and chooser.mode == "split" and chooser.reverted == 0
    assert chooser.means["split"] == pytest.approx(0.0104)  # the trial's served time


def test_a_trial_against_the_visits_that_serves_fast_the_second_time_stands():
    """Split's trial at four streams on an H100 came as streams came and went (4.28 ms a
    step against its visits' 2.71 and device's 3.62): its second verdict is the one taken."""
    chooser = _device_split(100, 20)
    visit = {"device": 0.015, "split": 0.010}
    modes = _run_visits_apart(chooser, visit, {"device": 0.015, "split": 0.020}, 24)
    assert chooser.mode == "split" and not chooser.visiting and modes[-1] != "split"
    # the trial's first TRIAL steps serve slow (settle is 0): a verdict set aside
    slow = _run_visits_apart(chooser, visit, {"device": 0.015, "split": 0.020}, ModeChooser.TRIAL)
    assert set(slow) == {"split"} and chooser.reverted == 0 and chooser.stats()["retried"] == 1
    fast = _run_visits_apart(chooser, visit, {"device": 0.015, "split": 0.0104}, 60)
    assert set(fast) == {"split"} and chooser.reverted == 0
    assert chooser.means["split"] == pytest.approx(0.0104)


def test_the_mode_in_use_is_judged_by_the_steps_it_served():
    # device's visits come after split's, which left its cache stirred: slow in the visit,
    # fast as served before the measurement
    chooser = _device_split(100, 30)
    _run_visits_apart(
        chooser, {"device": 0.02, "split": 0.015}, {"device": 0.01, "split": 0.015}, 40
    )
    assert chooser.completed == 1 and chooser.mode == "device" and chooser.reverted == 0
    assert chooser.means == pytest.approx({"device": 0.01, "split": 0.015})
    # with too few steps served before it, the visits decide (and split wins its trial)
    short = _device_split(100, 5)
    _run_visits_apart(short, {"device": 0.02, "split": 0.015}, {"device": 0.01, "split": 0.015}, 10)
    assert short.completed == 1 and short.mode == "split"


def test_a_switch_is_judged_at_every_batch_size_the_old_mode_served():
    # device served four streams, then one; the measurement compares at one stream, where
    # split is faster, but split serves four streams far slower than device did: four
    # streams go back to device, one stays in split
    chooser = _device_split(1000, 40)
    cost = {"device": {1: 0.015, 4: 0.03}, "split": {1: 0.010, 4: 0.05}}
    modes = _run_batches(chooser, cost, lambda i, mode: 4 if i < 20 else 1, 50)
    assert modes[-1] == "split" and chooser.batch == 1  # switched on one stream's times
    modes = _run_batches(chooser, cost, lambda i, mode: 1, 40)
    assert set(modes) == {"split"}  # one stream: split holds up
    modes = _run_batches(chooser, cost, lambda i, mode: 4, 40)
    assert modes[: ModeChooser.TRIAL] == ["split"] * ModeChooser.TRIAL
    assert set(modes[ModeChooser.TRIAL :]) == {"device"}
    assert chooser.mode == "split" and chooser.reverted == 0
    assert chooser.mode_for(4) == "device" and chooser.mode_for(1) == "split"
    assert chooser.stats()["by_batch"] == {4: "device"}
    # one stream again: split, with no move back for it
    assert set(_run_batches(chooser, cost, lambda i, mode: 1, 20)) == {"split"}


def test_a_decision_at_a_size_serves_that_size_the_winner():
    # split kept four streams after device won at one; measured again at four streams,
    # where device is now the faster, device serves both
    chooser = _device_split(200, 40)
    cost = {"device": {1: 0.015, 4: 0.03}, "split": {1: 0.010, 4: 0.05}}
    _run_batches(chooser, cost, lambda i, mode: 4 if i < 20 else 1, 50)
    _run_batches(chooser, cost, lambda i, mode: 4, 40)
    assert chooser.mode_for(4) == "device" and chooser.mode == "split"
    cost["split"][1] = 0.02  # split now the slower at one stream as well
    modes = _run_batches(chooser, cost, lambda i, mode: 1, 400)
    assert chooser.completed >= 2 and chooser.mode == "device" and "split" in modes
    assert chooser.stats()["by_batch"] == {} and chooser.mode_for(4) == "device"


class _Prospects:
    """Names the modes worth a measurement, after `wait` asks that find too few steps."""

    def __init__(self, promising: tuple[str, ...], wait: int = 0):
        self.answer, self.wait, self.asked = promising, wait, 0

    def promising(self, mode: str) -> tuple[str, ...] | None:
        self.asked += 1
        return None if self.asked <= self.wait else self.answer


def _gated(prospects, period: int, modes: tuple[str, ...] = ("device", "split")) -> ModeChooser:
    """A chooser that asks `prospects` before each measurement, the first after 5 steps."""
    return ModeChooser(
        settle=1, measure=2, period=period, modes=modes, explore_after=5, prospects=prospects
    )


def test_a_measurement_nothing_can_gain_from_is_skipped():
    prospects = _Prospects(())
    chooser = _gated(prospects, 10)
    modes = _run_chooser(chooser, {"device": 0.02, "split": 0.01}, 60)
    assert set(modes) == {"device"}  # split was never visited, though it would be faster
    assert chooser.skipped == prospects.asked == 6  # asked at each period, once at the start
    assert chooser.stats()["skipped"] == 6


def test_a_gate_that_found_nothing_is_asked_again_soon_not_a_period_later():
    prospects = _Prospects(())
    chooser = _gated(prospects, 4096)
    cost = {"device": 0.02, "split": 0.01}
    modes = _run_chooser(chooser, cost, 5 + 3 * ModeChooser.GATE_RETRY)
    assert set(modes) == {"device"} and chooser.skipped == prospects.asked == 4
    prospects.answer = ("split",)  # the work turned near-uniform: split may gain now
    modes = _run_chooser(chooser, cost, ModeChooser.GATE_RETRY + 40)
    assert "split" in modes and chooser.mode == "split"


def test_a_measurement_waits_for_a_verdict_and_visits_only_the_promising():
    prospects = _Prospects(("split",), wait=2)
    chooser = _gated(prospects, 1000, ("device", "split", "layers"))
    cost = {"device": 0.02, "split": 0.01, "layers": 0.005}
    modes = _run_chooser(chooser, cost, 5 + 2 * ModeChooser.GATE_RETRY)
    assert set(modes) == {"device"} and prospects.asked == 3  # no verdict yet: asked again
    modes = _run_chooser(chooser, cost, 40)
    assert "layers" not in modes and "split" in modes  # layers, the fastest, was not promising
    assert chooser.mode == "split" and chooser.skipped == 0


def test_a_batch_size_no_measurement_compared_at_is_measured_soon():
    # measured at one stream, device is the faster; four streams then come, where split is:
    # measured after NEW_SIZE steps there, not a period later, and served in split; one
    # stream, judged on trial, goes back to device
    chooser = _device_split(4096, 20)
    cost = {"device": {1: 0.010, 4: 0.05}, "split": {1: 0.012, 4: 0.03}}
    _run_batches(chooser, cost, lambda i, mode: 1, 40)
    assert chooser.completed == 1 and chooser.mode == "device" and chooser.batch == 1
    modes = _run_batches(chooser, cost, lambda i, mode: 4, ModeChooser.NEW_SIZE + 40)
    assert set(modes[: ModeChooser.NEW_SIZE - 1]) == {"device"} and modes[-1] == "split"
    assert chooser.batch == 4 and chooser.mode_for(4) == "split"
    modes = _run_batches(chooser, cost, lambda i, mode: 1, ModeChooser.TRIAL + 10)
    assert modes[0] == "split" and modes[-1] == "device"
    assert chooser.mode_for(1) == "device" and chooser.mode_for(4) == "split"
    # both sizes compared: four streams are not measured again before the period
    modes = _run_batches(chooser, cost, lambda i, mode: 4, 400)
    assert set(modes) == {"split"}


def test_a_new_size_is_asked_of_the_gate_every_new_size_steps():
    prospects = _Prospects(())  # nothing can gain: every ask is kept out
    chooser = _device_split(1000, 20)
    cost = {"device": {1: 0.010, 4: 0.05}, "split": {1: 0.012, 4: 0.03}}
    _run_batches(chooser, cost, lambda i, mode: 1, 40)
    assert chooser.completed == 1
    chooser.prospects = prospects
    _run_batches(chooser, cost, lambda i, mode: 4, 3 * ModeChooser.NEW_SIZE)
    assert prospects.asked == 3 and chooser.skipped == 3 and chooser.mode_for(4) == "device"


@pytest.mark.parametrize("compared, measures", [(1, False), (0, True)])
def test_sizes_a_load_before_compared_at_are_not_measured_again_at_once(compared, measures):
    """A reload serves from what the last load learned: the sizes it compared the modes at
    wait the period, so the first answer pays no visit; another size is measured soon."""
    chooser = _device_split(4096, 4096, start="split")
    chooser.serve_at({4: "device"}, compared)
    for _ in range(3 * ModeChooser.NEW_SIZE):
        chooser.observe(0.01, 1, chooser.mode_for(1))
    assert bool(chooser.completed) == measures and chooser.mode_for(4) == "device"


def test_a_mode_that_moves_whole_layers_never_serves_a_size_apart():
    # as above, but the old mode places whole layers: a size kept there would move layers
    # (and empty the cache) at every change of batch, so the switch is taken back for all
    chooser = ModeChooser(
        settle=0,
        measure=2,
        period=1000,
        modes=("layers", "device"),
        start="layers",
        explore_after=40,
        own_sizes=("device",),
    )
    cost = {"layers": {1: 0.015, 4: 0.03}, "device": {1: 0.010, 4: 0.05}}
    modes = _run_batches(chooser, cost, lambda i, mode: 4 if i < 20 else 1, 50)
    assert modes[-1] == "device" and chooser.batch == 1
    modes = _run_batches(chooser, cost, lambda i, mode: 4, 40)
    assert chooser.mode == "layers" and chooser.reverted == 1 and chooser.by_batch == {}
    assert set(modes[ModeChooser.TRIAL :]) == {"layers"}
    chooser.serve_at({4: "device"})  # nor from what a load before kept
    assert chooser.mode_for(4) == "layers"


def test_a_mode_sitting_out_counts_measurements_not_the_gates_asks():
    """8 GiB of the 48-layer shape: the locality check found device slow, layers is not
    promising, and the gate asks again every GATE_RETRY steps. Device sits out three waits'
    worth of asks, not three asks (192 steps, then a visit at three times split's step)."""
    prospects = _Prospects(("device",))
    chooser = ModeChooser(
        settle=1,
        measure=2,
        period=200,
        modes=("device", "split", "layers"),
        start="split",
        explore_after=5,
        prospects=prospects,
    )
    chooser.sit_out("device", 3)
    cost = {"device": 0.073, "split": 0.024, "layers": 0.04}
    modes = _run_chooser(chooser, cost, 600)
    assert set(modes) == {"split"} and prospects.asked >= 9 and chooser.skipped >= 9
    assert chooser.sitting_out == {"device": 1}  # two waits of asks so far
    modes = _run_chooser(chooser, cost, 400)
    assert "device" in modes and chooser.mode == "split"  # measured again, and still slow


def _tried(prospects, start: str = "device", tried=(("device", "split"),)) -> ModeChooser:
    """A gated chooser serving from `start` that tries the switches `tried` at the gate's
    word, no visits before."""
    return ModeChooser(
        settle=1,
        measure=2,
        period=4096,
        modes=("device", "split", "cache"),
        start=start,
        explore_after=5,
        prospects=prospects,
        tried=tried,
    )


def test_a_switch_the_gate_names_is_tried_at_once_and_stands_where_faster():
    prospects = _Prospects(("split", "cache"), wait=1)  # the first ask: too few steps
    chooser = _tried(prospects)
    cost = {"device": 0.02, "split": 0.01, "cache": 0.03}
    modes = _run_chooser(chooser, cost, 5 + ModeChooser.GATE_RETRY)
    assert set(modes) == {"device"} and chooser.mode == "split"  # no visit before
    assert chooser.stats()["tried"] and chooser.completed == 1 and chooser.sampled == {}
    assert chooser.means == {"device": 0.02} and chooser.batch == 1
    modes = _run_chooser(chooser, cost, 1 + ModeChooser.TRIAL)
    assert set(modes) == {"split"} and not chooser.stats()["tried"]
    assert chooser.means["split"] == 0.01 and chooser.reverted == 0
    modes = _run_chooser(chooser, cost, 2000)
    assert set(modes) == {"split"}  # cache, named too, waits for the period's measurement


def test_a_switch_tried_at_the_gates_word_that_serves_slower_is_taken_back_then_retried():
    """Hot routing at four streams: the gate sees misses split could halve, yet split's
    host work per layer makes it slower. Taken back, it is not visited meanwhile, and tried
    again `GATE_RETRY * PRUNE` steps later, twice that after a second revert."""
    prospects = _Prospects(("split",), wait=1)
    chooser = _tried(prospects)
    cost = {"device": 0.02, "split": 0.0212, "cache": 0.03}  # 6 % slower: little lost
    _run_chooser(chooser, cost, 5 + ModeChooser.GATE_RETRY)
    assert chooser.mode == "split"
    modes = _run_chooser(chooser, cost, 1 + ModeChooser.TRIAL)
    assert modes[-1] == "split" and chooser.mode == "device" and chooser.reverted == 1
    assert chooser.sitting_out == {}  # held back by steps, not measurements
    after = ModeChooser.GATE_RETRY * ModeChooser.PRUNE
    modes = _run_chooser(chooser, cost, after - ModeChooser.GATE_RETRY)
    assert set(modes) == {"device"} and chooser.skipped >= 1  # asked, nothing to measure
    modes = _run_chooser(chooser, cost, 2 * ModeChooser.GATE_RETRY)
    assert "split" in modes and not chooser.measuring  # tried, not visited
    _run_chooser(chooser, cost, 1 + ModeChooser.TRIAL)
    assert chooser.mode == "device" and chooser.reverted == 2
    modes = _run_chooser(chooser, cost, 2 * after - ModeChooser.GATE_RETRY)
    assert set(modes) == {"device"}


def test_a_trial_that_lost_much_is_tried_again_only_once_that_is_a_small_share():
    """Split 50 % slower: its trial lost half its steps' time, and the next waits until
    that is 2 % of the steps between (GateTrials.share), not `GATE_RETRY * PRUNE`."""
    chooser = _tried(_Prospects(("split",), wait=1))
    cost = {"device": 0.02, "split": 0.03, "cache": 0.04}
    _run_chooser(chooser, cost, 5 + ModeChooser.GATE_RETRY + 1 + ModeChooser.TRIAL)
    assert chooser.mode == "device" and chooser.reverted == 1
    hold = (1 + ModeChooser.TRIAL) * 0.5 / chooser.tried.share
    modes = _run_chooser(chooser, cost, int(hold) - ModeChooser.GATE_RETRY)
    assert set(modes) == {"device"}
    modes = _run_chooser(chooser, cost, 2 * ModeChooser.GATE_RETRY)
    assert "split" in modes


def test_a_switch_waits_for_the_mode_in_use_to_serve_enough_steps_to_judge_it():
    """Not visited meanwhile: the gate is asked again `GATE_RETRY` steps later."""
    prospects = _Prospects(("split",))  # a verdict at the first ask, 5 steps after the start
    chooser = _tried(prospects)
    cost = {"device": 0.02, "split": 0.01, "cache": 0.03}
    modes = _run_chooser(chooser, cost, 4 + ModeChooser.GATE_RETRY)
    assert set(modes) == {"device"} and chooser.sampled == {} and prospects.asked == 1
    _run_chooser(chooser, cost, 1)
    assert chooser.mode == "split" and chooser.stats()["tried"] and prospects.asked == 2


def test_from_split_a_turn_tries_device_at_once_and_leaves_the_cache_to_the_period():
    """Hot routing at four streams, served in split: the gate names device and the cache
    (split's lane work is time no miss shows); device, no expert moved to get there, is
    tried at once, not visited with the cache in rounds, and stands."""
    prospects = _Prospects(("device", "cache"), wait=1)
    chooser = _tried(prospects, "split", (("device", "split"), ("split", "device")))
    cost = {"device": 0.0024, "split": 0.0025, "cache": 0.004}
    modes = _run_chooser(chooser, cost, 5 + ModeChooser.GATE_RETRY + 1 + ModeChooser.TRIAL)
    assert set(modes) == {"split", "device"} and chooser.mode == "device"
    assert chooser.completed == 2 and chooser.reverted == 0 and not chooser.stats()["tried"]


class _Turns:
    """The gate through the server at 12 layers: device's misses name split, and split's
    lane work names device."""

    def promising(self, mode: str) -> tuple[str, ...]:
        return ("split",) if mode == "device" else ("device",)


def test_a_trial_judges_no_size_against_steps_of_other_work():
    """12 layers, 75 % cached, through the server: near-uniform routing at four streams in
    split (device tried there, four times slower, and taken back), then hot routing at one
    stream, where device is tried at once and stands, then hot at four. Split's four-stream
    steps of near-uniform work are no reference for device's of hot work: four streams are
    asked of anew, and split, the faster there now, serves them."""
    both = (("device", "split"), ("split", "device"))
    chooser = _tried(_Turns(), "split", both)
    cost = {"device": {1: 1.36e-3, 4: 10e-3}, "split": {1: 1.39e-3, 4: 2.5e-3}}
    modes = _run_batches(chooser, cost, lambda i, mode: 4, 200)
    assert "device" in modes and chooser.mode == "split" and chooser.reverted == 1
    modes = _run_batches(chooser, cost, lambda i, mode: 1, 600)
    assert "device" in modes[: ModeChooser.GATE_RETRY]  # held back at four streams alone
    assert chooser.mode == "device" and chooser.reverted == 1
    cost["device"][4], cost["split"][4] = 2.5e-3, 2.1e-3  # hot routing at four streams
    modes = _run_batches(chooser, cost, lambda i, mode: 4, 400)
    assert set(modes[: ModeChooser.NEW_SIZE]) == {"device"} and modes[-1] == "split"
    assert chooser.mode == "split" and chooser.reverted == 1


def test_at_a_size_served_in_a_mode_of_its_own_the_gates_switch_is_measured_not_awaited():
    """Four streams run split, which a load before found faster there: device's steps at
    four never come, so a trial of split from device has nothing to wait for."""
    chooser = _tried(_Prospects(("split",)))
    chooser.serve_at({4: "split"})
    cost = {"device": {4: 0.03}, "split": {4: 0.02}, "cache": {4: 0.04}}
    _run_batches(chooser, cost, lambda i, mode: 4, 5 + ModeChooser.GATE_RETRY)
    assert chooser.sampled or chooser.measuring


def test_a_switch_at_one_size_leaves_a_size_a_load_before_compared_in_its_mode():
    """A reload serving split, which the load before found faster at four streams: device,
    tried at one stream and the faster there, does not serve four streams, where split has
    no steps of this load that could judge it, nor once split, tried again at one stream,
    is taken back."""
    both = (("device", "split"), ("split", "device"))
    chooser = _tried(_Turns(), "split", both)
    chooser.serve_at({}, 4)
    cost = {"device": {1: 1.5e-3, 4: 6e-3}, "split": {1: 1.8e-3, 4: 2.5e-3}}
    modes = _run_batches(chooser, cost, lambda i, mode: 1, 300)
    assert chooser.mode == "device" and modes[-1] == "device" and chooser.by_batch == {4: "split"}
    # split, tried again at one stream, was taken back: four streams serve it still
    assert "split" in modes[-200:] and chooser.reverted == 1
    modes = _run_batches(chooser, cost, lambda i, mode: 4, 300)
    assert set(modes[: ModeChooser.GATE_RETRY - 5]) == {"split"}
    assert set(modes[-200:]) == {"split"} and chooser.reverted == 1  # measured: split


def test_a_mode_that_moves_whole_layers_sits_out_once_found_slower_at_all():
    """8 GiB of the 48-layer shape: whole CPU layers 1.47 times split's step at four streams,
    under `SLOW`, yet a visit there empties their slots: it sits out the measurement that
    one stream asks for next."""
    chooser = ModeChooser(
        settle=0,
        measure=2,
        period=4096,
        modes=("split", "layers"),
        start="split",
        explore_after=10,
        own_sizes=("split",),
    )
    cost = {"split": {1: 9.55e-3, 4: 24.1e-3}, "layers": {1: 10.86e-3, 4: 35.5e-3}}
    modes = _run_batches(chooser, cost, lambda i, mode: 4, 40)
    assert "layers" in modes and chooser.mode == "split" and chooser.batch == 4
    assert chooser.sitting_out == {"layers": ModeChooser.PRUNE}
    modes = _run_batches(chooser, cost, lambda i, mode: 1, 3 * ModeChooser.NEW_SIZE)
    assert set(modes) == {"split"}


def test_a_switch_tried_at_the_gates_word_is_taken_back_slower_by_any_margin():
    """12 layers, hot routing at one stream (H100): device tried from split served 1.51 ms a
    step against split's 1.45, inside `TRIAL_MARGIN`, and stood twice. No visit said device
    was faster, so its own steps decide: split serves again."""
    chooser = _tried(_Prospects(("device",), wait=1), "split", (("split", "device"),))
    cost = {"device": 1.51e-3, "split": 1.45e-3, "cache": 3e-3}
    _run_chooser(chooser, cost, 5 + ModeChooser.GATE_RETRY)
    assert chooser.mode == "device" and chooser.stats()["tried"]
    _run_chooser(chooser, cost, 1 + ModeChooser.TRIAL)
    assert chooser.mode == "split" and chooser.reverted == 1
