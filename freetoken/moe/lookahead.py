"""Fetching the next MoE layer's experts while this one computes (decode, books on the device).

With the cache's books on the device a decode step fetches each miss when its layer asks
for it, so every fetch sits on the step's critical path. A layer's input differs from the
next layer's by one attention and one MoE output added to the residual stream, so the
next layer's router applied to this layer's expert input names most of the next layer's
experts. Lookahead books those names at once on a side stream and fetches the misses among
them there, while this layer's experts and the next layer's attention run; the next layer's
own booking then finds them in their slots and fetches only what the guess left out.

A wrong guess costs PCIe time off the critical path and an LRU victim; it never changes a
result: the real routes are booked as always, and a guessed expert is a hit like any other.
Victims are the least recently used slots, and this layer's experts were just stamped, so
with at least twice a step's routes in the pool the side stream never overwrites a slot
this layer reads (`fits`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from freetoken.layers.routers import Router
from freetoken.moe.device_lru import DeviceLRU

__all__ = ["Lookahead"]


class Lookahead:
    def __init__(
        self,
        routers: dict[int, Router],
        layers: list[int],
        device: torch.device,
        on_cpu: Callable[[int], bool],
    ):
        order = sorted(layers)
        # a router that chooses by token ids needs the step's tokens: not guessed
        self.next = {
            a: b
            for a, b in zip(order, order[1:], strict=False)
            if b in routers and not routers[b].by_token
        }
        self.routers, self.device = routers, device
        # a layer on the CPU cuts a captured step, which would end the capture with the side
        # stream not joined: no guess is made for one
        self.on_cpu = on_cpu
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # what the guesses booked, per layer: hits, misses, evictions, fetches (the real
        # bookings count apart, so hit rates stay those of the routes the model took)
        self.counts = torch.zeros((max(order, default=0) + 1, 4), dtype=torch.int64, device=device)
        # tensors the side stream reads or writes, kept alive until the layer they guessed
        # joins it: freed earlier, the allocator could hand their memory to the main stream
        # while the side stream still uses it
        self._held: dict[int, tuple[torch.Tensor, ...]] = {}

    @staticmethod
    def fits(lru: DeviceLRU, routes: int) -> bool:
        return lru.cache.capacity >= 2 * routes

    def join(self, layer: int) -> None:
        """Before `layer` books its own routes: the guess for it is booked and fetched."""
        held = self._held.pop(layer, None)
        if held is not None and self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def after(self, layer: int, x: torch.Tensor, lru: DeviceLRU) -> None:
        """Once `layer`'s own booking and fetch are queued: guesses the next layer's experts
        from `x` (this layer's expert input) and books and fetches them on the side stream."""
        n = self.next.get(layer)
        if n is None or self.on_cpu(n):
            return
        if self.stream is None:  # on the CPU nothing overlaps: the same books, in order
            self._book(n, x, lru)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self._held[n] = (x, *self._book(n, x, lru))

    def _book(self, layer: int, x: torch.Tensor, lru: DeviceLRU) -> tuple[torch.Tensor, ...]:
        _, ids = self.routers[layer](x)
        slots, fetch, cpu = lru.assign(layer, ids, counts=self.counts[layer])
        lru.fetch(layer, ids, fetch)
        return ids, slots, fetch, cpu

    def fetched(self) -> int:
        """Experts the guesses fetched so far (reads the device's count)."""
        return int(self.counts[:, 3].sum())
