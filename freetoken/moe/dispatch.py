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
