"""A switch on trial (moe/trial.py): judged per batch size once enough steps are in."""

from __future__ import annotations

from freetoken.moe.trial import Trial, median


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
