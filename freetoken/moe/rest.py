"""The rest after a measurement's visit: steps served in the best mode known until what the
visit cost the user is repaid, so visits take about `duty` of the time (ModeChooser)."""

from __future__ import annotations

import math


class Rest:
    """Rations a measurement's visits by time, not steps: after a visit that cost `excess`
    seconds over the mode in use, the best mode serves for that excess times (1 − duty) /
    duty, and for a number of steps scaled alike from a visit's `visit_steps`."""

    def __init__(self, visit_steps: int, duty: float):
        self.steps = 0 if duty >= 1 else int(-(-visit_steps * (1 - duty) // duty))
        self.pause = 0.0 if duty >= 1 else (1 - duty) / duty  # rest seconds a visit second
        self.left = 0  # steps left before the next visit
        self.left_s = 0.0  # and seconds

    def __bool__(self) -> bool:
        """Whether a rest is under way."""
        return bool(self.left)

    def begin(self, excess: float, visit_s: float) -> None:
        """A visit of `visit_s` seconds ended, `excess` of them over the mode in use's."""
        self.left = math.ceil(self.steps * excess / visit_s)
        self.left_s = excess * self.pause

    def served(self, seconds: float) -> bool:
        """A step of the rest took `seconds`; whether the rest is over (both its steps and
        its time served)."""
        self.left_s -= seconds
        if self.left > 1 or self.left_s > 0:
            self.left = max(1, self.left - 1)
            return False
        self.left = 0
        return True

    def charge(self, seconds: float) -> None:
        """A move during the rest took `seconds`: the rest grows to repay it."""
        self.left_s += seconds * self.pause
