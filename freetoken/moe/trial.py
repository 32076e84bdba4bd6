"""How the placement chooser judges: a switch on trial, the median of step times, the batch
size modes are compared at, and the gate asked before a measurement."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
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
    tried: bool = False  # put on trial at the gate's word, with no visits behind it
    own: dict[int, str] = field(default_factory=dict)  # sizes' own modes before: kept if reverted
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


@dataclass
class GateTrials:
    """The switches (`pairs`: from, to) the gate's word puts on trial at once, no visits
    before: ones that move no expert, so that the trial costs next to nothing where the
    gate was wrong, while a measurement's visits and rests take seconds. A mode taken back
    at a batch size is tried again there `after` steps later, or later still where the
    trial lost more than `share` of those steps, twice as long for each time it was taken
    back; at other sizes at once (through the server at 12 layers, device, four times slower
    than split at four streams, was held back at one stream too, where it was the faster).
    Through the server at 12 layers (H100) device, 20-40 % slower than split at four streams
    of near-uniform routing, was tried four times in 1,500 steps there, and the repeats with
    a trial ran at 0.79-0.81 of the bound, the one without at 0.92."""

    pairs: tuple[tuple[str, str], ...] = ()
    after: int = 192
    share: float = 0.02
    _again: dict[tuple[str, int], int] = field(default_factory=dict)  # when it may be tried
    _times: dict[tuple[str, int], int] = field(default_factory=dict)  # times taken back

    def pick(
        self,
        mode: str,
        promising: tuple[str, ...],
        sitting_out: dict[str, int],
        batch: int,
        now: int,
    ) -> str | None:
        """The mode to try at once instead of `mode` at `batch`, at step `now`, of those the
        gate named; None if none."""
        for new in promising:
            if (mode, new) in self.pairs and not sitting_out.get(new):
                if not self.waits(mode, new, batch, now):
                    return new
        return None

    def waits(self, mode: str, new: str, batch: int, now: int) -> bool:
        """Whether the switch from `mode` to `new` at `batch` waits, at step `now`, to be tried
        again (nor is it measured meanwhile)."""
        return (mode, new) in self.pairs and now < self._again.get((new, batch), 0)

    def taken_back(self, mode: str, batch: int, now: int, lost: float = 0.0) -> None:
        """A trial of `mode` at `batch` took the old mode back at step `now`, having lost
        `lost` steps' time (its steps over the old mode's)."""
        times = self._times[mode, batch] = self._times.get((mode, batch), 0) + 1
        wait = max(self.after, lost / self.share)
        self._again[mode, batch] = now + int(wait) * 2 ** min(times - 1, 4)


class Served:
    """Each mode's last `keep` step times served between measurements, by batch size: what a
    switch away from it is judged against. A step is a reference only for the work it
    served, so a size's run that broke off more than `fresh` steps ago counts as none, and
    a new one starts (through the server at 12 layers, split's four-stream steps of
    near-uniform routing judged device's of hot routing two thousand steps later, and device
    stood there, at 0.77 of the bound)."""

    def __init__(self, keep: int, fresh: int):
        self.keep, self.fresh = keep, fresh
        self.now = 0  # steps observed: the chooser's clock
        self._steps: dict[str, dict[int, deque[float]]] = {}
        self._last: dict[tuple[str, int], int] = {}  # the step each run last grew

    def record(self, mode: str, batch: int, seconds: float) -> None:
        by_batch = self._steps.setdefault(mode, {})
        kept = by_batch.get(batch)
        if kept is None or not self._fresh(mode, batch):  # every step: no new deque unless due
            kept = by_batch[batch] = deque(maxlen=self.keep)
        kept.append(seconds)
        self._last[mode, batch] = self.now

    def _fresh(self, mode: str, batch: int) -> bool:
        last = self._last.get((mode, batch))
        return last is not None and self.now - last <= self.fresh

    def at(self, mode: str, batch: int) -> Sequence[float]:
        """`mode`'s steps at `batch`, the latest last; none where they are stale."""
        return self._steps.get(mode, {}).get(batch, ()) if self._fresh(mode, batch) else ()

    def of(self, mode: str) -> dict[int, Sequence[float]]:
        """`mode`'s steps by batch size, the stale ones left out."""
        return {b: d for b, d in self._steps.get(mode, {}).items() if self._fresh(mode, b)}


def against_served(
    samples: dict[str, dict[int, list[float]]],
    home: str,
    served: dict[int, Sequence[float]],
    least: int,
) -> tuple[int, dict[str, float]] | None:
    """With no size in common (streams came and went between the visits), each visited mode
    against the mode in use's (`home`) steps `served` at a size of its own visits (where it
    served `least`), scaled to the size `home` served most: that size, and the modes judged
    this way and `home` by their time there; None where none could be."""
    ref = {b: median(d) for b, d in served.items() if len(d) >= least}
    if not ref:
        return None
    batch = max(ref, key=lambda b: (len(served[b]), -b))
    means = {home: ref[batch]}
    for mode, by_batch in samples.items():
        if mode == home or not (sizes := [b for b in by_batch if b in ref]):
            continue
        b = max(sizes, key=lambda b: (len(by_batch[b]), -b))
        means[mode] = median(by_batch[b]) / ref[b] * ref[batch]
    return (batch, means) if len(means) > 1 else None


def close_call(samples: dict[str, dict[int, list[float]]], close: float) -> bool:
    """Whether every mode's samples so far are within `close` of the fastest's at the size
    they share most (two modes or more)."""
    if len(samples) < 2 or (batch := most_sampled(samples)) is None:
        return False
    medians = [median(by_batch[batch]) for by_batch in samples.values()]
    return max(medians) <= min(medians) * (1 + close)
