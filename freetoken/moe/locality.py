"""Where a load with nothing learned starts: the placement the bandwidths predict for
uniform routing, and the check device's first decode steps make of how far the routing is
from uniform (moe/tuning.py drives it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from freetoken.moe.policy import Mode

# Where the books live on the device, a load with nothing learned starts in device (every
# miss fetched and kept), so the first decode steps show how much locality the routing has.
# After LOCALITY_STEPS of them the misses are compared with what uniform routing gives at
# this cache size: at NEAR_UNIFORM of that or more the cache has nothing to keep and the
# bandwidths' prediction serves; below it device stays. Through the server on the H200 the
# prediction (split) left 4-6x device's misses uncached and ran at 0.64-0.73 of its speed.
# Yet a small cache keeps little even where the routing has locality: at 8 GiB of the
# 48-layer shape (BF16, trace routing) device missed 0.44 of the routes, uniform's 0.92, and
# ran at 0.42 of the bound, 0.98 of lru-pcie's speed. So the prediction also serves where
# it would win with uniform's misses against device's own: uniform · its cost a miss <
# device's misses · B_P's cost a miss (at 8 GiB: split's cost a miss is 0.33 of device's).
LOCALITY_STEPS = 32
NEAR_UNIFORM = 0.8
# Yet 32 steps in device are dear where the cache is small: at 8 GiB of the 48-layer shape
# (Q4_K_M, near-uniform routing, through the server on an H100) device took 86 ms a step and
# split 34, so the check cost the first answer 1.7 s. After EARLY_STEPS the prediction
# serves at once where the misses already come to EARLY_MARGIN times the rate device must
# stay under: the cache, warming, would have to cut them by a third in the steps left. The
# verdict is kept with what adaptive learned, so a later load starts from it.
EARLY_STEPS = 8
EARLY_MARGIN = 1.5


def predict(
    modes: tuple[Mode, ...], layers: int, experts: int, capacity: int, pcie_s: float, cpu_s: float
) -> Mode:
    """The placement the bandwidths predict fastest for decode, with routing taken as
    uniform (a cache holding a fraction f of the experts hits f of the routes). Per route:
      device  (1 − f)·S/B_P          split   (1 − f)·S/(B_P + B_H)
      layers  (1 − f)·S/B_H (the CPU layers' routes: a fraction 1 − f of the layers)
      cache   split's, and a host round trip a layer on top, so never first."""
    f = min(1.0, capacity / max(layers * experts, 1))
    cost = miss_costs(pcie_s, cpu_s)
    return min(modes, key=lambda m: ((1 - f) * cost[m], modes.index(m)))


def miss_costs(pcie_s: float, cpu_s: float) -> dict[Mode, float]:
    """Each placement's seconds a miss, from one expert's over PCIe and on the CPU (predict)."""
    both = pcie_s * cpu_s / (pcie_s + cpu_s)
    return {Mode.DEVICE: pcie_s, Mode.SPLIT: both, Mode.LAYERS: cpu_s, Mode.CACHE: both * 1.5}


@dataclass
class LocalityCheck:
    """The first decode steps of a load, served in device, judged against uniform routing."""

    predicted: Mode  # what the bandwidths predict for uniform routing
    uniform_miss_rate: float  # misses a route at uniform routing: 1 - capacity / (L * E)
    cost_ratio: float = 1.0  # the prediction's cost a miss over device's (miss_costs)
    start: tuple[int, int] | None = None  # (hits, misses) at the first decode step
    steps: int = 0  # decode steps since

    def step(self, lookups: Callable[[], tuple[int, int]]) -> tuple[Mode, int, int] | None:
        """Counts a decode step; `lookups()` gives the cache's (hits, misses) totals (a device
        read: called at the first step and where the check may judge only). Once judged: the
        placement to serve from, and the hits and misses it was judged on; else None."""
        if self.start is None:
            self.start = lookups()
            return None
        self.steps += 1
        if self.steps not in (EARLY_STEPS, LOCALITY_STEPS):
            return None
        hits, misses = (now - then for now, then in zip(lookups(), self.start))
        if self.steps < LOCALITY_STEPS and not self.early(hits, misses):
            return None
        return self.verdict(hits, misses), hits, misses

    def bar(self) -> float:
        """The misses a route device must stay under to keep serving."""
        return min(NEAR_UNIFORM, self.cost_ratio) * self.uniform_miss_rate

    def verdict(self, hits: int, misses: int) -> Mode:
        """The placement to serve from: the prediction where the misses came near uniform,
        or where it would win even with uniform's misses."""
        near = misses / max(hits + misses, 1) >= self.bar()
        return self.predicted if near else Mode.DEVICE

    def early(self, hits: int, misses: int) -> bool:
        """Whether the misses so far are far enough over the bar to judge now."""
        return misses / max(hits + misses, 1) >= EARLY_MARGIN * self.bar()
