"""What every benchmark shares: the median window a row reports."""

from __future__ import annotations

from freetoken.bench import common


def test_the_middle_of_an_odd_number_is_the_median():
    rows = [{"rate": r} for r in (300.0, 100.0, 200.0)]
    assert common.middle(rows, lambda r: r["rate"]) == {"rate": 200.0}


def test_the_middle_of_an_even_number_is_the_lower_of_the_two():
    """Two windows at 190 and 212 tok/s report 190: a rate claims no more than the windows
    measured around it."""
    assert common.middle([212.0, 190.0], float) == 190.0
    assert common.middle([4.0, 1.0, 3.0, 2.0], float) == 2.0
    assert common.middle([7.0], float) == 7.0
