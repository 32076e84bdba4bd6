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
    # the measured bandwidths (bytes/s) the costs started from: the bound's B_P and B_H,
    # which the online fit (host round trips and hand-offs folded in) is not
    b_p: float = 0.0
    b_h: float = 0.0
    # seconds the device-kept books' fetch kernel takes an expert where measured (0: as
    # the copy engine's); what a miss costs the placements that fetch on the device
    fetch_s: float = 0.0

    def choose(self, m: int) -> int:
        """q in [0, m] minimising the slower of the two paths' fitted times."""
        best_q, best_t = 0, math.inf
        for q in range(m + 1):
            t = max(self.pcie.time(q), self.cpu.time(m - q))
            if t < best_t - 1e-12:
                best_q, best_t = q, t
        return best_q

    @classmethod
    def from_bandwidths(
        cls, expert_bytes: int, b_p: float, b_h: float, b_fetch: float | None = None
    ) -> Split:
        """From B_P, B_H and, where measured, the fetch kernel's bandwidth (bytes/s)."""
        fetch_s = expert_bytes / b_fetch if b_fetch else 0.0
        return cls(PathCost(expert_bytes / b_p), PathCost(expert_bytes / b_h), b_p, b_h, fetch_s)


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

    Each batch size keeps its own averages: four sequences' step is not one's, and served
    through the server one and four streams come and go in turn. Kept together, a share
    tried while four streams ran looked slower to the next single stream by the difference
    of the batches, not of the shares. A size seen first starts from the share found best
    at the nearest size already measured (q*'s where none is).

    A step's time counts for its share only where the step before it ran the same share at
    the same size: a step launched before the last one's tokens are read is timed as the
    one before it ends, so a share tried for a single step was credited with its
    neighbour's time (simulated a step late, the best of three shares served 0.55 of the
    steps against 0.89 timed in place). So a share tried is kept `HOLD` steps.
    """

    ARMS = (0.0, 0.25, 0.5, 0.75, 1.0)
    HOLD = 3

    def __init__(self, prior: float, explore: float = 0.1, alpha: float = 0.2, seed: int = 0):
        import random

        self.prior = min(range(len(self.ARMS)), key=lambda i: abs(self.ARMS[i] - prior))
        self.arm = self.prior
        self.batch = 1  # the batch size of the step the arm was chosen for
        self.explore, self.alpha = explore, alpha
        self._rng = random.Random(seed)
        self._means: dict[int, list[float | None]] = {}  # by batch size, one a share
        self._counts: dict[int, list[int]] = {}
        self._before = (self.arm, self.batch)  # the share and size of the step before
        self._held = 0  # steps the share is still kept

    @property
    def share(self) -> float:
        return self.ARMS[self.arm]

    @property
    def mean(self) -> list[float | None]:
        """The current batch size's average step time a share (None: not yet tried)."""
        return self._means.get(self.batch, [None] * len(self.ARMS))

    @property
    def count(self) -> list[int]:
        """The current batch size's steps a share."""
        return self._counts.get(self.batch, [0] * len(self.ARMS))

    def observe(self, seconds: float, batch: int = 1) -> None:
        """The decode step just run with the current arm, of `batch` sequences, took
        `seconds` (or the step before it, which counts alike only in the same share)."""
        if seconds <= 0 or self._before != (self.arm, batch):
            return
        means = self._means.setdefault(batch, [None] * len(self.ARMS))
        counts = self._counts.setdefault(batch, [0] * len(self.ARMS))
        i, old = self.arm, means[self.arm]
        means[i] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds
        counts[i] += 1

    def next_arm(self, batch: int = 1) -> float:
        """The share for the next step, of `batch` sequences."""
        self._before = (self.arm, self.batch)
        if self._held and batch == self.batch:
            self._held -= 1
            return self.share
        self.batch = batch
        counts, means = self.count, self.mean
        untried = [i for i, c in enumerate(counts) if c < 2]
        if untried:  # every arm twice, starting from the nearest size's best (or the prior)
            start = self._start_arm(batch)
            self.arm, self._held = min(untried, key=lambda i: abs(i - start)), self.HOLD - 1
            return self.share
        best = min(range(len(self.ARMS)), key=lambda i: means[i])
        if self._rng.random() < self.explore / self.HOLD:  # `explore` of the steps
            near = min(max(best + self._rng.choice((-1, 1)), 0), len(self.ARMS) - 1)
            best, self._held = near, (self.HOLD - 1) * (near != best)
        self.arm = best
        return self.share

    def _start_arm(self, batch: int) -> int:
        """The best share of the measured size nearest `batch`, else the prior's."""
        done = [b for b, c in self._counts.items() if b != batch and min(c) >= 2]
        if not done:
            return self.prior
        means = self._means[min(done, key=lambda b: (abs(b - batch), b))]
        return min(range(len(self.ARMS)), key=lambda i: means[i])

    def stats(self) -> dict:
        return {
            "share": self.share,
            "arms": list(self.ARMS),
            "step_ms": [None if m is None else m * 1e3 for m in self.mean],
            "steps": list(self.count),
            "by_batch": {
                b: {
                    "step_ms": [None if m is None else m * 1e3 for m in self._means[b]],
                    "steps": list(self._counts[b]),
                }
                for b in sorted(self._means)
            },
        }
