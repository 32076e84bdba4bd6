"""The share of a layer's misses fetched over PCIe, chosen step by step by measured step time.

The costs a micro-benchmark cannot see (host round trips, thread hand-offs, the two paths
sharing host DRAM) can make the bandwidth split q* slower end to end than sending every miss
one way. So q*'s share is only the starting arm: the tuner serves one share (the incumbent)
and now and then tries another for a few steps, judging it by whole step times, not times per
miss (a share that caches less makes more misses, and per miss it would look cheaper than it
is).

A tried share is judged against the incumbent's steps just before it, never against an
average kept from other times. Step times drift by as much as shares differ: a request's
context grows, routing changes from one request to the next, and a spell of slow steps
(the first in split, a cache emptied by a visit) may fall on one share's turn. Kept as one
average a share, a share tried then stayed slow on the books and was never served again:
through the server one stream served ¾ and 1 for 1,630 steps while 0 and ¼ kept averages
from only 2 and 34 steps, and the row reached 0.72 of the bound where a
low share had served 0.91. Paired with its neighbouring steps, a share's difference from
the incumbent is its own; each share keeps its last few differences, so a change in the
machine is seen, and every share, not only the incumbent's neighbours, keeps being tried
in turn.

A trial costs the tried share's difference on each of its steps, and some shares are far
behind: at 8 GiB of the 48-layer shape, four streams, fetching every miss took 80 ms a step
more than the incumbent's 27 (H100), so trying each share in turn, every share about every
200 steps, spent some 7 % of the time on trials. So a share is tried again only once the
steps since its last trial have paid for the next at `explore` of their time, shared by the
shares: one a whole step behind waits hundreds of steps, one within a few percent is tried
as often as before.

Each batch size keeps its own books: four sequences' step is not one's, and through the
server one and four streams come and go in turn. A size seen first starts from the share
found best at the nearest size already measured (q*'s where none is).

A step's time counts for its share only where the step before it ran the same share at the
same size: a step launched before the last one's tokens are read is timed as the one before
it ends, so a share tried for a single step would be credited with its neighbour's time. So
a share tried is kept `HOLD` steps, and its first is not counted.

Where the CPU lane has a team of workers, an arm is a share and the part of the team its
requests run on (the setting FREETOKEN_LANE_TEAMS): the lane's workers spin on their cores,
and the threads that wake during a step (the engine's, the server's, the CUDA driver's)
wait for a core. A smaller team leaves them cores and reads host memory with fewer threads.
Where the setting lists several parts, which is faster is measured here as the share is;
by default one part (the whole team) serves, as through the server the trials of both cost
more than they found (config_experts.py has the figures).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

ARMS = (0.0, 0.25, 0.5, 0.75, 1.0)  # shares of a layer's misses fetched over PCIe


@dataclass(frozen=True)
class Arm:
    share: float  # of a layer's misses fetched over PCIe
    team: float = 1.0  # of the lane's team its requests run on


def arms_of(teams: tuple[float, ...]) -> tuple[Arm, ...]:
    """Every share with every part of the team, but one arm where every miss is fetched:
    the lane then computes nothing, and its team cannot matter."""
    return tuple(Arm(s, t) for s in ARMS for t in teams if s < 1 or t == teams[0])


@dataclass
class _Books:
    """One batch size's measurements, a list entry an arm."""

    best: int  # the incumbent: the arm served between trials
    # each arm's last paired differences from the incumbent (seconds a step slower)
    diffs: list[list[float]]
    trials: list[int]  # paired comparisons an arm
    last: list[int]  # the counted step (at this size) each was last tried at
    mean: list[float | None]  # an arm's step time, as a figure
    steps: list[int]
    before: list[float] = field(default_factory=list)  # the incumbent's steps since a trial
    trial: list[float] = field(default_factory=list)  # the running trial's steps

    @classmethod
    def new(cls, best: int, arms: int) -> _Books:
        return cls(
            best, [[] for _ in range(arms)], [0] * arms, [-1] * arms, [None] * arms, [0] * arms
        )

    def behind(self, arm: int) -> float | None:
        """Seconds a step `arm` is slower than the incumbent: the median of its last paired
        differences, so the trials of a passing spell that slows some shares by more than the
        shares differ are outvoted, not averaged in."""
        if arm == self.best:
            return 0.0
        return statistics.median(self.diffs[arm]) if self.diffs[arm] else None

    def compared(self) -> bool:
        """Every share has been compared with the incumbent at least once."""
        return all(n >= 1 for i, n in enumerate(self.trials) if i != self.best)

    def settle(self, arm: int) -> None:
        """The trial of `arm` ended: its steps against the incumbent's just before."""
        if self.trial and self.before:
            diff = sum(self.trial) / len(self.trial) - sum(self.before) / len(self.before)
            self.diffs[arm] = (self.diffs[arm] + [diff])[-ShareTuner.WINDOW :]
            self.trials[arm] += 1
            self.last[arm] = sum(self.steps)
            gain = self.behind(arm)
            if len(self.diffs[arm]) >= ShareTuner.SWITCH_AFTER and gain is not None and gain < 0:
                self._promote(arm, gain)
        self.before.clear()
        self.trial.clear()

    def _promote(self, arm: int, gain: float) -> None:
        """`arm` serves from now on; every difference is taken against it instead."""
        won = self.diffs[arm]
        self.diffs = [[d - gain for d in ds] for ds in self.diffs]
        self.diffs[self.best], self.diffs[arm] = [-d for d in won], []
        self.trials[self.best] = max(self.trials[self.best], self.trials[arm])
        self.last[self.best] = self.last[arm]
        self.best = arm


class ShareTuner:
    """Which share of a layer's misses goes over PCIe, and which part of the lane's team
    computes the rest (`teams`, where the lane has workers to spare), by paired
    step-time trials (above)."""

    ARMS = ARMS
    HOLD = 3  # steps a tried share is kept; its first is not counted
    BEFORE = 2  # the incumbent's counted steps a trial is paired with
    FIRST_TRIALS = 2  # each share is compared this often before trials are drawn at random
    SWITCH_AFTER = 2  # a share must have been compared this often to become the incumbent
    WINDOW = 5  # paired differences kept a share

    def __init__(
        self,
        prior: float,
        explore: float = 0.06,
        alpha: float = 0.2,
        seed: int = 0,
        teams: tuple[float, ...] = (1.0,),
        prior_team: float = 1.0,
    ):
        self.arms = arms_of(teams)
        self.prior = min(
            range(len(self.arms)),
            key=lambda i: (abs(self.arms[i].share - prior), abs(self.arms[i].team - prior_team)),
        )
        self.arm = self.prior
        self.batch = 1  # the batch size of the step the arm was chosen for
        self.explore, self.alpha = explore, alpha
        self._rng = random.Random(seed)
        self._books: dict[int, _Books] = {}
        self._before = (self.arm, self.batch)  # the share and size of the step before
        self._held = 0  # steps the tried share is still kept

    @property
    def share(self) -> float:
        return self.arms[self.arm].share

    @property
    def team(self) -> float:
        return self.arms[self.arm].team

    @property
    def mean(self) -> list[float | None]:
        """The current batch size's step time an arm (None: not yet run)."""
        books = self._books.get(self.batch)
        return list(books.mean) if books else [None] * len(self.arms)

    @property
    def count(self) -> list[int]:
        """The current batch size's counted steps an arm."""
        books = self._books.get(self.batch)
        return list(books.steps) if books else [0] * len(self.arms)

    def observe(self, seconds: float, batch: int = 1) -> None:
        """The decode step just run with the current share, of `batch` sequences, took
        `seconds` (or the step before it, which counts alike only in the same share)."""
        books = self._books.get(batch)
        if seconds <= 0 or books is None or self._before != (self.arm, batch):
            return
        i, old = self.arm, books.mean[self.arm]
        books.mean[i] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds
        books.steps[i] += 1
        if i == books.best:
            books.before = (books.before + [seconds])[-self.BEFORE :]
        else:
            books.trial.append(seconds)

    def next_arm(self, batch: int = 1) -> float:
        """The share for the next step, of `batch` sequences."""
        self._before = (self.arm, self.batch)
        if batch != self.batch or batch not in self._books:
            return self._enter(batch)
        books = self._books[batch]
        if self._held:
            self._held -= 1
            return self.share
        if self.arm != books.best:  # a trial ended
            books.settle(self.arm)
            self.arm = books.best
        elif len(books.before) >= self.BEFORE and self._try_now(books):
            self.arm, self._held = self._challenger(books), self.HOLD - 1
        return self.share

    def _enter(self, batch: int) -> float:
        """Steps of another size: a trial under way is dropped (its pairing is broken) and
        the size serves its incumbent, which a size seen first takes from its neighbours."""
        if self.batch in self._books:
            old = self._books[self.batch]
            old.trial.clear()
            old.before.clear()
        books = self._books.get(batch)
        if books is None:
            books = self._books[batch] = _Books.new(self._start_arm(batch), len(self.arms))
        books.before.clear()
        self.batch, self.arm, self._held = batch, books.best, 0
        return self.share

    def _try_now(self, books: _Books) -> bool:
        others = [i for i in range(len(self.arms)) if i != books.best]
        if min(books.trials[i] for i in others) < self.FIRST_TRIALS:
            return True
        if self._rng.random() >= self.explore / self.HOLD:  # `explore` of the steps
            return False
        return any(self._due(books, i) for i in others)

    def _due(self, books: _Books, arm: int) -> bool:
        """Whether `arm` may be tried again: a trial costs the arm's difference from the
        incumbent on each of its steps, so an arm far behind waits until the steps since its
        last trial have paid for the next at `explore` of their time, shared by the arms."""
        behind, step = books.behind(arm), books.mean[books.best]
        if not behind or behind <= 0 or not step:
            return True
        wait = (len(self.arms) - 1) * self.HOLD * behind / (self.explore * step)
        return sum(books.steps) - books.last[arm] >= wait

    def _challenger(self, books: _Books) -> int:
        """A share compared too few times yet, nearest the incumbent first; else, of those
        due, the one compared longest ago, so every share's differences stay current."""
        others = [i for i in range(len(self.arms)) if i != books.best]
        fresh = [i for i in others if books.trials[i] < self.FIRST_TRIALS]
        if fresh:
            return min(fresh, key=lambda i: (books.trials[i], abs(i - books.best)))
        due = [i for i in others if self._due(books, i)] or others
        return min(due, key=lambda i: books.last[i])

    def _start_arm(self, batch: int) -> int:
        """The incumbent of the measured size nearest `batch`, else the prior's."""
        done = [b for b, k in self._books.items() if b != batch and k.compared()]
        if not done:
            return self.prior
        return self._books[min(done, key=lambda b: (abs(b - batch), b))].best

    def stats(self) -> dict:
        def ms(values: list[float | None]) -> list[float | None]:
            return [None if v is None else v * 1e3 for v in values]

        return {
            "share": self.share,
            "team": self.team,
            "arms": [a.share for a in self.arms],
            "teams": [a.team for a in self.arms],
            "step_ms": ms(self.mean),
            "steps": self.count,
            "by_batch": {
                b: {
                    "best": self.arms[k.best].share,
                    "best_team": self.arms[k.best].team,
                    "step_ms": ms(k.mean),
                    "steps": list(k.steps),
                    "behind_ms": ms([k.behind(i) for i in range(len(self.arms))]),
                    "trials": list(k.trials),
                }
                for b, k in sorted(self._books.items())
            },
        }
