"""How a layer's cache misses are split between PCIe fetches and in-place CPU execution.

With per-expert costs c_P = S/B_P and c_H = S/B_H, fetching q of m misses takes q·c_P and
computing the rest on the CPU takes (m−q)·c_H, at the same time. The split that balances
them is q* = m·B_P/(B_P+B_H); it is rounded to whichever neighbouring integer makes the
slower side faster. Each path also has a fixed cost per layer that runs it at all (a
host round trip, a thread hand-off). A micro-benchmark cannot see those, so the costs are
re-fitted online from timings measured while serving, and the split uses the fitted ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def q_star(m: int, b_p: float, b_h: float) -> int:
    """The integer split that minimises max(q/B_P, (m−q)/B_H)."""
    if m <= 0:
        return 0
    exact = m * b_p / (b_p + b_h)
    lo, hi = math.floor(exact), math.ceil(exact)
    return min((lo, hi), key=lambda q: max(q / b_p, (m - q) / b_h))


@dataclass
class PathCost:
    """t(n) = fixed + n·per_expert, fitted by exponentially weighted least squares."""

    per_expert: float  # seconds
    fixed: float = 0.0
    decay: float = 0.98
    _s: list[float] = field(default_factory=lambda: [0.0] * 5)  # Σw, Σwn, Σwt, Σwn², Σwnt
    samples: int = 0

    def time(self, n: int) -> float:
        return 0.0 if n <= 0 else self.fixed + n * self.per_expert

    def observe(self, n: int, seconds: float) -> None:
        if n <= 0 or seconds <= 0:
            return
        s = [v * self.decay for v in self._s]
        for i, v in enumerate((1.0, n, seconds, n * n, n * seconds)):
            s[i] += v
        self._s = s
        self.samples += 1
        w, wn, wt, wnn, wnt = s
        det = w * wnn - wn * wn
        if self.samples >= 8 and det > 1e-9 * w * wnn:
            slope = (w * wnt - wn * wt) / det
            if slope > 0:
                self.per_expert = slope
                self.fixed = max(0.0, (wt - slope * wn) / w)
                return
        # too little spread in n to separate the two terms: keep the fixed part, refit the slope
        self.per_expert = max((wt / w - self.fixed) / max(wn / w, 1e-9), 1e-9)


@dataclass
class Split:
    pcie: PathCost
    cpu: PathCost

    def choose(self, m: int) -> int:
        """q in [0, m] minimising the slower of the two paths' fitted times."""
        best_q, best_t = 0, math.inf
        for q in range(m + 1):
            t = max(self.pcie.time(q), self.cpu.time(m - q))
            if t < best_t - 1e-12:
                best_q, best_t = q, t
        return best_q

    @classmethod
    def from_bandwidths(cls, expert_bytes: int, b_p: float, b_h: float) -> Split:
        return cls(PathCost(expert_bytes / b_p), PathCost(expert_bytes / b_h))


class ShareTuner:
    """Chooses, step by step, the share of a layer's misses fetched over PCIe, by measured
    step time.

    The costs a micro-benchmark cannot see (host round trips, thread hand-offs, the two paths
    sharing host DRAM) can make the bandwidth split q* slower end to end than sending every
    miss one way. So q*'s share is only the starting arm: a few shares are tried, the time
    of each decode step is kept as a moving average per share, and the fastest is used,
    with an occasional step on a neighbouring share so a change in the machine is seen.
    Whole step times, not times per miss: a share that caches less makes more misses, and
    per miss it would look cheaper than it is.
    """

    ARMS = (0.0, 0.25, 0.5, 0.75, 1.0)

    def __init__(self, prior: float, explore: float = 0.1, alpha: float = 0.2, seed: int = 0):
        import random

        self.mean: list[float | None] = [None] * len(self.ARMS)
        self.count = [0] * len(self.ARMS)
        self.prior = min(range(len(self.ARMS)), key=lambda i: abs(self.ARMS[i] - prior))
        self.arm = self.prior
        self.explore, self.alpha = explore, alpha
        self._rng = random.Random(seed)

    @property
    def share(self) -> float:
        return self.ARMS[self.arm]

    def observe(self, seconds: float) -> None:
        """The decode step just run with the current arm took `seconds`."""
        if seconds <= 0:
            return
        i = self.arm
        self.mean[i] = (
            seconds
            if self.mean[i] is None
            else (1 - self.alpha) * self.mean[i] + self.alpha * seconds
        )
        self.count[i] += 1

    def next_arm(self) -> float:
        """The share for the next step."""
        untried = [i for i, c in enumerate(self.count) if c < 2]
        if untried:  # every arm twice, starting from the prior's
            self.arm = min(untried, key=lambda i: abs(i - self.prior))
            return self.share
        best = min(range(len(self.ARMS)), key=lambda i: self.mean[i])
        if self._rng.random() < self.explore:
            best = min(max(best + self._rng.choice((-1, 1)), 0), len(self.ARMS) - 1)
        self.arm = best
        return self.share

    def stats(self) -> dict:
        return {
            "share": self.share,
            "step_ms": [None if m is None else m * 1e3 for m in self.mean],
            "steps": list(self.count),
        }


class ModeChooser:
    """How decode steps place the experts, chosen by measured step time among `modes`:

    cache   every layer through the cache, its books on the host, misses split between
            PCIe and the CPU;
    device  every layer through the cache, its books on the device, every miss fetched by
            a GPU kernel (no host work in a step: one CUDA graph);
    split   books on the device, a tuned share of each layer's misses fetched while the CPU
            computes the others (the host waits per layer for which routes are its own);
    layers  whole layers on the CPU, the rest fixed on the GPU (llama.cpp's --n-cpu-moe).
    Without locality in the routing, a cache holding a third of the experts hits a third of
    the time, and every layer's misses cost PCIe or CPU time; whole CPU layers move the same
    bytes with no bookkeeping (on the GPU machine 1.2–1.6× the host-kept cache at uniform
    routing, 0.7–0.8× with a skewed trace). Which is faster depends on the work being served,
    so each is measured for `measure` steps (after `settle` steps of each visit), the fastest
    is kept, and all are measured again every `period` steps. With `rounds` > 1 the modes are
    visited in turn that many times, each visit taking its share of the samples: a machine
    whose speed drifts (other work on the host's cores or memory) then slows every mode's
    samples alike instead of the ones measured last.

    A step's time depends on its batch as much as on the mode (four sequences' step is not
    one's), and the batch changes as requests come and go: each mode's samples are kept by
    batch size and the modes are compared at the size all of them were measured at most. A
    measurement with no size in common decides nothing: the mode in use stays, and the
    next measurement comes `retry` steps later.

    Measuring is not free: each visit moves the placement there and back (whole layers'
    experts, hundreds of milliseconds at times), and a user waits through it. So a mode
    measured `SLOW` times the fastest's step or more sits out the next `PRUNE` measurements,
    and a measurement that keeps the mode in use doubles the wait before the next one (up to
    `MAX_BACKOFF` periods); a change brings the wait back to `period`.

    The first answer a user waits for must not pay for the measuring: serving starts in
    `start` (the mode the bandwidths predict, or the one learned before on this machine),
    the first measurement waits `explore_after` steps, and between two visits the chooser
    serves in the best mode known for at least `rest` steps and until the visit's time is
    at most `duty` of the time since it began. Rationed by steps alone, visits to a mode
    several times slower took far more than their share: through the server on the H200,
    adaptive at one stream ran at 0.70 of lru-pcie while measuring.
    """

    SLOW = 1.5
    PRUNE = 3
    MAX_BACKOFF = 16

    def __init__(
        self,
        settle: int = 8,
        measure: int = 12,
        period: int = 4096,
        modes: tuple[str, ...] = ("cache", "layers"),
        rounds: int = 1,
        start: str | None = None,
        explore_after: int = 0,
        duty: float = 1.0,
    ):
        self.settle, self.measure, self.period, self.modes = settle, measure, period, modes
        self.rounds, self._per_visit = rounds, max(1, -(-measure // rounds))
        self.mode = self.home = start if start in modes else modes[0]
        self.means: dict[str, float] = {}
        self._plan: list[str] = []  # visits still to make, in order
        self._steps = 0  # steps since the current visit began
        self._visit: list[tuple[int, float]] = []  # this visit's (batch, seconds)
        # each mode's samples of this measurement, by batch size
        self._samples: dict[str, dict[int, list[float]]] = {}
        self.batch = 0  # the batch size the last decided measurement compared the modes at
        self.retry = explore_after or max(1, period // 8)
        self.wait = period  # steps from one choice to the next measurement
        self._skips: dict[str, int] = {}  # measurements a slow mode still sits out
        self._since = 0  # steps since the last choice
        visit = settle + self._per_visit
        self.rest = 0 if duty >= 1 else int(-(-visit * (1 - duty) // duty))
        self._pause = 0.0 if duty >= 1 else (1 - duty) / duty  # rest seconds a visit second
        self._resting = 0  # steps left in the best mode before the next visit
        self._resting_s = 0.0  # and seconds
        self._visit_s = 0.0  # the visit's time so far, its settling steps included
        self.completed = 0  # measurements completed
        if explore_after:
            self._since = max(0, period - explore_after)
        else:  # measure at once, every mode in order
            self._plan = list(modes) * rounds
            self.mode = self._plan[0]

    def _begin(self) -> None:
        """A new measurement: the others, then the mode in use."""
        self.home = self.mode
        others = [m for m in self.modes if m != self.mode and not self._skips.get(m)]
        self._skips = {m: n - 1 for m, n in self._skips.items() if n > 1}
        if not others:  # every other mode sits this one out: nothing to compare
            self._since = 0
            return
        self._plan = (others + [self.mode]) * self.rounds
        self._since, self._steps, self._visit, self._visit_s = 0, 0, [], 0.0
        self.mode = self._plan[0]

    def observe(self, seconds: float, batch: int = 1) -> None:
        """One decode step of `batch` sequences, run in the current mode, took `seconds`."""
        self._steps += 1
        if not self._plan:
            self._since += 1
            if self._since >= self.wait:
                self._begin()
            return
        if self._resting:
            self._resting_s -= seconds
            if self._resting > 1 or self._resting_s > 0:
                self._resting = max(1, self._resting - 1)
            else:
                self._resting = 0
                self.mode, self._steps = self._plan[0], 0
            return
        self._visit_s += seconds
        if self._steps > self.settle:  # the first steps after a switch pay for the switch
            self._visit.append((batch, seconds))
        if len(self._visit) >= self._per_visit:
            self._end_visit()

    def _end_visit(self) -> None:
        done = self._plan.pop(0)
        by_batch = self._samples.setdefault(done, {})
        for batch, seconds in self._visit:
            by_batch.setdefault(batch, []).append(seconds)
        self._visit, self._steps = [], 0
        if not self._plan:
            self._decide()
        elif self.rest:
            self._resting, self._resting_s = self.rest, self._visit_s * self._pause
            self.mode = self.best
        else:
            self.mode = self._plan[0]
        self._visit_s = 0.0

    def _decide(self) -> None:
        """Ends a measurement: each mode's median at the batch size every mode was measured
        at most, and the fastest serves; without such a size, the mode in use stays."""
        samples, self._samples = self._samples, {}
        common = set.intersection(*(set(b) for b in samples.values())) if samples else set()
        if not common:
            self.mode, self._since = self.home, max(0, self.wait - self.retry)
            return
        batch = max(common, key=lambda b: (min(len(samples[m][b]) for m in samples), -b))
        for mode, by_batch in samples.items():
            s = sorted(by_batch[batch])
            self.means[mode] = s[len(s) // 2]
        self.batch = batch
        self.mode = min(samples, key=self.means.get)
        fastest = self.means[self.mode]
        for mode in samples:
            if self.means[mode] >= self.SLOW * fastest:
                self._skips[mode] = self.PRUNE
        kept = self.completed and self.mode == self.home
        self.wait = min(2 * self.wait, self.MAX_BACKOFF * self.period) if kept else self.period
        self.completed += 1

    def charge(self, seconds: float) -> None:
        """A placement move (and the step that recaptured its graphs) took `seconds`: counted
        with the visit it serves, so the rest after that visit grows with it."""
        if self._resting:
            self._resting_s += seconds * self._pause
        elif self._plan:
            self._visit_s += seconds

    def adopt(self, mode: str) -> None:
        """Serves from `mode` from now on, unless a measurement is under way (it decides)."""
        if not self._plan and mode in self.modes:
            self.mode = self.home = mode

    @property
    def best(self) -> str:
        """Where to serve between visits: the mode that served before the measurement, until
        it has a time of its own to compare; then the fastest measured."""
        known = {m: t for m, t in self.means.items() if m in self.modes}
        return min(known, key=known.get) if self.home in known else self.home

    @property
    def visiting(self) -> bool:
        """Whether a visit is under way (a measurement's, not the rest between two)."""
        return bool(self._plan) and not self._resting

    @property
    def measuring(self) -> bool:
        """Whether a measurement is under way."""
        return bool(self._plan)

    @property
    def measured(self) -> bool:
        """Whether a measurement has completed and none is under way."""
        return not self._plan and bool(self.means)

    def stats(self) -> dict:
        return {
            "mode": self.mode,
            "step_ms": {k: v * 1e3 for k, v in self.means.items()},
            "batch": self.batch,
            "measuring": bool(self._plan),
        }
