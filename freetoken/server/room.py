"""Whether a model fits beside those already loaded, and which idle ones make room for it.

Pure arithmetic on byte counts, so it is tested on made-up figures. What is free now is
measured; what other models hold comes from their runners (or, while they load, from their
estimate, part of which is not yet taken and so is still counted as spoken for).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from freetoken.doctor.fit import HOST_SHARE, VRAM_SHARE, Needs, gib
from freetoken.doctor.memory import Free

__all__ = ["Footprint", "Held", "Room", "TooLarge", "make_room"]


@dataclass(frozen=True)
class Footprint:
    host: int = 0
    vram: int = 0

    def __add__(self, other: Footprint) -> Footprint:
        return Footprint(self.host + other.host, self.vram + other.vram)

    def __sub__(self, other: Footprint) -> Footprint:
        return Footprint(self.host - other.host, self.vram - other.vram)

    def scaled(self, share: float) -> Footprint:
        return Footprint(int(self.host * share), int(self.vram * share))


@dataclass(frozen=True)
class Held:
    """A loaded, loading or stopping model, as the room for another is judged."""

    key: Hashable
    holds: Footprint  # memory it holds now
    pending: Footprint = Footprint()  # memory its load will still take
    idle: bool = False  # may be unloaded now (no request holds it)
    last_used: float = 0.0


@dataclass(frozen=True)
class Room:
    victims: tuple[Hashable, ...] = ()  # idle models to unload first, least recently used first
    wait: bool = False  # busy (or stopping) models hold what is missing: wait for them
    need: Footprint = field(default_factory=Footprint)


class TooLarge(RuntimeError):
    """A model that does not fit even with every other model unloaded."""


def _sum(parts: list[Footprint]) -> Footprint:
    total = Footprint()
    for p in parts:
        total = total + p
    return total


def make_room(name: str, needs: Needs, free: Free, held: list[Held]) -> Room:
    """The room for a load needing `needs` with `free` measured and `held` by other models;
    raises TooLarge with the numbers where it cannot fit at all."""
    vram_known = needs.on_gpu and free.vram is not None
    need = Footprint(needs.host, needs.vram if vram_known else 0)
    usable = Footprint(int(free.host * HOST_SHARE), int((free.vram or 0) * VRAM_SHARE))
    avail = usable - _sum([h.pending for h in held])
    short = Footprint(max(need.host - avail.host, 0), max(need.vram - avail.vram, 0))
    if not short.host and not short.vram:
        return Room(need=need)
    alone = avail + _sum([h.holds for h in held])
    if need.host > alone.host or need.vram > alone.vram:
        raise TooLarge(_too_large(name, needs, need, alone))
    victims = []
    for h in sorted((h for h in held if h.idle), key=lambda h: h.last_used):
        helps = (short.host > 0 and h.holds.host > 0) or (short.vram > 0 and h.holds.vram > 0)
        if not helps:
            continue
        victims.append(h.key)
        short = Footprint(max(short.host - h.holds.host, 0), max(short.vram - h.holds.vram, 0))
        if not short.host and not short.vram:
            return Room(victims=tuple(victims), need=need)
    return Room(wait=True, need=need)


def _too_large(name: str, needs: Needs, need: Footprint, alone: Footprint) -> str:
    parts = []
    if need.host > alone.host:
        parts.append(f"{needs.host_text()}, and {gib(alone.host)} is available")
    if need.vram > alone.vram:
        parts.append(f"{needs.vram_text()}, and {gib(alone.vram)} is free")
    return (
        f"model '{name}' does not fit: it needs "
        + "; and ".join(parts)
        + (
            " with no other model loaded (stop other programs, or lower num_ctx or "
            "FREETOKEN_KV_CACHE_SIZE)"
        )
    )
