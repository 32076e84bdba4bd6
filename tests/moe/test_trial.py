"""A switch on trial (moe/trial.py): judged per batch size once enough steps are in."""

from __future__ import annotations

from freetoken.moe.trial import GateTrials, Served, Trial, median


def test_a_trial_skips_the_moves_steps_then_judges_each_size_once():
    trial = Trial("device", {1: 1.6e-3, 4: 2.5e-3}, settle=2)
    assert trial.judge(1, 9.0, 3) is None and trial.judge(1, 9.0, 3) is None  # the move's
    assert trial.judge(2, 1.0, 3) is None  # a size the old mode did not serve: not judged
    assert trial.judge(1, 1.7e-3, 3) is None and trial.judge(1, 1.5e-3, 3) is None
    assert trial.judge(1, 1.8e-3, 3) == (1.7e-3, 1.6e-3)  # the new median, the old time
    assert trial.old_time == {4: 2.5e-3}  # judged: one stream leaves, four still waits
    assert trial.judge(1, 1.0e-3, 3) is None


def test_the_median_of_an_even_count_is_the_upper_middle():
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 3.0


def test_served_steps_are_a_reference_only_while_fresh():
    served = Served(keep=3, fresh=10)
    for i in range(5):
        served.now += 1
        served.record("split", 4, float(i))
    assert list(served.at("split", 4)) == [2.0, 3.0, 4.0]  # the latest `keep`
    assert served.at("device", 4) == () and served.of("device") == {}
    served.now += 10
    assert list(served.of("split")[4]) == [2.0, 3.0, 4.0]  # ten steps on: still fresh
    served.now += 1
    assert served.at("split", 4) == () and served.of("split") == {}  # from other work
    served.record("split", 4, 9.0)  # a new run starts: the old one is not its reference
    assert list(served.at("split", 4)) == [9.0]


def test_a_mode_taken_back_at_one_size_waits_there_alone():
    gate = GateTrials((("split", "device"),), after=10)
    assert gate.pick("split", ("device",), {}, 4, 0) == "device"
    gate.taken_back("device", 4, 0)
    assert gate.pick("split", ("device",), {}, 4, 0) is None
    assert gate.waits("split", "device", 4, 0)
    assert gate.pick("split", ("device",), {}, 1, 0) == "device"  # another size: at once
    assert gate.pick("split", ("device",), {"device": 1}, 1, 0) is None  # sitting out
    assert gate.pick("split", ("device",), {}, 4, 10) == "device"
    gate.taken_back("device", 4, 10)
    assert gate.waits("split", "device", 4, 29)  # twice as long the second time
    assert not gate.waits("split", "device", 4, 30)


def test_a_trial_that_lost_much_waits_longer_to_be_tried_again():
    """Forty steps 40 % slower lost 16 steps' time: at most `share` of those until the next
    trial there."""
    gate = GateTrials((("split", "device"),), after=10, share=0.02)
    gate.taken_back("device", 4, 0, lost=40 * 0.4)
    assert gate.waits("split", "device", 4, 799) and not gate.waits("split", "device", 4, 800)
    gate.taken_back("device", 1, 0, lost=0.1)  # next to nothing lost: `after`
    assert not gate.waits("split", "device", 1, 10)
