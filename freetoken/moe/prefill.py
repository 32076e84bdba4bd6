"""Prefill by streaming whole layers: while layer l computes, layer l+1's experts cross PCIe.

During prefill nearly every expert of a layer is routed to, so fetching misses one by one
is the wrong shape. Two full-layer buffers are carved from the slot pool (slots [0, E) and
[E, 2E), expert e of a layer at buffer slot e, so routes need no host round trip). A copy
stream fills the next layer's buffer while the current layer computes; experts already
cached are copied device to device, the rest from the host banks in contiguous runs. A
buffer is refilled only after the layer that read it has finished (a release event).
Packed layers stream packed: what crosses PCIe is the blocks.
"""

from __future__ import annotations

import numpy as np
import torch

from freetoken.kernels import moe_gpu
from freetoken.moe.banks import HostBanks
from freetoken.moe.cache import ExpertCache, expert_part


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) runs of True in a boolean array."""
    padded = np.concatenate([[False], mask, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


class LayerStreamer:
    def __init__(
        self,
        banks: HostBanks,
        cache: ExpertCache,
        layers: list[int],
        device: torch.device,
        copy_stream: torch.cuda.Stream | None,
        overlap: bool = True,
    ):
        self.banks, self.cache, self.layers, self.device = banks, cache, layers, device
        self.E = banks.num_experts
        self.copy_stream, self.overlap = copy_stream, overlap
        self.cuda = copy_stream is not None
        self.base = [0, self.E]  # first slot of each buffer
        self._ready: list[torch.cuda.Event | None] = [None, None]
        self._released: list[torch.cuda.Event | None] = [None, None]
        self._active = False
        self.stats = {"chunks": 0, "h2d_experts": 0, "d2d_experts": 0}
        cache.volatile = 2 * self.E

    @staticmethod
    def possible(cache: ExpertCache | None, num_experts: int) -> bool:
        """Streaming needs both buffers without touching experts fixed in place."""
        return (
            cache is not None
            and cache.capacity >= 2 * num_experts
            and not cache.fixed[: 2 * num_experts].any()
        )

    def __call__(
        self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        i = self.layers.index(layer)
        if i == 0:
            self._begin()
            self._prefetch(0)
        if i + 1 < len(self.layers):
            self._prefetch(i + 1)
        buf = i % 2
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self._ready[buf])
        route_slots = ids + self.base[buf]
        spec = self.banks.specs[layer]
        out = moe_gpu.experts_from_slots(x, route_slots, weights, self.cache.slots, spec)
        if self.cuda:
            self._released[buf] = torch.cuda.current_stream(self.device).record_event()
        if i + 1 == len(self.layers):
            self._end()
        return out

    def _begin(self) -> None:
        """Takes slots [0, 2E) for the buffers, evicting whatever they cached."""
        c, n = self.cache, 2 * self.E
        held = c.owner[:n] >= 0
        old = c.owner[:n][held]
        c.slot_of[old // c.E, old % c.E] = -1
        c.evictions += int(held.sum())
        c.owner[:n] = -1
        c.fixed[:n] = True  # not for the LRU while prefill uses them
        self._ready = [None, None]
        self._released = [None, None]
        self._active = True
        self.stats["chunks"] += 1

    def _end(self) -> None:
        """Hands the buffers back; the last two layers' experts in them stay usable as cached."""
        c, E = self.cache, self.E
        c.fixed[: 2 * E] = False
        c.last_use[: 2 * E] = -1  # the first to be overwritten
        for i in range(max(0, len(self.layers) - 2), len(self.layers)):
            layer, base = self.layers[i], self.base[i % 2]
            fresh = np.flatnonzero(c.slot_of[layer] < 0)  # not cached elsewhere already
            c.slot_of[layer, fresh] = base + fresh
            c.owner[base + fresh] = layer * E + fresh
        self._active = False

    def _prefetch(self, i: int) -> None:
        layer, buf = self.layers[i], i % 2
        if not self.cuda:
            self._fill(layer, buf)
            return
        stream = self.copy_stream
        stream.wait_stream(
            torch.cuda.current_stream(self.device)
        )  # x and earlier slots are settled
        if self._released[buf] is not None:
            stream.wait_event(self._released[buf])  # the layer that read this buffer is done
        with torch.cuda.stream(stream):
            self._fill(layer, buf)
            self._ready[buf] = stream.record_event()
        if not self.overlap:
            self._ready[buf].synchronize()

    def _fill(self, layer: int, buf: int) -> None:
        c, base = self.cache, self.base[buf]
        cached = c.slot_of[layer]
        banks = self.banks.banks[layer]
        for start, end in _runs(cached < 0):  # from host memory, contiguous runs at once
            for bank, src in banks.items():
                dst = expert_part(c.slots[bank], slice(base + start, base + end), src[start:end])
                self.banks.h2d(dst, src[start:end], self.cuda)
            self.stats["h2d_experts"] += end - start
        for e in np.flatnonzero(cached >= 0).tolist():  # already on the GPU: device to device
            for bank in banks:
                c.slots[bank][base + e].copy_(c.slots[bank][int(cached[e])], non_blocking=self.cuda)
            self.stats["d2d_experts"] += 1
