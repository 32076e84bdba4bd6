"""Adaptive's tuner (moe/tuning.py): the steps it times and charges, the placement it predicts,
the locality check, and the tuner driven by the engine as served."""

from __future__ import annotations

import pytest

from freetoken.moe.policy import Mode
from tests.runtime.engine_util import generate, make_engine


@pytest.mark.gpu
def test_adaptive_measures_when_steps_are_launched_ahead(tiny_model, monkeypatch):
    """With decode ahead a step is launched right behind the one before, so the first
    interval after a prefill is a fraction of a step's. Once that seeded the running step
    time, every later step was dropped as idle time and the chooser never made a visit
    (through the server on the H200: no move in 1,500 steps)."""
    from freetoken.moe import tuning
    from freetoken.moe.chooser import ModeChooser

    monkeypatch.setattr(tuning, "EXPLORE_AFTER", 16)
    # the tiny model's modes are a close call: decided on the rounds asked for, in the
    # steps this test serves, not on up to four more
    monkeypatch.setattr(ModeChooser, "EXTRA_ROUNDS", 0)
    monkeypatch.setattr(tuning, "DUTY", 1.0)
    monkeypatch.setattr(tuning, "MIN_GAIN", 0.0)  # measure whatever the misses
    monkeypatch.setattr(tuning, "SPLIT_GAIN", 0.0)
    # the first window only opens the count (no window before it to agree with), the
    # second decides: windows of 24 steps leave the chooser most of the steps to measure
    monkeypatch.setattr(tuning, "SETTLED", float("inf"))
    monkeypatch.setattr(tuning, "WINDOW_STEPS", 24)
    # the gate is asked every GATE_RETRY steps, and a verdict takes four asks (open, judge
    # the first window, open, judge): at 64 steps apart, more steps than this test serves
    monkeypatch.setattr(ModeChooser, "GATE_RETRY", 8)
    path, _ = tiny_model
    engine = make_engine(
        path,
        policy="adaptive",
        slots=9,
        device="cuda",
        graphs="capture",
        device_cache="on",
        overlap=True,
    )
    backend = engine.model.model.layers[0].mlp.experts.backend
    try:
        moves = backend.tuner.moves
        for _ in range(4):
            generate(engine, [[5, 6, 7, 8]], 48)
        assert engine.ahead_steps > 0  # the steps did run ahead
        assert backend.tuner.moves > moves and backend.tuner.modes.means
    finally:
        if backend.lane is not None:
            backend.lane.stop()


def test_the_tuner_charges_a_move_and_the_step_after_it(monkeypatch):
    from freetoken.moe import tuning
    from freetoken.moe.policy import Mode

    clock = [0.0]
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: clock[0])
    tuner = tuning.AdaptiveTuner(0.5, (Mode.DEVICE, Mode.LAYERS))
    charged = []
    monkeypatch.setattr(tuner.modes, "charge", charged.append)
    observed = []
    monkeypatch.setattr(tuner.modes, "observe", lambda s, b=1, ran=None: observed.append(s))
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


def test_the_tuner_serves_each_batch_size_in_the_mode_found_faster_there(monkeypatch):
    """Split faster at one stream, device at four: once a switch to split was judged at
    four streams, each step asks for its own size's mode, and moves as the batch changes."""
    from freetoken.moe import tuning

    clock = [0.0]
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: clock[0])
    tuner = tuning.AdaptiveTuner(0.5, (Mode.DEVICE, Mode.SPLIT))
    tuner.modes = tuning.ModeChooser(  # serving from device, measuring after 40 steps
        settle=0,
        measure=2,
        period=1000,
        modes=("device", "split"),
        start="device",
        explore_after=40,
    )
    cost = {Mode.DEVICE: {1: 0.015, 4: 0.03}, Mode.SPLIT: {1: 0.010, 4: 0.05}}
    mode, ran = Mode.DEVICE, []
    for i in range(260):  # four streams, then one (the measurement), then four, then one
        batch = 4 if i < 20 or 120 <= i < 220 else 1
        tuner.step_started(batch, mode)  # times the step before, run in `mode`
        if (want := tuner.wanted(batch, mode)) != mode:
            tuner.moved(mode, want)
            mode = want
        ran.append((batch, mode))
        clock[0] += cost[mode][batch]
    assert (1, Mode.SPLIT) in ran[40:120] and ran[119] == (1, Mode.SPLIT)
    assert ran[219] == (4, Mode.DEVICE) and ran[-1] == (1, Mode.SPLIT)
    assert tuner.wanted(4, Mode.SPLIT) == Mode.DEVICE and tuner.wanted(1, Mode.DEVICE) == Mode.SPLIT
    # whole CPU layers move experts at every entry and exit: never a size's own mode
    every = tuning.AdaptiveTuner(0.5, (Mode.DEVICE, Mode.SPLIT, Mode.LAYERS))
    assert every.modes.own_sizes == (Mode.DEVICE, Mode.SPLIT)


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


def test_locality_judges_early_where_the_misses_are_far_over_the_bar():
    """A small cache's device steps are dear: after EARLY_STEPS, misses at EARLY_MARGIN of
    the bar or more take the prediction at once; fewer wait for the whole check."""
    from freetoken.moe import locality, tuning

    def tuner_after(steps, rate):
        tuner = tuning.AdaptiveTuner(0.5, None)
        tuner.modes = tuning.ModeChooser(
            modes=("device", "split"), start="device", explore_after=512
        )
        tuner.locality = check = locality.LocalityCheck(Mode.SPLIT, 0.85, cost_ratio=0.33)
        totals = [0, 0]
        tuner.judge_locality(lambda: tuple(totals))  # the first decode step opens the check
        for _ in range(steps):
            totals[0] += round(384 * (1 - rate))
            totals[1] += round(384 * rate)
            tuner.judge_locality(lambda: tuple(totals))
        return tuner, check

    far = locality.EARLY_MARGIN * 0.33 * 0.85 + 0.02  # 8 GiB of the 48-layer shape: ~0.57
    tuner, _ = tuner_after(locality.EARLY_STEPS, far)
    assert tuner.locality is None and tuner.modes.mode == "split"
    tuner, check = tuner_after(locality.EARLY_STEPS, check_rate := 0.3)  # over the bar, not far
    assert tuner.locality is check and tuner.modes.mode == "device"
    tuner, _ = tuner_after(locality.LOCALITY_STEPS, check_rate)
    assert tuner.locality is None and tuner.modes.mode == "split"
    tuner, _ = tuner_after(locality.LOCALITY_STEPS, 0.1)  # locality: device keeps serving
    assert tuner.locality is None and tuner.modes.mode == "device"


def test_a_locality_verdict_during_a_measurement_changes_nothing():
    """A measurement under way decides: the verdict is not adopted, device sits nothing out,
    and nothing is kept for the next load (the mode in use is a visit's)."""
    from freetoken.moe import locality, tuning

    tuner = tuning.AdaptiveTuner(0.5, None)
    tuner.modes = tuning.ModeChooser(modes=("device", "split", "layers"), start="device")
    visiting = tuner.modes.mode
    tuner.locality = locality.LocalityCheck(Mode.SPLIT, 0.85, cost_ratio=0.33)
    saved = []
    tuner.on_measured = saved.append
    totals = [0, 0]
    tuner.judge_locality(lambda: tuple(totals))
    for _ in range(locality.LOCALITY_STEPS):
        totals[0], totals[1] = totals[0] + 40, totals[1] + 344
        tuner.judge_locality(lambda: tuple(totals))
    assert tuner.locality is None  # judged
    assert tuner.modes.mode == visiting and not tuner.modes.sitting_out and not saved


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


def test_each_decision_is_logged_with_the_times_it_compared(monkeypatch, caplog):
    """A served run's choices are read back from its log: one line a decision."""
    from freetoken.moe import tuning

    monkeypatch.setattr(tuning, "EXPLORE_AFTER", 4)
    monkeypatch.setattr(tuning, "DUTY", 1.0)
    clock = [0.0]
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: clock[0])
    tuner = tuning.AdaptiveTuner(0.5, (Mode.DEVICE, Mode.SPLIT))
    cost = {Mode.DEVICE: 0.002, Mode.SPLIT: 0.001}
    mode = Mode.DEVICE
    with caplog.at_level("INFO", logger=tuning.__name__):
        for _ in range(200):
            tuner.step_started(1, mode)
            clock[0] += cost[mode]
            mode = tuner.wanted(1, mode)
    lines = [r.getMessage() for r in caplog.records if "step ms" in r.getMessage()]
    assert lines and tuner.modes.mode == "split"
    assert lines[0].startswith("adaptive: step ms device 2.00, split 1.00 (compared at 1 streams)")
    assert "serving split" in lines[0]
    # the samples behind it: each mode's 12 measured steps (two visits), all at one stream
    assert lines[0].endswith("visits' steps@streams: device 12@1; split 12@1")


def test_a_decision_on_served_steps_logs_them_beside_the_visits(monkeypatch, caplog):
    """Where the mode in use is judged by its steps served before the visits, the line says
    how many, and what its own visits gave: a served reference from other work (a hotter
    regime before this one) shows as the two disagreeing."""
    from freetoken.moe import tuning

    monkeypatch.setattr(tuning, "EXPLORE_AFTER", 40)
    monkeypatch.setattr(tuning, "DUTY", 1.0)
    clock = [0.0]
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: clock[0])
    tuner = tuning.AdaptiveTuner(0.5, (Mode.DEVICE, Mode.SPLIT))
    mode = Mode.DEVICE
    with caplog.at_level("INFO", logger=tuning.__name__):
        for i in range(200):
            tuner.step_started(1, mode)
            served = i < 40  # before the measurement device serves at 3 ms, visited at 2
            clock[0] += 0.003 if served else {Mode.DEVICE: 0.002, Mode.SPLIT: 0.001}[mode]
            mode = tuner.wanted(1, mode)
    lines = [r.getMessage() for r in caplog.records if "step ms" in r.getMessage()]
    assert lines[0].startswith("adaptive: step ms device 3.00, split 1.00 (compared at 1 streams)")
    served = tuner.modes.stats()["served_ref"]
    assert served is not None and served[0] >= tuning.ModeChooser.MIN_SERVED
    assert lines[0].endswith(
        f"device 12@1; split 12@1; in use judged by {served[0]} served steps (visits 2.00)"
    )


def test_a_gate_that_names_split_puts_it_on_trial_at_once_and_logs_so(monkeypatch, caplog):
    """Books on the device: a window of uniform's misses names split, which serves at once,
    no visit before, on trial against device's served steps; the decision's line says so."""
    from freetoken.moe import tuning

    monkeypatch.setattr(tuning, "EXPLORE_AFTER", 4)
    clock, totals = [0.0], [0, 0]
    monkeypatch.setattr(tuning.time, "perf_counter", lambda: clock[0])
    tuner = tuning.AdaptiveTuner(0.5, (Mode.DEVICE, Mode.SPLIT))
    costs = (9.44e6 / 51.3e9, 9.44e6 / 145e9)  # one BF16 expert over B_P and B_H
    modes = (Mode.DEVICE, Mode.SPLIT)
    tuner.choose(modes, {"mode": "device"}, (12, 128, 1152), costs, lambda: tuple(totals), True)
    cost, mode, served = {Mode.DEVICE: 0.0025, Mode.SPLIT: 0.0018}, Mode.DEVICE, []
    with caplog.at_level("INFO", logger=tuning.__name__):
        for _ in range(4 + 5 * tuning.WINDOW_STEPS):  # two windows: the second settles it
            tuner.step_started(1, mode)
            clock[0] += cost[mode]
            totals[0], totals[1] = totals[0] + 90, totals[1] + 6
            mode = tuner.wanted(1, mode)
            served.append(mode)
    assert Mode.SPLIT in served and tuner.modes.mode == "split" and not tuner.modes.measuring
    assert set(served[: served.index(Mode.SPLIT)]) == {Mode.DEVICE}  # no visit before
    lines = [r.getMessage() for r in caplog.records if "step ms" in r.getMessage()]
    assert len(lines) == 2 and lines[0].startswith("adaptive: step ms device 2.50 (")
    assert lines[0].endswith("visits' steps@streams: none: on trial at the gate's word")
    # the trial's verdict: split's served steps, and it stands
    assert lines[1].startswith("adaptive: step ms device 2.50, split 1.80 (compared at 1")


def test_the_setting_keeps_adaptive_to_the_placements_it_names(monkeypatch, caplog):
    """FREETOKEN_ADAPTIVE_MODES=split: adaptive serves split alone (no locality check, no
    visit to device), its share still tuned; a list naming nothing this machine offers
    leaves every placement, with a warning."""
    from freetoken import config
    from freetoken.moe import tuning

    costs = (9.44e6 / 51.3e9, 9.44e6 / 145e9)
    every = (Mode.DEVICE, Mode.SPLIT, Mode.LAYERS)
    for names, want in (("split", ("split",)), ("layers,split", ("split", "layers"))):
        monkeypatch.setenv("FREETOKEN_ADAPTIVE_MODES", names)
        config.current.cache_clear()
        tuner = tuning.AdaptiveTuner(0.5, None)
        tuner.choose(every, None, (12, 128, 1152), costs, lambda: (0, 0), True)
        assert tuple(map(str, tuner.modes.modes)) == want and tuner.locality is None
        assert tuner.wanted(1, Mode.DEVICE) in tuner.modes.modes
    monkeypatch.setenv("FREETOKEN_ADAPTIVE_MODES", "cache")
    config.current.cache_clear()
    tuner = tuning.AdaptiveTuner(0.5, None)
    with caplog.at_level("WARNING", logger=tuning.__name__):
        tuner.choose(every, None, (12, 128, 1152), costs, lambda: (0, 0), True)
    assert tuple(tuner.modes.modes) == every and "none of cache" in caplog.text
    monkeypatch.undo()
    config.current.cache_clear()


def test_adaptive_kept_to_split_serves_split_with_transformers_tokens(tiny_model, monkeypatch):
    """Through the engine (CPU, books on the device, the lane): FREETOKEN_ADAPTIVE_MODES=split
    serves every decode step in split and gives transformers' greedy tokens."""
    from freetoken import config
    from tests import fixtures

    monkeypatch.setenv("FREETOKEN_ADAPTIVE_MODES", "split")
    config.current.cache_clear()
    path, hf = tiny_model
    engine = make_engine(
        path, policy="adaptive", slots=9, device="cpu", device_cache="on", cpu_lane="on"
    )
    backend = engine.model.model.layers[0].mlp.experts.backend
    try:
        assert tuple(map(str, backend.tuner.modes.modes)) == ("split",)
        p = [(7 * i) % 500 + 1 for i in range(20)]
        (seq,) = generate(engine, [p], 16)
        assert seq.output_ids == fixtures.hf_greedy(hf, p, 16)
        assert backend.placement.mode == Mode.SPLIT and backend.tuner.moves == 1
    finally:
        if backend.lane is not None:
            backend.lane.stop()
        monkeypatch.undo()
        config.current.cache_clear()
