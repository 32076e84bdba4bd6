"""The GPU expert cache: one slot pool shared by every MoE layer, least-recently-used eviction.

Slots hold whole experts (one row of every bank). The bookkeeping lives on the host in
numpy arrays: which (layer, expert) each slot holds, when it was last used, and which
slots are fixed in place (static placements and experts in use by the current step).
"""

from __future__ import annotations

import numpy as np
import torch


class CacheFull(RuntimeError):
    """A step needs more slots than the pool has free of protected experts."""


class ExpertCache:
    def __init__(self, num_layers: int, num_experts: int, capacity: int,
                 rows: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device):
        self.L, self.E = num_layers, num_experts
        self.rows, self.dtype, self.device = rows, dtype, device
        self.capacity = 0
        self.slots: dict[str, torch.Tensor] = {}
        self.slot_of = np.full((num_layers, num_experts), -1, dtype=np.int64)
        self.hits = np.zeros(num_layers, dtype=np.int64)
        self.misses = np.zeros(num_layers, dtype=np.int64)
        self.fetches = np.zeros(num_layers, dtype=np.int64)
        self.evictions = 0
        self.clock = 0
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self.slots = {b: torch.empty((capacity, *shape), dtype=self.dtype, device=self.device)
                      for b, shape in self.rows.items()}
        self.owner = np.full(capacity, -1, dtype=np.int64)  # flat id layer * E + expert
        self.last_use = np.full(capacity, -1, dtype=np.int64)  # -1: empty
        self.fixed = np.zeros(capacity, dtype=bool)
        self.slot_of.fill(-1)

    @property
    def expert_bytes(self) -> int:
        size = torch.tensor([], dtype=self.dtype).element_size()
        return sum(int(np.prod(s)) * size for s in self.rows.values())

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
        key[self.fixed] = np.inf
        key[protect[protect >= 0]] = np.inf
        if n > int(np.isfinite(key).sum()):
            raise CacheFull(f"layer {layer} needs {n} slots; {int(np.isfinite(key).sum())} can be freed")
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

    def fix(self, layer: int, experts: np.ndarray) -> np.ndarray:
        """Places experts for good (static placement); returns their slots."""
        slots = self.allocate(layer, experts, np.empty(0, dtype=np.int64))
        self.fixed[slots] = True
        return slots

    def stats(self) -> dict:
        lookups = self.hits.sum() + self.misses.sum()
        return {"slots": self.capacity, "bytes": self.capacity * self.expert_bytes,
                "used": int((self.owner >= 0).sum()), "hits": int(self.hits.sum()),
                "misses": int(self.misses.sum()), "fetches": int(self.fetches.sum()),
                "evictions": self.evictions, "hit_rate": float(self.hits.sum() / lookups) if lookups else 0.0}
