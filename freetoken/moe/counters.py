"""What an offload backend counts for its statistics: routed work and where host time goes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Counters:
    # routed work: misses (m) and fetches (q) of cached layers, routes computed on the CPU,
    # and experts-op calls (layers)
    steps: dict[str, int] = field(
        default_factory=lambda: {"q": 0, "m": 0, "cpu_routes": 0, "layers": 0}
    )
    # where the host's time goes: waiting for the GPU, waiting for the CPU part, in total
    timers: dict[str, float] = field(
        default_factory=lambda: {"sync_s": 0.0, "cpu_wait_s": 0.0, "host_s": 0.0}
    )

    def account(self, m: int, q: int, cpu_routes: int) -> None:
        """One layer's work: m misses, q of them fetched, cpu_routes routes on the CPU."""
        s = self.steps
        s["m"] += m
        s["q"] += q
        s["cpu_routes"] += cpu_routes
        s["layers"] += 1

    def time(self, name: str, seconds: float) -> None:
        self.timers[name] += seconds
