"""How the placement chooser judges: a switch on trial, the median of step times, the batch
size modes are compared at, and the gate asked before a measurement."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class Prospects(Protocol):
    """Which other modes a measurement starting now could find faster than `mode` (in use),
    judged from the work being served; None while there is not yet enough of it to judge.
    Either way, or with no mode named, it is asked again `GATE_RETRY` steps later."""

    def promising(self, mode: str) -> tuple[str, ...] | None: ...


@dataclass
class Trial:
    """A switch on trial: the mode it left and that mode's step time by batch size. The new
    mode's steps served at each of those sizes (after the first `settle` of the trial, which
    follow the move) are judged once `TRIAL` of them are in.

    A verdict that contradicts the visits (the new mode `margin` slower where its visits,
    `visits` by batch size, found it `margin` faster) is taken twice: on an H100 split's
    visits at four streams took 2.71 ms a step against device's 3.62, its trial (32 steps
    outside the timed windows, as streams came and went) 4.28, and the revert kept device
    for the rest of the run, at 0.68 of the bound where split's visits came to 0.89. The
    second verdict stands, whichever it is."""

    old: str
    old_time: dict[int, float]
    settle: int
    visits: dict[int, float] = field(default_factory=dict)
    margin: float = 0.0
    samples: dict[int, list[float]] = field(default_factory=dict)
    steps: int = 0
    doubted: bool = False  # a verdict against the visits was set aside once

    def judge(self, batch: int, seconds: float, n: int) -> tuple[float, float] | None:
        """Takes a served step of `batch` sequences. Once `n` are in at that size: the new
        mode's median there and the old mode's time (the size is then judged, and leaves
        `old_time`); else None, and None too for the first verdict against the visits (its
        samples are dropped and `n` more taken)."""
        self.steps += 1
        if self.steps <= self.settle or batch not in self.old_time:
            return None
        got = self.samples.setdefault(batch, [])
        got.append(seconds)
        if len(got) < n:
            return None
        served, old = median(got), self.old_time[batch]
        if not self.doubted and self._against_visits(batch, served, old):
            self.doubted = True
            self.samples.pop(batch)
            return None
        return served, self.old_time.pop(batch)

    def _against_visits(self, batch: int, served: float, old: float) -> bool:
        visits = self.visits.get(batch)
        slower = served > old * (1 + self.margin)
        return slower and visits is not None and visits * (1 + self.margin) < old


def median(values) -> float:
    s = sorted(values)
    return s[len(s) // 2]


def most_sampled(samples: dict[str, dict[int, list[float]]]) -> int | None:
    """The batch size every mode was measured at, the one with the most samples of its least
    sampled mode (the smaller on a tie); None where the modes share no size."""
    common = set.intersection(*(set(b) for b in samples.values())) if samples else set()
    if not common:
        return None
    return max(common, key=lambda b: (min(len(samples[m][b]) for m in samples), -b))
