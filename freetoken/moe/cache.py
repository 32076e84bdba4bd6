"""The GPU expert cache: one slot pool shared by every MoE layer, least-recently-used eviction.

Slots hold whole experts (one row of every bank). A packed expert fills its slot from the
first byte (`expert_part`): slots are as wide as the widest layer's format. The bookkeeping
lives on the host in numpy arrays: which (layer, expert) each slot holds, when it was last
used, and which slots are fixed in place (static placements and experts in use by the
current step).
"""

from __future__ import annotations

import numpy as np
import torch


class CacheFull(RuntimeError):
    """A step needs more slots than the pool has free of protected experts."""


def _release_device_memory(device: torch.device) -> None:
    # Freed tensors go back to PyTorch's cache; other programs need them back on the device.
    if device.type == "cuda":
        torch.cuda.empty_cache()


class ExpertCache:
    def __init__(
        self,
        num_layers: int,
        num_experts: int,
        capacity: int,
        rows: dict[str, tuple[int, ...]],
        dtypes: dict[str, torch.dtype],
        device: torch.device,
    ):
        """rows/dtypes: each bank's slot shape and dtype (HostBanks.rows, .dtypes: packed
        banks are uint8, their rows as wide as the widest layer's format)."""
        self.L, self.E = num_layers, num_experts
        self.rows, self.dtypes, self.device = rows, dtypes, device
        self.capacity = 0
        self.slots: dict[str, torch.Tensor] = {}
        self.slot_of = np.full((num_layers, num_experts), -1, dtype=np.int64)
        self.hits = np.zeros(num_layers, dtype=np.int64)
        self.misses = np.zeros(num_layers, dtype=np.int64)
        self.fetches = np.zeros(num_layers, dtype=np.int64)
        self.evictions = 0
        self.clock = 0
        self.volatile = 0  # slots [0, volatile) are overwritten by prefill streaming
        self.version = 0  # counts the slot tensors' replacements (captured steps hold them)
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self.slots = self._pool(capacity)
        self.owner = np.full(capacity, -1, dtype=np.int64)  # flat id layer * E + expert
        self.last_use = np.full(capacity, -1, dtype=np.int64)  # -1: empty
        self.fixed = np.zeros(capacity, dtype=bool)
        self.slot_of.fill(-1)

    def _pool(self, capacity: int) -> dict[str, torch.Tensor]:
        return {
            b: torch.empty((capacity, *shape), dtype=self.dtypes[b], device=self.device)
            for b, shape in self.rows.items()
        }

    @property
    def expert_bytes(self) -> int:
        """One slot's bytes."""
        return sum(int(np.prod(s)) * self.dtypes[b].itemsize for b, s in self.rows.items())

    def lookup(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Slot of each expert of `layer`, -1 where it is not cached; counts hits and misses."""
        slots = self.slot_of[layer, experts]
        hit = int((slots >= 0).sum())
        self.hits[layer] += hit
        self.misses[layer] += len(experts) - hit
        return slots

    def touch(self, slots: np.ndarray) -> None:
        """Marks slots used now, the later ones in the array as the more recent."""
        used = slots[slots >= 0]
        self.last_use[used] = np.arange(self.clock + 1, self.clock + 1 + len(used))
        self.clock += len(used)

    def allocate(self, layer: int, experts: np.ndarray, protect: np.ndarray) -> np.ndarray:
        """Slots for experts about to be fetched, evicting the least recently used others.

        `protect` are slots the current step reads; they are never chosen.
        """
        n = len(experts)
        if n == 0:
            return np.empty(0, dtype=np.int64)
        key = self.last_use.astype(np.float64)
        # Volatile slots (prefill's buffers) are refilled last among equals: what decode
        # caches elsewhere survives the next prefill.
        key[: self.volatile] += 0.5
        key[self.fixed] = np.inf
        key[protect[protect >= 0]] = np.inf
        if n > int(np.isfinite(key).sum()):
            raise CacheFull(
                f"layer {layer} needs {n} slots; {int(np.isfinite(key).sum())} can be freed"
            )
        victims = np.argpartition(key, n - 1)[:n] if n < len(key) else np.arange(n)
        victims = victims[np.argsort(key[victims], kind="stable")]
        old = self.owner[victims]
        was = old >= 0
        self.evictions += int(was.sum())
        self.slot_of[old[was] // self.E, old[was] % self.E] = -1
        self.owner[victims] = layer * self.E + experts
        self.slot_of[layer, experts] = victims
        self.last_use[victims] = np.arange(self.clock + 1, self.clock + 1 + n)
        self.clock += n
        self.fetches[layer] += n
        return victims

    def clear(self) -> None:
        """Forgets every cached expert (the slots keep their bytes until refilled)."""
        self.owner.fill(-1)
        self.last_use.fill(-1)
        self.fixed[:] = False
        self.slot_of.fill(-1)
        self.volatile = 0

    def keep(self, experts: dict[int, list[int]]) -> None:
        """Forgets every cached expert but `experts` (by layer); their slots become free."""
        wanted = np.zeros(self.slot_of.shape, dtype=bool)
        for layer, es in experts.items():
            wanted[layer, np.asarray(es, dtype=np.int64)] = True
        slots = np.flatnonzero(self.owner >= 0)
        owner = self.owner[slots]
        gone = ~wanted[owner // self.E, owner % self.E]
        self.slot_of[owner[gone] // self.E, owner[gone] % self.E] = -1
        self.owner[slots[gone]] = -1
        self.last_use[slots[gone]] = -1
        self.fixed[slots[gone]] = False

    def fix(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Places experts for good (static placement); returns their slots."""
        slots = self.allocate(layer, experts, np.empty(0, dtype=np.int64))
        self.fixed[slots] = True
        return slots

    def resize(self, capacity: int, keep_warm: bool = True) -> int:
        """A new slot pool of `capacity`; returns how many cached experts it kept.

        The fixed experts and then the most recently used ones are carried over (device to
        device) while both pools exist; where memory cannot hold both, the old pool is freed
        first and only the fixed experts are kept (their bytes come back from the host).
        """
        fixed = np.flatnonzero(self.fixed & (self.owner >= 0))
        if len(fixed) > capacity:
            raise CacheFull(
                f"{len(fixed)} experts are fixed in place; {capacity} slots cannot hold them"
            )
        used = np.flatnonzero(~self.fixed & (self.owner >= 0))
        used = used[np.argsort(-self.last_use[used], kind="stable")][
            : max(0, capacity - len(fixed))
        ]
        keep = np.concatenate([fixed, used]) if keep_warm else fixed
        old = self.slots
        try:
            new = self._pool(capacity)
        except torch.OutOfMemoryError:
            self.slots, old, keep = {}, None, fixed[:0]
            _release_device_memory(self.device)
            new = self._pool(capacity)
        # kept experts go to the top of the pool, away from prefill's buffers at the bottom
        top = capacity - len(keep)
        if old is not None and len(keep):
            src = torch.from_numpy(keep).to(self.device)
            for b in new:
                new[b][top:] = old[b].index_select(0, src)
        owner, last_use, was_fixed = self.owner[keep], self.last_use[keep], self.fixed[keep]
        self.slots = {}
        del old
        _release_device_memory(self.device)
        self.slots, self.capacity = new, capacity
        self.version += 1
        self.owner = np.full(capacity, -1, dtype=np.int64)
        self.last_use = np.full(capacity, -1, dtype=np.int64)
        self.fixed = np.zeros(capacity, dtype=bool)
        self.slot_of.fill(-1)
        self.owner[top:], self.last_use[top:], self.fixed[top:] = owner, last_use, was_fixed
        self.slot_of[owner // self.E, owner % self.E] = np.arange(top, capacity)
        self.volatile = 0
        return len(keep)

    def stats(
        self, more: tuple[int, int, int, int] = (0, 0, 0, 0), used: int | None = None
    ) -> dict:
        """Totals, plus `more` (hits, misses, evictions, fetches) counted elsewhere and not
        yet added, and `used` slots as counted there (the device-kept books')."""
        hits, misses = int(self.hits.sum()) + more[0], int(self.misses.sum()) + more[1]
        lookups = hits + misses
        return {
            "slots": self.capacity,
            "bytes": self.capacity * self.expert_bytes,
            "used": int((self.owner >= 0).sum()) if used is None else used,
            "hits": hits,
            "misses": misses,
            "fetches": int(self.fetches.sum()) + more[3],
            "evictions": self.evictions + more[2],
            "hit_rate": hits / lookups if lookups else 0.0,
        }


def expert_part(pool: torch.Tensor, slots: int | slice, like: torch.Tensor) -> torch.Tensor:
    """The bytes of pool slot(s) `slots` that an expert shaped like `like` fills (experts
    shaped like like[0] where slots is a range): its first ones. The same as pool[slots]
    where slots are exactly an expert's size."""
    if isinstance(slots, slice):
        part = pool[slots].flatten(1)[:, : like[0].numel()]
        return part.unflatten(1, like.shape[1:])
    return pool[slots].reshape(-1)[: like.numel()].view(like.shape)
