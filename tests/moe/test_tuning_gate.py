"""Adaptive's miss gate (moe/tuning.py, `MissWindow`): which measurements the misses of
recent decode steps leave something to gain, and when its verdict counts."""

from __future__ import annotations


def _window(lookups, capacity=1152):
    """The 12-layer, 128-expert checkpoint's window, one BF16 expert over B_P and B_H."""
    from freetoken.moe.tuning import MissWindow

    return MissWindow.of(lookups, (9.44e6 / 51.3e9, 9.44e6 / 145e9), 12, 128, capacity)


def _serve(window, totals, steps, misses, routes=96, seconds=1.8e-3):
    """`steps` one-token decode steps, each of `routes` routes and `misses` misses."""
    for _ in range(steps):
        window.ended(1)
        window.timed_step(seconds)
        totals[0] += routes - misses
        totals[1] += misses


def test_a_hot_cache_leaves_a_measurement_nothing_to_gain():
    """The 12-layer checkpoint at 75 % through the server: ~0.9 misses a 1.8 ms step, 0.17 ms
    of fetches, under SPLIT_GAIN of the step; 1.4 misses (0.26 ms) let split in, not the
    costlier visits."""
    from freetoken.moe.tuning import WINDOW_STEPS

    totals = [0, 0]
    window = _window(lambda: tuple(totals))
    assert window.promising("device") is None  # the window opens
    _serve(window, totals, WINDOW_STEPS - 1, misses=0.9)
    assert window.promising("device") is None  # too few steps yet
    _serve(window, totals, 1, misses=0.9)
    assert window.promising("device") == ()
    assert window.promising("device") is None  # judged: the next look opens a new window
    for _ in range(2):  # the first window after 0.9 misses a step is not settled
        _serve(window, totals, WINDOW_STEPS, misses=1.4)
        verdict = window.promising("device")
        window.promising("device")
    assert verdict == ("split",)
    for _ in range(2):
        _serve(window, totals, WINDOW_STEPS, misses=6)  # 1.1 ms of fetches a 1.8 ms step
        verdict = window.promising("device")
        window.promising("device")
    assert set(verdict) == {"split", "cache"}  # not layers: 3 CPU layers compute 24 routes a
    # step, 1.6 ms


def test_a_measurement_waits_for_the_misses_to_settle():
    """As routing turns near-uniform the cache warms to it: the first windows miss more than
    the settled ones, and a switch tried then is judged against those costlier steps. A
    window that would let a measurement in counts only after one with about as many misses
    a step (within SETTLED); one that lets none in counts at once."""
    from freetoken.moe.tuning import SETTLED, WINDOW_STEPS

    totals = [0, 0]
    window = _window(lambda: tuple(totals))
    verdicts = []
    for misses in (0.5, 3.2, 2.0, 1.4, 1.3, 0.6, 0.2):
        window.promising("device")  # opens a window
        _serve(window, totals, WINDOW_STEPS, misses=misses)
        verdicts.append(window.promising("device"))
    # 3.2 after 0.5, 2.0 after 3.2 (1.6 times): moving; 1.4 after 2.0 (1.43): settled;
    # 0.6 and 0.2 gain too little to measure, settled or not
    assert 2.0 / 1.4 < SETTLED < 3.2 / 2.0
    assert verdicts == [(), None, None, ("split",), ("split",), (), ()]


def test_the_gate_logs_its_verdict_where_it_changes(caplog):
    """A served run's log says which figures kept measurements out: once a verdict, not
    every window."""
    import logging

    from freetoken.moe.tuning import WINDOW_STEPS

    totals = [0, 0]
    window = _window(lambda: tuple(totals))
    with caplog.at_level(logging.INFO, logger="freetoken.moe.tuning"):
        for misses in (0.9, 0.9, 6, 6):
            window.promising("device")
            _serve(window, totals, WINDOW_STEPS, misses=misses)
            window.promising("device")
    lines = [r.getMessage() for r in caplog.records if "gate" in r.getMessage()]
    assert len(lines) == 2
    assert lines[0].startswith("adaptive: gate: 0.90 misses a step at 0.184 ms a fetch")
    assert lines[0].endswith("1.800 ms step (gain floors: split 10 %, others 15 %): no measurement")
    assert lines[1].startswith("adaptive: gate: 6.00 misses a step")
    assert lines[1].endswith(": measure split, cache")


def test_a_small_cache_near_uniform_routing_may_gain_from_whole_cpu_layers():
    from freetoken.moe.tuning import WINDOW_STEPS

    totals = [0, 0]
    window = _window(lambda: tuple(totals), capacity=256)  # 10 of 12 layers on the CPU
    for _ in range(2):  # a window, and one that agrees with it
        window.promising("device")
        _serve(window, totals, WINDOW_STEPS, misses=75, seconds=16e-3)  # uniform's misses
        verdict = window.promising("device")
    assert set(verdict) == {"split", "cache", "layers"}


def test_a_prefill_closes_the_window_and_other_modes_are_not_judged():
    from freetoken.moe.tuning import WINDOW_STEPS

    totals = [0, 0]
    window = _window(lambda: tuple(totals))
    window.promising("device")
    _serve(window, totals, WINDOW_STEPS, misses=1)
    window.ended(512)  # a prompt's prefill: its misses are not decode's
    assert window.promising("device") is None


def test_from_split_whole_cpu_layers_are_promising_only_where_they_could_gain():
    """Split's lane work is time no miss shows, so device and cache stay promising whatever
    the misses; layers not where its CPU layers' compute alone takes most of the step (the
    12-layer checkpoint at 75 %, four streams: 3 CPU layers' 384 routes, 6 ms, a 3 ms step),
    yes where the step is long beside it (10 of 12 layers on the CPU at 16 ms)."""
    from freetoken.moe.tuning import WINDOW_STEPS

    totals = [0, 0]
    window = _window(lambda: tuple(totals))
    assert window.promising("split") is None  # judged from a window of its own too
    _serve(window, totals, WINDOW_STEPS, misses=0.5, routes=384, seconds=3e-3)
    assert set(window.promising("split")) == {"device", "cache"}
    totals = [0, 0]
    window = _window(lambda: tuple(totals), capacity=256)
    window.promising("split")
    _serve(window, totals, WINDOW_STEPS, misses=40, seconds=16e-3)
    assert set(window.promising("split")) == {"device", "cache", "layers"}


def test_a_few_stalled_steps_do_not_let_whole_cpu_layers_in_from_split():
    """A window is judged by its typical step: split at one stream, 1.5 ms a step, with ten
    stalled 6 ms steps (a lane just entered, a share on trial). Their mean, 2.2 ms, would
    leave 0.6 ms beside the 3 CPU layers' 1.6 ms of compute, and a visit to layers (2.76 ms
    a step, its moves hundreds of milliseconds) came of that through the server."""
    from freetoken.moe.tuning import WINDOW_STEPS

    totals = [0, 0]
    window = _window(lambda: tuple(totals))
    window.promising("split")
    _serve(window, totals, 10, misses=2, seconds=6e-3)
    _serve(window, totals, WINDOW_STEPS - 10, misses=2, seconds=1.5e-3)
    assert set(window.promising("split")) == {"device", "cache"}
