"""The expert cache's bookkeeping on the device, for decode steps.

On the host path every layer pays a round trip: the routes come back to the host, the
host looks them up, picks victims and queues copies. Here the same least-recently-used
cache runs as a handful of device ops — look up, stamp the hits, pick the victims with a
top-k over the slots' stamps, remap, and a kernel that copies each miss from the pinned
host bank into its slot — so a decode step needs no host work and its graph is not cut.

One copy of the bookkeeping is authoritative at a time: the host's (`ExpertCache`) for
prefill, batches, resizes and placement changes, this one between `push` and `pull`.
Stamps are unique (clock·STRIDE + route), so the eviction order is exactly that of an LRU
that touches one layer's routes in route order; fixed slots are stamped NEVER. A step of
several tokens books each distinct expert once, at its first route (`first_routes`): its
slot then serves every route to it, and no expert is fetched twice.
"""

from __future__ import annotations

import numpy as np
import torch

from freetoken.kernels import moe_gpu
from freetoken.kernels.triton import block
from freetoken.moe.banks import HostBanks
from freetoken.moe.cache import ExpertCache

NEVER = 2**62  # the stamp of a fixed slot: never a victim
STRIDE = 1024  # stamps per layer call: more than any top-k
FUSED_MAX_SLOTS = 1 << 15  # the fused kernel holds every slot's stamp in one program


class DeviceLRU:
    def __init__(self, cache: ExpertCache, banks: HostBanks, device: torch.device):
        self.cache, self.banks, self.device = cache, banks, device
        L, E, S = cache.L, cache.E, cache.capacity
        # one extra entry at the end of each: a sink that masked scatters write to
        self.slot_of = torch.full((L * E + 1,), -1, dtype=torch.int32, device=device)
        self.owner = torch.full((S + 1,), -1, dtype=torch.int64, device=device)
        self.stamp = torch.full((S + 1,), NEVER, dtype=torch.int64, device=device)
        self.clock = torch.zeros(1, dtype=torch.int64, device=device)
        self.counts = torch.zeros(
            (L, 4), dtype=torch.int64, device=device
        )  # hits, misses, evictions, fetches
        self._pulled = np.zeros((L, 4), dtype=np.int64)  # the counts already added to the host's
        self.live = False  # True while this copy is the authoritative one
        self.fused = True  # one kernel per layer on a GPU (the device ops below are its reference)
        # the share of misses `assign(split=True)` fetches: read on the device, so a step
        # captured once follows the share tuner's later choices
        self.share = torch.ones(1, dtype=torch.float32, device=device)

    # --- handing the bookkeeping over ----------------------------------------------------
    def push(self) -> None:
        """Host → device: from now on decode steps keep the books here."""
        c, S = self.cache, self.cache.capacity
        stamp = c.last_use * STRIDE
        empty = c.owner < 0
        stamp[empty] = np.arange(int(empty.sum())) - S - 1  # empty slots first, in slot order
        stamp[c.fixed] = NEVER
        self.slot_of[:-1].copy_(torch.from_numpy(c.slot_of.reshape(-1).astype(np.int32)))
        self.owner[:-1].copy_(torch.from_numpy(c.owner))
        self.stamp[:-1].copy_(torch.from_numpy(stamp))
        self.clock.fill_(c.clock + 1)
        self.live = True

    def unpulled(self) -> np.ndarray:
        """[L, 4] hits, misses, evictions and fetches counted here since the last pull. Reads
        only, so any thread may ask (statistics) while steps run."""
        return self.counts.cpu().numpy() - self._pulled

    def used(self) -> int:
        """Slots holding an expert, by the device's books (reads only, like `unpulled`)."""
        return int((self.owner[:-1] >= 0).sum())

    def pull(self) -> tuple[int, int]:
        """Device → host: from now on the host keeps the books. Returns the misses and the
        fetches counted since the last pull."""
        c = self.cache
        slot_of, owner, stamp, counts, clock = (
            t.cpu().numpy().copy()
            for t in (self.slot_of[:-1], self.owner[:-1], self.stamp[:-1], self.counts, self.clock)
        )
        counts, self._pulled = counts - self._pulled, counts
        c.slot_of[:] = slot_of.reshape(c.L, c.E)
        c.owner[:] = owner
        used = (owner >= 0) & ~c.fixed
        c.last_use[used] = np.maximum(stamp[used], 0) // STRIDE
        c.last_use[owner < 0] = -1
        c.clock = max(c.clock, int(clock[0]))
        c.hits += counts[:, 0]
        c.misses += counts[:, 1]
        c.fetches += counts[:, 3]
        c.evictions += int(counts[:, 2].sum())
        self.live = False
        return int(counts[:, 1].sum()), int(counts[:, 3].sum())

    # --- one layer of a decode step ------------------------------------------------------
    def __call__(self, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each route of a step's `ids` [T, k], fetching every miss first."""
        slots, fetch, _ = self.assign(layer, ids)
        self.fetch(layer, ids, fetch)
        return slots

    def assign(
        self,
        layer: int,
        ids: torch.Tensor,
        split: bool = False,
        counts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Books a step's routes `ids` [T, k]: slots [T, k], what to fetch (a slot per route,
        -1 for none) and which routes are left to the CPU ([T·k] bool).

        Every miss is fetched, or with `split` the first round(share·m) of the m missed
        experts in route order (`self.share`); the others keep slot -1 and are not cached.
        The hits, misses, evictions and fetches are added to `counts` [4] (the layer's row
        of `self.counts` unless given: guessed routes count apart)."""
        counts = self.counts[layer] if counts is None else counts
        if self.fused and self.device.type == "cuda" and self.cache.capacity <= FUSED_MAX_SLOTS:
            return self.assign_fused(layer, ids, split, counts)
        E, S = self.cache.E, self.cache.capacity
        flat = ids.reshape(-1) + layer * E  # [T·k]
        k = flat.numel()
        first = first_routes(flat)
        slots = self.slot_of.index_select(0, flat).long()
        miss = (slots < 0) & first
        fetched = miss
        if split:
            q = torch.floor(miss.sum() * self.share[0] + 0.5)  # half up, as the fused kernel rounds
            fetched = miss & (torch.cumsum(miss, 0) <= q)
        now = self.clock * STRIDE + torch.cumsum(first, 0) - 1  # unique, in order of first route
        sink_slot = torch.full_like(slots, S)
        hit = (slots >= 0) & first
        self.stamp.scatter_(0, torch.where(hit, slots, sink_slot), now)  # hits: used now
        self.stamp[S:].fill_(
            NEVER
        )  # (a scalar written by indexing would be a host copy: not capturable)
        victims = torch.topk(self.stamp[:S], min(k, S), largest=False).indices  # oldest first
        v = victims.index_select(0, (torch.cumsum(fetched, 0) - 1).clamp(min=0))
        target = torch.where(fetched, v, sink_slot)
        old = self.owner.index_select(0, target).masked_fill(~fetched, -1)
        sink_flat = torch.full_like(flat, self.slot_of.numel() - 1)
        self.slot_of.scatter_(0, torch.where(old >= 0, old, sink_flat), -1)
        self.slot_of.scatter_(0, torch.where(fetched, flat, sink_flat), v.to(torch.int32))
        self.owner.scatter_(0, target, flat.masked_fill(~fetched, -1))
        self.stamp.scatter_(0, target, now)
        self.stamp[S:].fill_(NEVER)
        counts += torch.stack([hit.sum(), miss.sum(), (old >= 0).sum(), fetched.sum()])
        self.clock += 1
        final = self.slot_of.index_select(0, flat).long()  # a repeated expert's slot too
        return final.view(ids.shape), v.masked_fill(~fetched, -1).to(torch.int32), final < 0

    def assign_fused(
        self, layer: int, ids: torch.Tensor, split: bool, counts: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`assign` as one kernel launch (kernels/triton/books.py): the same books and results."""
        from freetoken.kernels.triton import books

        flat = ids.reshape(-1)
        k, S = flat.numel(), self.cache.capacity
        slots = torch.empty(k, dtype=torch.int64, device=ids.device)
        fetch = torch.empty(k, dtype=torch.int32, device=ids.device)
        cpu = torch.empty(k, dtype=torch.bool, device=ids.device)
        books.assign_kernel[(1,)](
            flat,
            self.slot_of,
            self.owner,
            self.stamp,
            self.clock,
            counts,
            slots,
            fetch,
            cpu,
            layer * self.cache.E,
            k,
            S,
            self.share,
            STRIDE=STRIDE,
            HAS_SHARE=split,
            K=max(block(k), 2),
            BLOCK_S=max(block(S), 16),
            num_warps=8,
        )
        return slots.view(ids.shape), fetch, cpu

    def fetch(self, layer: int, ids: torch.Tensor, fetch: torch.Tensor) -> None:
        """Copies the experts `assign` chose to fetch from the pinned host banks into their
        slots. The routes' ids go to the kernel as the router gave them: a cast to int32
        was one more launch a layer of every captured step, whether or not it missed."""
        experts = ids.reshape(-1)
        banks = [(src, self.cache.slots[name]) for name, src in self.banks.banks[layer].items()]
        moe_gpu.fetch_banks(banks, experts, fetch)


def first_routes(flat: torch.Tensor) -> torch.Tensor:
    """Whether each route [n] is the first to its expert in the step (n² compares, on the
    device: a step routes a few dozen at most)."""
    n = flat.numel()
    earlier = torch.ones(n, n, dtype=torch.bool, device=flat.device).tril(-1)
    return ~((flat[:, None] == flat[None, :]) & earlier).any(1)
