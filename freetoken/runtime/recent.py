"""The expert cache's recent behaviour: hit rate and misses per decoded token over the last
few hundred tokens, beside the totals since load (which a long session's history drowns).

The engine thread samples the cache's totals every `every` decoded tokens; the window is
the difference between the newest sample and the oldest kept.
"""

from __future__ import annotations

from collections import deque
from typing import Any


class Recent:
    def __init__(self, every: int = 64, keep: int = 5):
        self.every = every
        self.samples: deque[tuple[int, int, int]] = deque(maxlen=keep)  # tokens, hits, misses

    def due(self, decoded: int) -> bool:
        return not self.samples or decoded - self.samples[-1][0] >= self.every

    def sample(self, decoded: int, cache: dict[str, Any] | None) -> None:
        if cache is not None:
            self.samples.append((decoded, int(cache["hits"]), int(cache["misses"])))

    def window(self) -> dict[str, Any] | None:
        """{tokens, hit_rate, misses_per_token} over the window, None before two samples."""
        if len(self.samples) < 2:
            return None
        (t0, h0, m0), (t1, h1, m1) = self.samples[0], self.samples[-1]
        tokens, hits, misses = t1 - t0, h1 - h0, m1 - m0
        if tokens <= 0:
            return None
        lookups = hits + misses
        return {
            "tokens": tokens,
            "hit_rate": hits / lookups if lookups else 0.0,
            "misses_per_token": misses / tokens,
        }
